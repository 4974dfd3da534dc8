"""The dashboard end to end in a real browser: Debian's Chromium driven by Playwright against a
real `car serve` subprocess. Screenshots land in artifacts/screenshots/ (ignored by git, kept by
CI as artifacts)."""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Page, sync_playwright
from server_helpers import ARTIFACTS, Server, car_serve, sse_events, wait_status

from engine import events as ev
from engine.journal import Journal

WIDE = {"width": 1280, "height": 800}
NARROW = {"width": 390, "height": 844}


def chromium_path() -> str:
    path = os.environ.get("CAR_CHROMIUM") or shutil.which("chromium")
    if not path:
        raise RuntimeError(
            "Chromium is missing: scripts/test installs Debian's `chromium` package "
            "(apt-get install chromium)"
        )
    return path


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        # Debian's Chromium, never a browser downloaded by Playwright
        b = p.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    journal = tmp_path_factory.mktemp("browser") / "journal.db"
    with car_serve(journal, "--sim-step-delay", "0.2") as s:
        yield s


def shot(page: Page, name: str, full: bool = False) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=full)
    return path


def new_page(browser: Browser, viewport: dict[str, int] = WIDE) -> Page:
    page = browser.new_context(viewport=viewport).new_page()  # type: ignore[arg-type]
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.errors = errors  # type: ignore[attr-defined]
    return page


def car(page: Page) -> dict[str, Any]:
    return page.evaluate("() => window.__car")  # type: ignore[no-any-return]


def messages(page: Page) -> int:
    return page.locator("#feed li.msg").count()


