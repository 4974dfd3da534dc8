"""The dashboard as a demanding user and an attacker would use it, in a real Chromium against a
real `car serve`: double clicks, keyboard focus during a live heist, switching sessions while
answers are still on their way, a branch (never accused), an error quoting a very long word,
a live stream whose server goes away or is busy (and what the page then says of the run), a
sessions list refreshed while unfolded.

CAR_OLD_STATIC=DIR serves the page's app.js/app.css from DIR instead (to check that a test fails
on an older page: `git show HEAD:engine/server/static/app.js > DIR/app.js`)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, Page, Route
from server_helpers import ARTIFACTS, Server, car_serve, finished_heist, start, wait_status
from servers import free_port
from test_server_browser import NARROW, browser, chromium_path, server  # noqa: F401 (fixtures)
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


# ---------------------------------------------------------------- the live stream's failures

#: a name that is not this machine's for the server's Host check, resolved to 127.0.0.1 by the
#: browser of the tests below (a proxy's name, as `car serve --allow-host` is meant for)
PROXY_NAME = "car-proxy.test"


@pytest.fixture(scope="module")
def proxied_browser(browser: Browser) -> Iterator[Browser]:  # noqa: F811
    """A second Chromium that resolves PROXY_NAME to 127.0.0.1."""
    b = browser.browser_type.launch(
        executable_path=chromium_path(),
        args=["--no-sandbox", f"--host-resolver-rules=MAP {PROXY_NAME} 127.0.0.1"],
    )
    yield b
    b.close()


def stream_answers(page: Page, sid: str) -> list[tuple[float, int]]:
    """(when, HTTP status) of each answer to the page's requests for the session's stream."""
    seen: list[tuple[float, int]] = []
    path = f"/api/sessions/{sid}/events"
    page.on(
        "response",
        lambda r: seen.append((time.monotonic(), r.status)) if path in r.url else None,
    )
    return seen


def pump_until(page: Page, cond: Any, timeout: float, what: str) -> None:
    """Wait for a condition that Playwright's own events make true (they run only while it
    waits)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        page.wait_for_timeout(100)


@pytest.mark.parametrize("refusal", [404, 403])
def test_live_view_says_why_it_stopped(
    proxied_browser: Browser, tmp_path: Path, refusal: int
) -> None:
    """The server streaming a live heist is replaced, on the same port, by one that answers the
    page's reconnect with 404 (another journal: the session is unknown there) or 403 (the same
    journal, but no longer answering the proxy's name the page was opened with). The live dot
    stayed on and nothing was said; now the dot goes off, a note says that the live view stopped
    and names the status, and no further request is made."""
    port = free_port()
    first = tmp_path / "first.db"
    allow = ["--allow-host", PROXY_NAME]
    page = new_page(proxied_browser)
    with car_serve(first, *allow, "--workers", "0", port=port) as a:
        with a.client() as c:
            sid = start(c, rounds=40, step_delay=0.2)
        answers = stream_answers(page, sid)
        page.goto(f"http://{PROXY_NAME}:{port}/#session={sid}")
        page.wait_for_function("() => window.__car.shown.length > 3", timeout=T)
        page.wait_for_selector("#live:visible", timeout=T)
        assert page.locator("#stream-note:visible").count() == 0
    # the server stopped (its heist with it) while the page was streaming
    second, again = (first, []) if refusal == 403 else (tmp_path / "second.db", allow)
    with car_serve(second, *again, "--workers", "0", port=port):
        pump_until(page, lambda: any(s == refusal for _, s in answers), 90, f"a {refusal}")
        page.wait_for_selector("#live", state="hidden", timeout=5_000)
        note = page.locator("#stream-note")
        note.wait_for(state="visible", timeout=5_000)
        text = note.inner_text()
        assert "stopped" in text and f"HTTP {refusal}" in text, text
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / f"dashboard-stream-{refusal}.png"))
        tries = len(answers)
        page.wait_for_timeout(4_000)
        assert len(answers) == tries, answers  # a refusal is not asked again
        assert answers[-1][1] == refusal, answers
    assert not page.errors  # type: ignore[attr-defined]


