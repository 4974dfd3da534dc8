"""The dashboard showing no state it no longer knows, in a real Chromium against a real
`car serve`: a sessions list that could not be refreshed, a newly opened session shown with the
previous one's indicators, the controls of a live run whose stream is dead.

CAR_OLD_STATIC=DIR checks these tests against an older page (see test_server_browser_hostile)."""

from __future__ import annotations

from pathlib import Path

from playwright.sync_api import Browser, Page, Route
from server_helpers import ARTIFACTS, Server, car_serve, finished_heist, start
from servers import free_port
from test_server_browser import browser, server  # noqa: F401 (fixtures)
from test_server_browser_hostile import (  # noqa: F401 (proxied_browser: a fixture)
    PROXY_NAME,
    T,
    detail_answers,
    new_page,
    proxied_browser,
    pump_until,
    stream_answers,
)


def row_pill(page: Page, sid: str) -> str:
    """The status pill's selector in the session's row of the sessions list."""
    return f"#sessions button[data-session='{sid}'] .row .pill"


def test_sessions_list_does_not_keep_a_status_the_page_lost(
    proxied_browser: Browser,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The server streaming a live heist is replaced by one that refuses the page's name (403),
    as in test_run_is_unknown_once_the_live_view_stopped: the pill says UNKNOWN, yet the heist's
    row in the sessions list (whose refresh is refused too) went on saying RECORDING, and nothing
    said the list was stale. Now the row says UNKNOWN as the pill does, a note says the list
    could not be refreshed; once the list loads again the note goes, and the row shows the
    server's status again when the run is opened again."""
    port = free_port()
    journal = tmp_path / "journal.db"
    allow = ["--allow-host", PROXY_NAME]
    url = f"http://{PROXY_NAME}:{port}"
    page = new_page(proxied_browser)
    with car_serve(journal, *allow, "--workers", "0", port=port) as a:
        with a.client() as c:
            sid = start(c, rounds=40, step_delay=0.2)
        answers = stream_answers(page, sid)
        page.goto(f"{url}/#session={sid}")
        page.wait_for_function("() => window.__car.shown.length > 3", timeout=T)
        page.wait_for_selector(f"{row_pill(page, sid)}.recording", timeout=T)
        assert page.is_hidden("#sessions-note")
    with car_serve(journal, "--workers", "0", port=port):
        pump_until(page, lambda: any(s == 403 for _, s in answers), 90, "a 403")
        page.wait_for_selector("#status.unknown", timeout=10_000)
        page.wait_for_selector(f"{row_pill(page, sid)}.unknown", timeout=T)
        row = page.inner_text(f"#sessions button[data-session='{sid}']").lower()
        assert "recording" not in row and "unknown" in row, row
        note = page.locator("#sessions-note")
        note.wait_for(state="visible", timeout=T)
        assert "could not be refreshed" in note.inner_text(), note.inner_text()
        assert "HTTP 403" in note.inner_text(), note.inner_text()
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "dashboard-sessions-stale.png"))
        # refreshed by hand, and refused again: still unknown, still said
        with page.expect_response(lambda r: "/api/sessions?" in r.url):
            page.click("#refresh-sessions")
        assert page.get_attribute(row_pill(page, sid), "class") == "pill unknown"
        assert note.is_visible()
    with car_serve(journal, *allow, "--workers", "0", port=port):
        with page.expect_response(lambda r: "/api/sessions?" in r.url and r.status == 200):
            page.click("#refresh-sessions")
        note.wait_for(state="hidden", timeout=T)
        # the list answers, but the page still knows nothing more of the open run
        assert page.get_attribute(row_pill(page, sid), "class") == "pill unknown"
        page.click(f"#sessions button[data-session='{sid}']")
        page.wait_for_selector("#status:not(.unknown):not([hidden])", timeout=T)
        status = page.inner_text("#status").lower()
        assert status != "unknown"
        page.wait_for_selector(f"{row_pill(page, sid)}:not(.unknown)", timeout=T)
        page.wait_for_function("() => window.__car.ends > 0", timeout=T)
        assert not page.errors  # type: ignore[attr-defined]


