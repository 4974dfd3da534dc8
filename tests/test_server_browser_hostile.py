"""The dashboard as a demanding user and an attacker would use it, in a real Chromium against a
real `car serve`: double clicks, keyboard focus during a live heist, switching sessions while
answers are still on their way, a branch (never accused), an error quoting a very long word.

CAR_OLD_STATIC=DIR serves the page's app.js/app.css from DIR instead (to check that a test fails
on an older page: `git show HEAD:engine/server/static/app.js > DIR/app.js`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from playwright.sync_api import Browser, Page, Route
from server_helpers import Server, finished_heist, start, wait_status
from test_server_browser import NARROW, browser, server  # noqa: F401 (fixtures)
from test_server_browser import new_page as _new_page

T = 30_000  # generous Playwright waits (ms)


def new_page(browser: Browser, viewport: dict[str, int] | None = None) -> Page:  # noqa: F811
    page = _new_page(browser, viewport) if viewport else _new_page(browser)
    old = os.environ.get("CAR_OLD_STATIC")
    if old:
        for name in ("app.js", "app.css"):
            body = (Path(old) / name).read_text()
            ctype = "text/javascript" if name.endswith(".js") else "text/css"
            page.route(f"**/static/{name}", _serve(body, ctype))
    return page


def _serve(body: str, ctype: str) -> Any:
    return lambda route: route.fulfill(body=body, content_type=ctype)


def posts(page: Page, suffix: str) -> list[str]:
    seen: list[str] = []
    page.on(
        "request",
        lambda r: seen.append(r.url) if r.method == "POST" and r.url.endswith(suffix) else None,
    )
    return seen


def error_toasts(page: Page) -> list[str]:
    out: list[str] = []

    def watch(r: Any) -> None:
        if r.status >= 400 and "/api/" in r.url:
            out.append(f"{r.status} {r.url}")

    page.on("response", watch)
    return out


def test_badge_keeps_focus_and_identity_while_events_arrive(
    browser: Browser,  # noqa: F811
    server: Server,  # noqa: F811
) -> None:
    """A keyboard user on a badge during a live heist: every tool call used to rebuild the
    badges, so the focus fell to <body> and a click straddling an event was lost."""
    with server.client() as c:
        sid = start(c, rounds=40, step_delay=0.2)
    page = new_page(browser)
    try:
        page.goto(f"{server.url}/#session={sid}")
        page.wait_for_selector(".badge[data-agent=intel]", timeout=T)
        page.wait_for_function("() => window.__car.shown.length > 2", timeout=T)
        page.focus(".badge[data-agent=intel]")
        page.evaluate("() => { window.__badge = document.activeElement; }")
        tools = page.locator("#feed .tool").count()
        page.wait_for_function(
            f"() => document.querySelectorAll('#feed .tool').length >= {tools + 4}", timeout=T
        )
        assert page.evaluate("() => window.__badge.isConnected")
        assert page.evaluate("() => document.activeElement === window.__badge")
        page.keyboard.press("Enter")  # marks the suspect through the focused badge
        page.wait_for_selector(".badge.suspect[data-agent=intel]", timeout=T)
        # the tool counts on the badges still follow the stream
        page.wait_for_function(
            "() => [...document.querySelectorAll('.badge .tools')]"
            ".some(t => /\\d+\\/\\d+ tools ok/.test(t.textContent))",
            timeout=T,
        )
        assert not page.errors  # type: ignore[attr-defined]
    finally:
        with server.client() as c:
            c.post(f"/api/sessions/{sid}/stop")


def test_double_clicks_send_each_action_once(browser: Browser, server: Server) -> None:  # noqa: F811
    """Double-clicking Pause, Stop or Reveal sent the request twice; the second got 409
    ("already paused", "already stopping", "already accused") and a red error toast."""
    with server.client() as c:
        sid = start(c, rounds=40, step_delay=0.2)
    page = new_page(browser)
    pauses, stops, accusations = posts(page, "/pause"), posts(page, "/stop"), posts(page, "/accuse")
    failed = error_toasts(page)
    page.goto(f"{server.url}/#session={sid}")
    page.wait_for_selector("#btn-pause:enabled", timeout=T)
    page.dblclick("#btn-pause")
    page.wait_for_selector("#status:text('paused')", timeout=T)
    page.wait_for_selector("#btn-stop:enabled", timeout=T)
    page.dblclick("#btn-stop")
    page.wait_for_selector("#status:text('stopped')", timeout=T)
    page.wait_for_function("() => window.__car.ends > 0", timeout=T)
    page.wait_for_selector("#btn-reveal:enabled", timeout=T)
    page.click(".badge[data-agent=intel]")
    page.dblclick("#btn-reveal")
    page.wait_for_selector("#verdict", timeout=T)
    page.wait_for_load_state("networkidle")
    assert (len(pauses), len(stops), len(accusations)) == (1, 1, 1), (pauses, stops, accusations)
    assert failed == [] and not page.locator("#toast.error:visible").count(), failed
    assert page.is_disabled("#btn-reveal")
    assert not page.errors  # type: ignore[attr-defined]


def test_branch_is_not_offered_an_accusation(browser: Browser, server: Server) -> None:  # noqa: F811
    """A branch cannot be accused (the server answers 409): Reveal stays disabled there, with
    the reason shown, instead of inviting a click that fails."""
    with server.client(timeout=120) as c:
        root = finished_heist(c)
        fork = c.post(f"/api/sessions/{root}/fork", json={"at": 3, "do": "resample", "n": 1})
        assert fork.status_code == 200, fork.text
        branch = fork.json()["branches"][0]["run_id"]
        wait_status(c, branch, {"completed"})
    page = new_page(browser)
    page.goto(f"{server.url}/#session={branch}")
    page.wait_for_function("() => window.__car.ends > 0", timeout=T)
    page.wait_for_selector("#lab:not([hidden])", timeout=T)
    assert page.is_disabled("#btn-reveal")
    assert "branch" in page.inner_text("#suspect-line")
    # its game is still accusable
    page.goto(f"{server.url}/#session={root}")
    page.reload()
    page.wait_for_selector("#btn-reveal:enabled", timeout=T)


def test_late_answer_of_the_previous_session_is_dropped(
    browser: Browser,  # noqa: F811
    server: Server,  # noqa: F811
) -> None:
    """Session A's branch tree answers only after the user switched to session B: it used to be
    drawn into B's page (B then showed A's family)."""
    with server.client(timeout=120) as c:
        a = finished_heist(c)
        b = finished_heist(c)
    page = new_page(browser)
    held: list[Route] = []
    page.route(f"**/api/sessions/{a}/tree", lambda r: held.append(r))
    page.goto(f"{server.url}/#session={a}")
    page.wait_for_selector("#lab:not([hidden])", timeout=T)
    for _ in range(600):  # Playwright's own wait pumps the route handler
        if held:
            break
        page.wait_for_timeout(50)
    assert held, "A's tree request never came"
    page.evaluate(f"() => {{ location.hash = '#session={b}'; }}")
    page.wait_for_selector(f"#tree button[data-session='{b}']", timeout=T)
    for r in held:
        r.continue_()
    page.wait_for_load_state("networkidle")
    page.wait_for_timeout(300)  # lets a late answer reach the page, if it is drawn at all
    assert page.inner_text("#sid") == b
    assert page.locator(f"#tree button[data-session='{a}']").count() == 0
    assert page.locator(f"#tree button[data-session='{b}']").count() == 1


def test_error_with_a_long_word_stays_in_its_box(browser: Browser, server: Server) -> None:  # noqa: F811
    """A 422 quoting what the user typed (a 300-letter word) is shown in full, inside the toast
    and the viewport, with its HTTP status."""
    with server.client(timeout=120) as c:
        sid = finished_heist(c)
    page = new_page(browser, NARROW)
    page.goto(f"{server.url}/#session={sid}")
    page.wait_for_selector("#lab:not([hidden])", timeout=T)
    word = "W" * 300
    page.fill("#fork-at", "3")
    page.select_option("#fork-do", "policy")
    page.fill("#fork-value", word)
    page.fill("#fork-n", "1")
    page.click("#fork-form button[type=submit]")
    toast = page.locator("#toast.error")
    toast.wait_for(timeout=T)
    text = toast.inner_text()
    assert word in text.replace("\n", "") and "422" in text
    box = page.evaluate(
        """() => { const t = document.getElementById('toast');
                   const r = t.getBoundingClientRect();
                   return {sw: t.scrollWidth, cw: t.clientWidth, right: r.right, vw: innerWidth};
                 }"""
    )
    assert box["sw"] <= box["cw"] + 1 and box["right"] <= box["vw"], box
    assert page.evaluate("() => document.documentElement.scrollWidth") <= NARROW["width"]


def test_no_secret_before_the_reveal(browser: Browser, server: Server) -> None:  # noqa: F811
    """Before the verdict neither the DOM (text, attributes), the page's storage nor its console
    names the mole's strategy or the mole as such."""
    with server.client(timeout=120) as c:
        sid = finished_heist(c)
    page = new_page(browser)
    logs: list[str] = []
    page.on("console", lambda m: logs.append(m.text))
    page.goto(f"{server.url}/#session={sid}")
    page.wait_for_function("() => window.__car.ends > 0", timeout=T)
    page.wait_for_selector("#lab:not([hidden])", timeout=T)
    html = page.content() + page.evaluate("() => JSON.stringify(sessionStorage)")
    for word in ("mole_assigned", '"strategy"', 'class="badge mole', "mole-name"):
        assert word not in html, word
    assert page.locator(".badge.mole").count() == 0
    assert not any("mole" in line.lower() for line in logs), logs