#: every control that acts on the open run
RUN_CONTROLS = (
    "#btn-pause",
    "#btn-resume",
    "#btn-stop",
    "#btn-analyze",
    "#btn-reveal",
    "#btn-attribute",
    "#fork-form button[type=submit]",
)

#: the run statuses the pill has a colour for
STATUSES = ("recording", "paused", "completed", "stopped", "failed", "abandoned", "ok", "bad")


def detail_answers(page: Page, sid: str) -> list[int]:
    """The HTTP status of each answer to the page's requests for the session's detail."""
    seen: list[int] = []
    path = f"/api/sessions/{sid}"
    page.on(
        "response",
        lambda r: seen.append(r.status) if r.url.split("?")[0].endswith(path) else None,
    )
    return seen


def pill_claims_a_status(page: Page) -> list[str]:
    """The statuses whose pill looks like the status pill does now (its colours)."""
    return page.evaluate(  # type: ignore[no-any-return]
        """statuses => {
             const look = (node) => { const s = getComputedStyle(node);
                                      return s.backgroundColor + "|" + s.color; };
             const now = look(document.getElementById("status"));
             return statuses.filter((st) => {
               const probe = document.createElement("span");
               probe.className = `pill ${st}`;
               document.body.append(probe);
               const same = look(probe) === now;
               probe.remove();
               return same;
             });
           }""",
        list(STATUSES),
    )


@pytest.mark.parametrize("refusal", [404, 403])
def test_run_is_unknown_once_the_live_view_stopped(
    proxied_browser: Browser, tmp_path: Path, refusal: int
) -> None:
    """The live stream stops for good as above (404: another journal, 403: the proxy's name no
    longer answered). The pill went on saying RECORDING and Pause and Stop stayed enabled,
    though the page no longer knew what became of the run. Now the page asks the server for the
    session once; as it does not say either (the same 404 or 403), the pill says UNKNOWN in no
    status's colours and every control of the run is disabled, until a session is opened
    again."""
    port = free_port()
    first = tmp_path / "first.db"
    allow = ["--allow-host", PROXY_NAME]
    page = new_page(proxied_browser)
    with car_serve(first, *allow, "--workers", "0", port=port) as a:
        with a.client() as c:
            sid = start(c, rounds=40, step_delay=0.2)
        answers = stream_answers(page, sid)
        details = detail_answers(page, sid)
        page.goto(f"http://{PROXY_NAME}:{port}/#session={sid}")
        page.wait_for_function("() => window.__car.shown.length > 3", timeout=T)
        page.wait_for_selector("#btn-pause:enabled", timeout=T)
        assert page.get_attribute("#status", "class") == "pill recording"
        assert details == [200], details
    second, again = (first, []) if refusal == 403 else (tmp_path / "second.db", allow)
    with car_serve(second, *again, "--workers", "0", port=port) as b:
        pump_until(page, lambda: any(s == refusal for _, s in answers), 90, f"a {refusal}")
        page.wait_for_selector("#status.unknown", timeout=10_000)
        assert page.get_attribute("#status", "class") == "pill unknown"
        assert page.inner_text("#status").lower() == "unknown"
        assert pill_claims_a_status(page) == []
        for control in RUN_CONTROLS:
            assert page.is_disabled(control), control
        assert page.is_hidden("#lab") and page.is_hidden("#live")
        assert "stopped" in page.inner_text("#stream-note")
        # a click on a disabled Reveal does nothing: no accusation, no mole
        page.click(".badge[data-agent=intel]")
        page.click("#btn-reveal", force=True)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / f"dashboard-unknown-{refusal}.png"))
        page.wait_for_timeout(3_000)
        assert details == [200, refusal], details  # asked once, not again
        assert page.locator("#verdict, .badge.mole").count() == 0
        if refusal == 404:
            # the list is loaded again: the new journal holds no such session
            page.wait_for_selector(f"#sessions button[data-session='{sid}']", state="detached")
            # opening a session again shows its own state, with its controls
            with b.client() as c:
                other = start(c, rounds=40, step_delay=0.2)
            try:
                page.evaluate(f"() => {{ location.hash = '#session={other}'; }}")
                page.wait_for_selector("#btn-pause:enabled", timeout=T)
                assert page.get_attribute("#status", "class") == "pill recording"
                assert page.is_enabled("#btn-stop")
            finally:
                with b.client() as c:
                    c.post(f"/api/sessions/{other}/stop")
    assert not page.errors  # type: ignore[attr-defined]