def test_opening_a_session_drops_the_previous_ones_indicators(
    browser: Browser,  # noqa: F811
    server: Server,  # noqa: F811
) -> None:
    """A live heist is open (its progress, its RECORDING pill, its live dot); another heist,
    finished, is opened from the list while its detail is held. The page went on
    showing the first one's progress bar, pill, meta line and live dot as the new one's until the
    new one's answers came; now they are cleared at once, and then show the new one's."""
    with server.client(timeout=120) as c:
        done = finished_heist(c)
        live = start(c, rounds=40, step_delay=0.2)
    page = new_page(browser)
    held: list[Route] = []
    try:
        page.goto(f"{server.url}/#session={live}")
        page.wait_for_selector("#live:visible", timeout=T)
        page.wait_for_function(
            "() => parseFloat(document.getElementById('progress-bar').style.width) > 0",
            timeout=T,
        )
        # its stream is asked for only once its detail answered
        page.route(f"**/api/sessions/{done}", lambda r: held.append(r))
        page.click(f"#sessions button[data-session='{done}']")
        assert page.inner_text("#sid") == done
        bar = page.evaluate(
            """() => { const b = document.getElementById('progress-bar');
                       return [b.style.width, b.style.background, b.className]; }"""
        )
        assert bar in (["", "", ""], ["0%", "", ""]), bar
        assert page.is_hidden("#status") or page.inner_text("#status") == "", page.inner_text(
            "#status"
        )
        assert page.get_attribute("#status", "class") == "pill"
        assert page.is_hidden("#live")
        assert page.inner_text("#meta") == ""
        pump_until(page, lambda: bool(held), 30, "the detail's request")
        held[0].continue_()
        page.wait_for_selector("#status.completed:visible", timeout=T)
        page.wait_for_function(
            "() => document.getElementById('progress-bar').style.width === '100%'", timeout=T
        )
        assert page.is_hidden("#live")
        assert "policy" in page.inner_text("#meta")
        assert not page.errors  # type: ignore[attr-defined]
    finally:
        with server.client() as c:
            c.post(f"/api/sessions/{live}/stop")


def test_live_run_controls_need_a_connected_stream(
    browser: Browser,  # noqa: F811
    server: Server,  # noqa: F811
) -> None:
    """The stream of a live heist is answered 503 (the page retries), then refused for good
    with 403, while the server goes on reporting the run RECORDING. Pause and Stop were enabled
    all along, though no event came; now they are disabled while the stream is not connected
    (the note says it is retrying, then that it stopped, the run still recording, and to
    reload), and a reload that connects the stream enables them again."""
    with server.client() as c:
        sid = start(c, rounds=40, step_delay=0.2)
    page = new_page(browser)
    held: list[Route] = []
    details = detail_answers(page, sid)

    def answer(route: Route) -> None:
        held.append(route)  # the first is answered 503, the retry is held
        if len(held) == 1:
            route.fulfill(
                status=503,
                headers={"Retry-After": "1"},
                content_type="application/json",
                body='{"error": "down"}',
            )

    try:
        page.route(f"**/api/sessions/{sid}/events*", answer)
        page.goto(f"{server.url}/#session={sid}")
        note = page.locator("#stream-note")
        page.wait_for_selector("#stream-note:has-text('HTTP 503')", timeout=T)
        pump_until(page, lambda: len(held) == 2, 30, "the retry")
        assert "retrying" in note.inner_text(), note.inner_text()
        assert page.get_attribute("#status", "class") == "pill recording"
        for control in ("#btn-pause", "#btn-resume", "#btn-stop"):
            assert page.is_disabled(control), control
        assert "not connected" in (page.get_attribute("#btn-stop", "title") or "")

        held[1].fulfill(status=403, content_type="application/json", body='{"error": "refused"}')
        page.wait_for_selector("#stream-note:has-text('still reports the run recording')")
        text = note.inner_text()
        assert "stopped" in text and "HTTP 403" in text and "Reload the page" in text, text
        assert details == [200, 200], details  # asked once after the refusal
        assert page.get_attribute("#status", "class") == "pill recording"
        for control in ("#btn-pause", "#btn-resume", "#btn-stop"):
            assert page.is_disabled(control), control
        assert page.is_hidden("#live")
        with server.client() as c:
            assert c.get(f"/api/sessions/{sid}").json()["status"] == "recording"

        page.unroute(f"**/api/sessions/{sid}/events*")
        page.reload()
        page.wait_for_selector("#btn-pause:enabled", timeout=T)
        assert page.is_enabled("#btn-stop") and page.is_visible("#live")
        assert page.get_attribute("#btn-stop", "title") is None
        assert note.is_hidden()
        assert not page.errors  # type: ignore[attr-defined]
    finally:
        with server.client() as c:
            c.post(f"/api/sessions/{sid}/stop")