def wait_until(cond: Any, timeout: float = 30, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def secret(server: Server, sid: str) -> ev.MoleAssigned:
    with Journal(server.journal) as j:
        for stored in j.read(sid):
            if isinstance(stored.event, ev.MoleAssigned):
                return stored.event
    raise AssertionError("no mole")


def test_the_mole_game_live_in_the_browser(browser: Browser, server: Server) -> None:
    """Quick start, watch messages arrive, pause (no new step for a while), resume, reload in
    the middle (the stream resumes with no gap and no repeat), stop, analyse, accuse, reveal;
    a second browser watching the same heist sees exactly the same events."""
    page = new_page(browser)
    page.goto(server.url + "/")
    page.click(".qs-options summary")
    page.fill("#qs-rounds", "40")
    page.click("#quick-start")
    page.wait_for_selector("#session:not([hidden])")
    wait_until(lambda: messages(page) >= 3, what="three messages")
    sid = page.inner_text("#sid")
    assert page.locator("#feed .tool").count() >= 1  # tool calls with their success

    watcher = new_page(browser)
    watcher.goto(f"{server.url}/#session={sid}")
    wait_until(lambda: messages(watcher) >= 3, what="the watcher's messages")
    shot(page, "dashboard-live")

    page.click("#btn-pause")
    page.wait_for_selector("#status:text('paused')", timeout=10_000)
    watcher.wait_for_selector("#status:text('paused')", timeout=10_000)
    with httpx.Client(base_url=server.url) as c:
        steps = c.get(f"/api/sessions/{sid}").json()["steps"]
        n = messages(page)
        time.sleep(1.5)
        assert messages(page) == n
        assert c.get(f"/api/sessions/{sid}").json()["steps"] == steps
    shot(page, "dashboard-paused")

    page.click("#btn-resume")
    wait_until(lambda: messages(page) > n + 2, what="messages after resume")

    before = car(page)["shown"]
    page.reload()
    page.wait_for_selector("body[data-resumed-from]")
    resumed_from = car(page)["resumedFrom"]
    assert resumed_from >= before[-1]
    wait_until(lambda: len(car(page)["received"]) >= 3, what="events after the reload")
    page.click("#btn-stop")
    page.wait_for_selector("#status:text('stopped')", timeout=10_000)
    wait_until(lambda: car(page)["ends"] >= 1 and car(watcher)["ends"] >= 1, what="stream end")

    with httpx.Client(base_url=server.url) as c:
        full = [e["seq"] for e in sse_events(c, sid)[0]]
    after_reload = car(page)["received"]
    assert after_reload == sorted(set(after_reload)) and after_reload[0] > resumed_from
    assert car(page)["shown"] == full  # restored + resumed: nothing missing, nothing twice
    assert car(watcher)["received"] == full and car(watcher)["shown"] == full
    assert page.locator("#feed li.msg").count() == watcher.locator("#feed li.msg").count()

    page.click("#btn-analyze")
    page.wait_for_selector(".bar-row", timeout=60_000)
    assert page.locator(".bar-row").count() == 6
    assert page.locator(".breakdown tbody tr").count() == 6
    with httpx.Client(base_url=server.url) as c:
        suggestion = c.post("/api/ai-detect/suggest", json={"session_id": sid}).json()
    hint = page.locator("#hint")
    if suggestion["confidence"] > 0.6:
        assert hint.is_visible() and suggestion["suggested_mole"] in hint.inner_text()
    else:
        assert not hint.is_visible()

    mole = secret(server, sid)
    suspect = "intel"
    page.click(f".badge[data-agent={suspect}]")
    assert page.locator(".badge.suspect").count() == 1
    page.click("#btn-reveal")
    page.wait_for_selector("#verdict")
    assert page.inner_text("#mole-name") == mole.agent
    assert page.inner_text("#mole-strategy") == mole.strategy
    want = "SUCCESS" if mole.agent == suspect else "FAILURE"
    assert want in page.inner_text("#verdict")
    assert page.locator(f".badge.mole[data-agent={mole.agent}]").count() == 1
    page.wait_for_selector("#lab:not([hidden])")
    shot(page, "dashboard-reveal")
    page.set_viewport_size(NARROW)  # type: ignore[arg-type]
    shot(page, "dashboard-reveal-narrow")
    assert page.evaluate("() => document.documentElement.scrollWidth") <= NARROW["width"]
    assert not page.errors and not watcher.errors  # type: ignore[attr-defined]


def test_finished_run_branches_attribution_and_text_only(browser: Browser, server: Server) -> None:
    """A finished run shows its outcome, the fork form (an outcome distribution comes back and
    the branches join the tree), the branch diff and the attribution chart. A message holding
    HTML is shown as text: no element is created from it, no script runs."""
    with httpx.Client(base_url=server.url, timeout=60) as c:
        sid = c.post("/api/sessions", json={"seed": 7, "step_delay": 0}).json()["session_id"]
        wait_status(c, sid, {"completed"})
    page = new_page(browser)
    page.goto(f"{server.url}/#session={sid}")
    page.wait_for_selector("#lab:not([hidden])")
    assert "the plan would fail" in page.inner_text("#outcome").lower()

    payload = '<img src=x onerror="window.__xss=1"><b id="xss">bold</b> [PLAN:entry_time=01:00]'
    page.fill("#fork-at", "5")
    page.select_option("#fork-do", "action")
    page.fill("#fork-value", payload)
    page.fill("#fork-n", "3")
    page.click("#fork-form button[type=submit]")
    page.wait_for_selector("#fork-rate", timeout=60_000)
    assert "3 branches" in page.inner_text("#fork-rate") or "/3 branches" in page.inner_text(
        "#fork-rate"
    )
    page.wait_for_function("() => document.querySelectorAll('#tree li li').length === 3")
    page.locator("#tree li li button").first.click()
    page.wait_for_selector("#diff .step")
    assert "first diverging step 5" in page.inner_text("#diff")
    assert page.locator("#diff ins").count() >= 1

    page.click("#btn-attribute")
    page.wait_for_selector(".attr-row", timeout=240_000)
    # the scan runs from the last step back to the point of commitment, not over all 24
    assert 1 <= page.locator(".attr-row").count() <= 24
    assert "forward runs" in page.inner_text("#attribution")
    shot(page, "dashboard-finished", full=True)

    # a locus that the later steps' intervals do not settle says so, and what would settle it
    weak = {
        "locus": 2, "locus_agent": "hacker", "forward_runs": 131,
        "ranked": [{"step": 2, "agent": "hacker", "effect": -0.02, "ci": [-0.07, -0.005], "n": 102},
                   {"step": 3, "agent": "intel", "effect": 0.0, "ci": [-0.198, 0.0], "n": 29}],
        "locus_settled": False, "not_excluded": [3],
        "to_settle": {"half_width": 0.0098, "runs_per_step": 358},
    }  # fmt: skip
    page.evaluate("d => renderAttribution(d)", weak)
    note = page.inner_text("#attribution .unsettled")
    assert "step 3 rescued no run" in note and "step 2's (-0.020)" in note
    assert "half-width of 0.0098" in note and "358 forward runs" in note
    # ... and offers to settle it: `car attribute --settle 3` through the API, whose real
    # answer (of this heist) then says how settling ended
    sent: list[Any] = []
    page.on(
        "request",
        lambda r: sent.append(r.post_data_json) if r.url.endswith("/attribution") else None,
    )
    page.click("#btn-settle")
    page.wait_for_selector("#settle-line", timeout=240_000)
    assert sent == [{"method": "contrastive", "settle": 3, "seed": 0}]
    line = page.inner_text("#settle-line")
    assert "of at most 3 (each at 98.33%, 95% in all;" in line and "forward run" in line
    assert page.locator("#btn-settle").count() == 0  # a settling answer is not offered again
    page.evaluate("d => renderAttribution(d)", {**weak, "locus_settled": True, "not_excluded": []})
    assert page.locator("#attribution .unsettled").count() == 0
    assert page.locator("#btn-settle").count() == 0  # nothing to settle

    # the blog's hint rule, on the page's own renderer: shown above 0.6 confidence only
    for confidence, shown in ((0.6, False), (0.61, True), (0.95, True), (0.2, False)):
        page.evaluate(
            """c => renderAnalysis({suggested_mole: "intel", confidence: c,
                 suspicion_scores: {intel: 0.9, hacker: 0.1}, score_breakdown: {}})""",
            confidence,
        )
        assert page.locator("#hint").is_visible() == shown, confidence
        if shown:
            assert "intel is the mole" in page.inner_text("#hint")

    page.locator("#diff button", has_text="open branch").click()
    page.wait_for_function(
        "() => document.querySelectorAll('#feed li.msg').length === 24 && window.__car.ends > 0"
    )
    step5 = page.locator("#feed li[data-step='5'] .text").inner_text()
    assert step5 == payload
    assert page.locator("#xss").count() == 0 and page.locator("#feed img").count() == 0
    assert page.evaluate("() => window.__xss") is None
    assert not page.errors  # type: ignore[attr-defined]


def test_sessions_list_opens_past_heists(browser: Browser, server: Server) -> None:
    """The list shows past heists newest first; clicking one opens it."""
    with httpx.Client(base_url=server.url, timeout=60) as c:
        sid = c.post("/api/sessions", json={"rounds": 1, "step_delay": 0}).json()["session_id"]
        wait_status(c, sid, {"completed"})
    page = new_page(browser, NARROW)
    page.goto(server.url + "/")
    first = page.locator("#sessions button").first
    first.wait_for()
    assert first.get_attribute("data-session") == sid
    first.click()
    page.wait_for_function("() => window.__car.ends > 0")
    assert page.inner_text("#sid") == sid and messages(page) == 6
    shot(page, "dashboard-narrow")
    assert page.evaluate("() => document.documentElement.scrollWidth") <= NARROW["width"]


#: a crew of two, so that a heist of one round has two steps
PAIR = (
    "agents:\n"
    "  - {name: boss, role: Planner, goal: Plan the job, tools: [calculator]}\n"
    "  - {name: eye, role: Lookout, goal: Watch the street, tools: [file_reader]}\n"
)

#: a count of one with a plural noun: "1 steps", "0/1 branches"
ONE_PLURAL = re.compile(r"(?<![\d.])1 (steps|rounds|agents|branches|tools|forward runs)\b")


def test_counts_of_one_are_singular(browser: Browser, server: Server) -> None:
    """The sessions list said "1 steps", the run's line "1 rounds", a fork of one branch
    "(0/1 branches)" and "1 branches in this family", its diff "(1 steps differ)". A count of
    one now takes the singular, any other count the plural."""
    with httpx.Client(base_url=server.url, timeout=120) as c:
        # stopped during the long pause after its first step: one step
        one = c.post("/api/sessions", json={"config": PAIR, "rounds": 1, "step_delay": 10})
        one = one.json()["session_id"]
        wait_until(lambda: c.get(f"/api/sessions/{one}").json()["steps"] >= 1, what="a step")
        assert c.post(f"/api/sessions/{one}/stop").status_code == 202
        assert wait_status(c, one, {"stopped"})["steps"] == 1
        two = c.post("/api/sessions", json={"config": PAIR, "rounds": 1, "step_delay": 0})
        two = two.json()["session_id"]
        assert wait_status(c, two, {"completed"})["steps"] == 2
    page = new_page(browser)
    page.goto(server.url + "/")
    row = page.locator(f"#sessions button[data-session='{one}']")
    row.wait_for()
    assert "1 step ·" in row.inner_text(), row.inner_text()
    assert "2 steps ·" in page.inner_text(f"#sessions button[data-session='{two}']")
    assert not ONE_PLURAL.search(page.inner_text("#sessions"))

    page.goto(f"{server.url}/#session={two}")
    page.wait_for_selector("#lab:not([hidden])")
    assert "2 agents · 1 round" in page.inner_text("#meta"), page.inner_text("#meta")
    page.fill("#fork-at", "1")
    page.select_option("#fork-do", "action")
    page.fill("#fork-value", "A different last word.")
    page.fill("#fork-n", "1")
    page.click("#fork-form button[type=submit]")
    page.wait_for_selector("#fork-rate", timeout=60_000)
    assert re.search(r"\(\d/1 branch\)", page.inner_text("#fork-rate")), page.inner_text(
        "#fork-rate"
    )
    page.wait_for_selector("#tree .note:has-text('1 branch in this family')")
    page.locator("#tree li li button").first.click()
    page.wait_for_selector("#diff .step")
    assert "(1 step differs)" in page.inner_text("#diff"), page.inner_text("#diff")
    text = page.inner_text("body")
    assert not ONE_PLURAL.search(text), ONE_PLURAL.search(text)

    page.goto(f"{server.url}/#session={one}")
    page.reload()
    page.wait_for_function("() => window.__car.ends > 0")
    assert "2 agents · 1 round" in page.inner_text("#meta")
    text = page.inner_text("body")
    assert not ONE_PLURAL.search(text), ONE_PLURAL.search(text)
    assert not page.errors  # type: ignore[attr-defined]


def test_openapi_page_renders(browser: Browser, server: Server) -> None:
    """/docs renders the API's operations with the vendored Swagger UI."""
    page = new_page(browser)
    page.goto(server.url + "/docs")
    page.wait_for_selector(".opblock", timeout=30_000)
    assert page.locator(".opblock").count() >= 14
    shot(page, "openapi")