def test_stopped_live_view_shows_what_the_server_says(browser: Browser, server: Server) -> None:  # noqa: F811
    """Something between the page and the server (a proxy) refuses the stream with 403 while
    the server still answers the session, which was stopped meanwhile by another client. The
    page kept saying RECORDING with Pause and Stop enabled; now it asks the server once and
    shows what it says: STOPPED, no Pause or Stop, a run that may be accused and forked."""
    with server.client() as c:
        sid = start(c, rounds=40, step_delay=0.2)
    page = new_page(browser)
    held: list[Route] = []
    page.route(f"**/api/sessions/{sid}/events*", lambda r: held.append(r))
    details = detail_answers(page, sid)
    try:
        page.goto(f"{server.url}/#session={sid}")
        pump_until(page, lambda: bool(held), 30, "the stream's request")
        page.wait_for_selector("#status.recording", timeout=T)
        assert page.is_disabled("#btn-pause")  # its stream is not connected yet
        assert details == [200], details
    finally:
        with server.client() as c:
            c.post(f"/api/sessions/{sid}/stop")
            wait_status(c, sid, {"stopped"})
    held[0].fulfill(status=403, content_type="application/json", body='{"error": "refused"}')
    page.wait_for_selector("#stream-note:has-text('HTTP 403')", timeout=T)
    page.wait_for_selector("#status.stopped", timeout=T)
    assert page.get_attribute("#status", "class") == "pill stopped"
    for control in ("#btn-pause", "#btn-resume", "#btn-stop"):
        assert page.is_disabled(control), control
    page.wait_for_selector("#btn-reveal:enabled", timeout=T)
    page.wait_for_selector("#lab:not([hidden])", timeout=T)
    assert page.is_enabled("#fork-form button[type=submit]")
    page.wait_for_timeout(1_000)
    assert details == [200, 200], details  # asked once after the refusal
    assert len(held) == 1  # a refusal is not asked again
    assert page.locator("#verdict, .badge.mole").count() == 0
    assert not page.errors  # type: ignore[attr-defined]


def test_live_view_waits_when_the_server_is_busy(browser: Browser, server: Server) -> None:  # noqa: F811
    """The stream's request is answered 429 with Retry-After: 2, then 503 without it (the
    server's own events route answers neither today, so they are put in the browser's network
    path), then by the server. The old page gave up at the first, its dot on, saying nothing.
    Now the dot is off while the note names each status and that it retries; the tries are
    spaced as told (2 s), then by a back-off, and the third one resumes the live view."""
    with server.client() as c:
        sid = start(c, rounds=40, step_delay=0.2)
    page = new_page(browser)
    tries: list[float] = []

    def answer(route: Route) -> None:
        tries.append(time.monotonic())
        if len(tries) == 1:
            route.fulfill(
                status=429,
                headers={"Retry-After": "2"},
                content_type="application/json",
                body='{"error": "busy"}',
            )
        elif len(tries) == 2:
            route.fulfill(status=503, content_type="application/json", body='{"error": "down"}')
        else:
            route.continue_()

    try:
        page.route(f"**/api/sessions/{sid}/events*", answer)
        page.goto(f"{server.url}/#session={sid}")
        note = page.locator("#stream-note")
        page.wait_for_selector("#stream-note:has-text('HTTP 429')", timeout=T)
        assert "retrying" in note.inner_text() and not page.is_visible("#live")
        page.wait_for_selector("#stream-note:has-text('HTTP 503')", timeout=T)
        assert "retrying" in note.inner_text() and not page.is_visible("#live")
        page.wait_for_selector("#live:visible", timeout=T)
        assert not note.is_visible()
        n = page.evaluate("() => window.__car.shown.length")
        page.wait_for_function(f"() => window.__car.shown.length > {n + 2}", timeout=T)
        assert len(tries) == 3, tries
        assert tries[1] - tries[0] >= 1.8, tries  # Retry-After: 2
        assert tries[2] - tries[1] >= 0.9, tries  # a back-off, not at once
        assert not page.errors  # type: ignore[attr-defined]
    finally:
        with server.client() as c:
            c.post(f"/api/sessions/{sid}/stop")


# ---------------------------------------------------------------- the sessions list


def test_sessions_refresh_keeps_older_sessions_unfolded(
    browser: Browser,  # noqa: F811
    server: Server,  # noqa: F811
) -> None:
    """The list refreshes itself every 15 s: that refresh folded "Older sessions" away again,
    and the button the keyboard was on with it. Now the unfolded sessions stay, the focused one
    keeps the focus and stays in view, and a heist started meanwhile joins the top."""
    with server.client(timeout=120) as c:
        while c.get("/api/sessions", params={"limit": 1}).json()["total"] < 18:
            wait_status(c, start(c, rounds=1, step_delay=0), {"completed"})
    page = new_page(browser)
    page.clock.install()
    page.goto(server.url + "/")
    rows = page.locator("#sessions button")
    rows.first.wait_for(timeout=T)
    assert rows.count() == 15
    page.click("#more-sessions")
    page.wait_for_function(
        "() => document.querySelectorAll('#sessions button').length > 15", timeout=T
    )
    shown = rows.count()
    last = rows.nth(shown - 1)
    target = last.get_attribute("data-session")
    last.focus()
    with server.client(timeout=120) as c:
        newest = start(c, rounds=1, step_delay=0)
        wait_status(c, newest, {"completed"})
    page.clock.run_for(16_000)
    page.wait_for_selector(f"#sessions button[data-session='{newest}']", timeout=T)
    assert rows.first.get_attribute("data-session") == newest
    ids = [rows.nth(i).get_attribute("data-session") for i in range(rows.count())]
    assert target in ids and len(ids) == shown + 1 and len(set(ids)) == len(ids), ids
    assert page.evaluate("() => document.activeElement.dataset.session") == target
    view = page.evaluate(
        f"""() => {{ const box = document.querySelector('.col-sessions').getBoundingClientRect();
                   const row = document.querySelector("#sessions button[data-session='{target}']")
                     .getBoundingClientRect();
                   return row.top >= box.top - 1 && row.bottom <= box.bottom + 1; }}"""
    )
    assert view, "the focused session scrolled out of view"
    assert not page.errors  # type: ignore[attr-defined]


def test_look_alike_names_are_told_apart_on_the_page(browser: Browser, server: Server) -> None:  # noqa: F811
    """An imported trace whose agents' names differ only by what shows as nothing (zero-width
    characters, a no-break space, a space at the end, a filler) or spell an escape out: the
    page's badges, feed and statistics show each name as `car` does in the terminal
    (`shown_name`), so no two agents look alike; and the page's `nameText` agrees with
    `shown_name` over 2,000 random names."""
    import json
    import random
    import subprocess
    import sys

    from otel_helpers import chat_trace
    from test_names_look_alike import ALPHABET, LOOK_ALIKE

    from engine.terminal import shown_name

    trace = server.journal.parent / "look-alike.json"
    trace.write_text(chat_trace(LOOK_ALIKE, "note {i}"))
    res = subprocess.run(
        [sys.executable, "-m", "cli", "--journal", str(server.journal), "import", str(trace),
         "--json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    (run,) = json.loads(res.stdout)
    page = new_page(browser)
    page.goto(f"{server.url}/#session={run['run_id']}")
    page.wait_for_function("() => window.__car.ends > 0", timeout=T)
    want = sorted(shown_name(n) for n in LOOK_ALIKE)
    assert len(set(want)) == len(LOOK_ALIKE)
    badges = page.locator("#badges .badge > span:nth-child(2)").all_inner_texts()
    assert sorted(badges) == want
    who = page.locator("#feed .who").all_inner_texts()
    assert sorted(set(who)) == want
    page.evaluate("() => renderStats()")  # drawn at the first tool result: this trace has none
    stats = page.locator("#tool-stats tr td:first-child").all_inner_texts()
    assert sorted(stats) == want
    rng = random.Random(5)
    names = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 8))) for _ in range(2000)]
    shown = page.evaluate("names => names.map(nameText)", names)
    assert shown == [shown_name(n) for n in names]
    assert not page.errors  # type: ignore[attr-defined]
