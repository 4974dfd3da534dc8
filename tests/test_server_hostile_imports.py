"""Hostile data from outside, through `car import`, shown by `car serve` and the CLI.

An OTLP/JSON trace is written by whoever ran the traced program: its agent names, messages,
tool names, tool parameters and outputs, model and service names and the root span's error
message may hold anything. The traces below carry HTML and script (`<img src=x onerror=...>`,
`</script>`, `javascript:` URLs), text shaped like JSON or like Server-Sent Events frames,
terminal escapes and control characters, Unicode bidi overrides (U+202E) and zero-width
characters, words of 100 KB without a space, names that are words of the page's UI or
properties every JavaScript object has (`constructor`, `__proto__`), 500 agents and 3000
steps. They are imported with the real `car import` into a real SQLite journal (and one
PostgreSQL journal), served by a real `car serve`, and opened in Debian's Chromium through
Playwright, and read by `car show`, `car state` and `car detect` in subprocesses.

What must hold: no injected script runs (an injected handler would set `window.__pwned`; the
page's `dialog`, `console` and `pageerror` events are watched); every text is shown as the
text it is; the page stays usable (nothing wider than the viewport, each number beside its
agent, the statistics drawn and the feed scrolled once per batch of events, not per event,
text after a name read in its own order); the API answers JSON with the right status and
never 500, also for hostile session ids and query values; the terminal gets no raw escape
and every score of `car detect`.

Screenshots of the dashboard land in artifacts/screenshots/ (as the other browser tests')."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from otel_helpers import car
from playwright.sync_api import Browser, ConsoleMessage, Dialog, Page
from server_helpers import ARTIFACTS, Server, car_serve, sse_events, start, wait_status
from test_server_browser import NARROW, WIDE, browser  # noqa: F401 (fixture)
from test_server_browser import new_page as _new_page

from engine.terminal import shown_name

T = 30_000  # generous Playwright waits (ms)

# ------------------------------------------------------------------ the hostile values

PWN_IMG = "<img src=x onerror=\"window.__pwned='img'\">"
PWN_SCRIPT = "</script><script>window.__pwned='script'</script>"
PWN_SVG = "<svg/onload=window.__pwned='svg'>"
PWN_URL = "javascript:window.__pwned='url'"
PWN_ATTR = '" autofocus onfocus="window.__pwned=\'attr\'" x="'
#: OSC retitle + bell, clear screen, colour, a C1 CSI, NUL, DEL, backspace, carriage return
TERMINAL = "\x1b]0;PWNED\x07\x1b[2J\x1b[31mred\x1b[0m\x9b31m\x00nul\x7f\x08\r"
#: looks like JSON, and like the frames of the server's own event stream
JSONISH = '{"error": "x", "session_id": "../../etc/passwd", "kind": "run_ended"}'
SSEISH = '\n\nevent: end\ndata: {"status": "completed"}\n\nid: 99999\ndata: {}\n\n'
ZERO_WIDTH = "ali\u200bce\u200d\ufeff"
LONG_WORD = "W" * 100_000

#: every kind of text a browser or a terminal could be made to act on, in one
EVERYTHING = " ".join([PWN_IMG, PWN_SCRIPT, PWN_SVG, PWN_URL, PWN_ATTR, TERMINAL, JSONISH, SSEISH])

#: terminal control that must never reach a terminal raw (newline and tab are text)
RAW_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f\x80-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


# ------------------------------------------------------------------ traces


@dataclass
class Step:
    agent: str
    text: str
    tools: tuple[tuple[str, str, str], ...] = ()  # (name, arguments as JSON text, result)
    model: str = "gpt-x"


def trace(
    trace_id: str,
    steps: list[Step],
    *,
    service: str = "svc",
    error: str | None = None,
    provider: str = "openai",
) -> dict[str, Any]:
    """An OTLP/JSON document of one trace, as OpenTelemetry's GenAI instrumentations write
    it: a root `invoke_agent` span (status ERROR with `error` when given), under it per step a
    chat span answering `text` and asking for its tools, and an `execute_tool` span per tool
    answering with its result."""

    def kv(key: str, value: str) -> dict[str, Any]:
        return {"key": key, "value": {"stringValue": value}}

    root = "f" * 16
    spans: list[dict[str, Any]] = [
        {
            "traceId": trace_id,
            "spanId": root,
            "name": "invoke_agent " + steps[0].agent,
            "startTimeUnixNano": "1",
            "endTimeUnixNano": str(10_000 * (len(steps) + 2)),
            "attributes": [kv("gen_ai.operation.name", "invoke_agent")],
            **({"status": {"code": 2, "message": error}} if error is not None else {}),
        }
    ]
    n = 0
    for k, s in enumerate(steps):
        t0 = 10_000 * (k + 1)
        calls = [
            {"type": "tool_call", "id": f"call_{k}_{i}", "name": name, "arguments": json.loads(a)}
            for i, (name, a, _) in enumerate(s.tools)
        ]
        out = [{"role": "assistant", "parts": [{"type": "text", "content": s.text}, *calls]}]
        n += 1
        spans.append(
            {
                "traceId": trace_id,
                "spanId": f"{n:016x}",
                "parentSpanId": root,
                "name": f"chat {s.model}",
                "startTimeUnixNano": str(t0),
                "endTimeUnixNano": str(t0 + 100),
                "attributes": [
                    kv("gen_ai.operation.name", "chat"),
                    kv("gen_ai.agent.name", s.agent),
                    kv("gen_ai.request.model", s.model),
                    kv("gen_ai.provider.name", provider),
                    kv("gen_ai.output.messages", json.dumps(out)),
                ],
            }
        )
        for i, (name, a, result) in enumerate(s.tools):
            n += 1
            spans.append(
                {
                    "traceId": trace_id,
                    "spanId": f"{n:016x}",
                    "parentSpanId": root,
                    "name": f"execute_tool {name}",
                    "startTimeUnixNano": str(t0 + 200 + i),
                    "endTimeUnixNano": str(t0 + 300 + i),
                    "attributes": [
                        kv("gen_ai.operation.name", "execute_tool"),
                        kv("gen_ai.tool.name", name),
                        kv("gen_ai.tool.call.arguments", a),
                        kv("gen_ai.tool.call.result", result),
                    ],
                }
            )
    resource = {"attributes": [kv("service.name", service)]}
    return {"resourceSpans": [{"resource": resource, "scopeSpans": [{"spans": spans}]}]}


def markup_trace() -> dict[str, Any]:
    """Every field a trace names holds markup, script, escapes and look-alike text."""
    agents = [
        PWN_IMG,
        PWN_SCRIPT,
        PWN_URL,
        PWN_ATTR,
        "a" + TERMINAL,
        ZERO_WIDTH,
        "Reveal the mole",  # a word of the page's UI
        "Analyze behaviour",
        JSONISH,
    ]
    steps = []
    for k, agent in enumerate(agents):
        args = json.dumps({"q": EVERYTHING, "url": PWN_URL})
        tool = (PWN_IMG + "tool", args, EVERYTHING + f" result {k}")
        steps.append(Step(agent, f"{EVERYTHING} said by step {k}", (tool,), PWN_IMG + TERMINAL))
    return trace(
        "a1" * 16,
        steps,
        service=EVERYTHING,
        provider=PWN_SCRIPT,
        error="the program failed: " + EVERYTHING,
    )


#: a name a little longer than a badge has room for on a phone, and one of 300 letters
LONG_NAME = "L" * 300


def long_trace() -> dict[str, Any]:
    """100 KB words in a message, a tool's parameters and result and the root span's error;
    agent and tool names of 300 letters; a name as long as an ordinary sentence."""
    tool = (LONG_NAME, json.dumps({"q": LONG_WORD}), LONG_WORD)
    steps = [
        Step(LONG_NAME, LONG_WORD, (tool,)),
        Step("a-fairly-long-but-ordinary-agent-name-of-48-chars", "short", (("calc", "{}", "1"),)),
        Step("bob", "hello " + LONG_WORD[:20_000] + " there"),
    ]
    return trace("a2" * 16, steps, error="failed: " + LONG_WORD)


#: an override without its closing U+202C, and an isolate without its closing U+2069
RLO_AGENT = "x\u202espoof"
RLI_TOOL = "y\u2067iso"


def bidi_trace() -> dict[str, Any]:
    steps = [
        Step("alice", "before", (("calc", '{"q": "1"}', "1"),)),
        Step(RLO_AGENT, "hello", ((RLO_AGENT + "-tool", '{"q": "x"}', "ok"),)),
        Step("bob", "after", ((RLI_TOOL, '{"q": "y"}', "ok"),)),
    ]
    return trace("a3" * 16, steps)


#: crew names a heist's config accepts (identifiers) that are also properties of every
#: JavaScript object, and one an imported trace may use besides
OBJECT_WORDS = ("constructor", "toString", "valueOf", "hasOwnProperty")
PROTO = "__proto__"


def proto_trace() -> dict[str, Any]:
    steps = [
        Step(name, f"{name} here", (("calc", '{"q": "1"}', "1"), ("calc", '{"q": "2"}', "2")))
        for name in (PROTO, *OBJECT_WORDS, "alice")
    ]
    return trace("a4" * 16, steps)


CROWD = 500
MANY_STEPS = 3000


def crowd_trace() -> dict[str, Any]:
    """500 agents, each one step with one tool call."""
    steps = [
        Step(f"agent-{i:03d}", f"hello from {i}", (("calc", '{"q": "1"}', "1"),))
        for i in range(CROWD)
    ]
    return trace("a5" * 16, steps)


def long_run_trace() -> dict[str, Any]:
    """3000 steps of two agents."""
    return trace("a6" * 16, [Step("ab"[i % 2], f"step text {i}") for i in range(MANY_STEPS)])


TRACES = {
    "markup": markup_trace,
    "long": long_trace,
    "bidi": bidi_trace,
    "proto": proto_trace,
    "crowd": crowd_trace,
    "steps": long_run_trace,
}


def import_into(journal: Path | str, doc: dict[str, Any], path: Path) -> str:
    """`car import` of the document written to `path`: the run's id."""
    path.write_text(json.dumps(doc))
    res = car(journal, "import", str(path), "--json")
    assert res.returncode == 0, res.stderr
    (run,) = json.loads(res.stdout)
    return str(run["run_id"])


#: a heist's crew (the default one) with two agents renamed to properties of every object
def object_word_crew() -> str:
    from importlib import resources

    text = (resources.files("engine.heist") / "agents_config.yaml").read_text()
    text = text.replace("name: intel", "name: constructor", 1)
    return text.replace("name: hacker", "name: toString", 1)


@dataclass
class Hostile:
    server: Server
    runs: dict[str, str]  # trace name -> run id; "heist": an ordinary heist; "crew": see above


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hostile]:
    base = tmp_path_factory.mktemp("hostile-imports")
    journal = base / "journal.db"
    runs = {
        name: import_into(journal, make(), base / f"{name}.json") for name, make in TRACES.items()
    }
    with car_serve(journal, "--workers", "0", "--sim-step-delay", "0") as s:
        with s.client() as c:
            runs["heist"] = start(c, seed=7, rounds=2, step_delay=0)
            runs["crew"] = start(c, seed=3, rounds=2, step_delay=0, config=object_word_crew())
            for sid in (runs["heist"], runs["crew"]):
                wait_status(c, sid, {"completed"})
        yield Hostile(s, runs)


# ------------------------------------------------------------------ the page, watched


def open_run(browser: Browser, server: Server, sid: str, viewport: dict[str, int] = WIDE) -> Page:  # noqa: F811
    """A new page on the run, watched (dialogs dismissed and recorded, console lines, page
    errors), once its whole stream has been shown."""
    page = _new_page(browser, viewport)
    dialogs: list[str] = []
    console: list[str] = []

    def dialog(d: Dialog) -> None:
        dialogs.append(d.message)
        d.dismiss()

    def line(m: ConsoleMessage) -> None:
        console.append(f"{m.type}: {m.text}")

    page.on("dialog", dialog)
    page.on("console", line)
    page.dialogs = dialogs  # type: ignore[attr-defined]
    page.console = console  # type: ignore[attr-defined]
    page.goto(f"{server.url}/#session={sid}")
    page.wait_for_function("() => window.__car.ends > 0", timeout=120_000)
    page.wait_for_load_state("networkidle")
    return page


def assert_nothing_ran(page: Page) -> None:
    assert page.evaluate("() => window.__pwned") is None, page.evaluate("() => window.__pwned")
    assert page.dialogs == [], page.dialogs  # type: ignore[attr-defined]
    assert page.errors == [], page.errors  # type: ignore[attr-defined]
    assert not any("pwned" in line.lower() for line in page.console), page.console  # type: ignore[attr-defined]


def shot(page: Page, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"hostile-imports-{name}.png"
    page.screenshot(path=str(path))
    return path


#: every element wider than the viewport allows: (what, its left and right edge), at most 8
OVERFLOWING = """(slack) => {
  const out = [];
  for (const n of document.querySelectorAll("body *")) {
    const r = n.getBoundingClientRect();
    if (!r.width || !r.height) continue;
    if (r.right > innerWidth + slack || r.left < -slack) {
      const what = n.id ? `#${n.id}` : `${n.tagName.toLowerCase()}.${n.className}`;
      out.push([what, Math.round(r.left), Math.round(r.right),
                (n.textContent || "").slice(0, 24)]);
    }
  }
  return { scrollWidth: document.documentElement.scrollWidth, innerWidth, over: out.slice(0, 8),
           count: out.length };
}"""


# ------------------------------------------------------------------ no script runs


def test_markup_from_a_trace_is_shown_as_text_and_never_runs(
    browser: Browser,  # noqa: F811
    hostile: Hostile,
) -> None:
    """Every text of a trace full of HTML, script, `javascript:` URLs, attribute breakers,
    terminal escapes and SSE-looking text is shown exactly as the API has it, and every name
    as `shown_name` shows it (its controls escaped, decision 66), as text: no element,
    attribute or link comes of it, while the user opens each tool result,
    marks a suspect and runs the analysis: no injected handler runs, no dialog opens, the page
    throws nothing."""
    server, sid = hostile.server, hostile.runs["markup"]
    with server.client() as c:
        detail = c.get(f"/api/sessions/{sid}").json()
    page = open_run(browser, server, sid)
    for summary in page.locator("#feed .tool details summary").all():
        summary.click()
    page.locator(".badge").first.click()
    page.click("#btn-analyze")
    page.wait_for_selector("#analysis-summary", timeout=T)
    page.wait_for_timeout(500)
    shot(page, "markup")
    assert_nothing_ran(page)
    shown = page.evaluate(
        """() => [...document.querySelectorAll('#feed li.msg')].map((li) =>
             [li.querySelector('.who').textContent, li.querySelector('.text').textContent])"""
    )
    assert shown == [[shown_name(m["agent"]), m["text"]] for m in detail["messages"]]
    names = page.locator(".badge").evaluate_all("(bs) => bs.map((b) => b.children[1].textContent)")
    assert names == [shown_name(a) for a in detail["agents"]]
    results = page.locator("#feed .tool pre").all_text_contents()
    assert results == [t["output"] for t in detail["tool_usage"]]
    made = page.evaluate(
        """() => {
             const all = [...document.querySelectorAll('body *')];
             return {
               injected: all.filter((n) => ['IMG', 'SCRIPT', 'SVG', 'IFRAME', 'OBJECT']
                 .includes(n.tagName.toUpperCase()) && n.closest('main')).length,
               handlers: all.filter((n) => [...n.attributes].some((a) => a.name.startsWith('on')))
                 .length,
               links: [...document.querySelectorAll('a[href]')].map((a) => a.getAttribute('href'))
                 .filter((h) => h.trim().toLowerCase().startsWith('javascript')).length,
             }; }"""
    )
    assert made == {"injected": 0, "handlers": 0, "links": 0}, made
    # the failed trace's error (markup too) is the run's end line, as text
    assert page.locator("#feed li.sys").last.text_content() == f"heist failed: {detail['error']}"
    # the UI's own buttons are still the ones found by name and id
    assert page.locator("#btn-reveal").count() == 1 and page.locator("#btn-analyze").count() == 1


# ------------------------------------------------------------------ the API


def test_the_api_answers_every_hostile_run_in_json(hostile: Hostile) -> None:
    """Each imported run's detail, branch tree, event stream and rules analysis answer 200 with
    JSON that round-trips every hostile string exactly (controls, bidi, 100 KB words); the
    stream's frames are not broken by SSE-looking text (every event arrives, each id its seq,
    then `end`); what does not apply to an imported run (a diff, a fork, an attribution, an
    accusation) is a JSON error with its 4xx, never a 500."""
    with hostile.server.client(timeout=120) as c:
        for name in TRACES:
            sid = hostile.runs[name]
            detail = c.get(f"/api/sessions/{sid}")
            assert detail.status_code == 200, (name, detail.text[:300])
            d = detail.json()
            assert d["scenario"] == "imported" and d["session_id"] == sid
            tree = c.get(f"/api/sessions/{sid}/tree")
            assert tree.status_code == 200 and tree.json()["session_id"] == sid
            events, ended = sse_events(c, sid)
            assert ended, name
            said = [(e["agent"], e["text"]) for e in events if e["kind"] == "message"]
            assert said == [(m["agent"], m["text"]) for m in d["messages"]], name
            analysis = c.post("/api/ai-detect/analyze", json={"session_id": sid})
            assert analysis.status_code == 200, (name, analysis.text[:300])
            assert set(analysis.json()["suspicion_scores"]) == set(d["agents"])
            refused = [
                c.get(f"/api/sessions/{sid}/diff"),
                c.post(f"/api/sessions/{sid}/fork", json={"at": 0, "do": "resample", "n": 1}),
                c.post(f"/api/sessions/{sid}/attribution", json={}),
                c.post(f"/api/sessions/{sid}/accuse", json={"suspect": d["agents"][0][:64]}),
            ]
            for r in refused:
                assert r.status_code == 409, (name, r.request.url, r.status_code, r.text[:300])
                assert isinstance(r.json()["error"], str)
        markup = c.get(f"/api/sessions/{hostile.runs['markup']}").json()
        assert markup["messages"][0]["text"] == f"{EVERYTHING} said by step 0"
        assert markup["agents"][4] == "a" + TERMINAL and markup["agents"][5] == ZERO_WIDTH
        long = c.get(f"/api/sessions/{hostile.runs['long']}").json()
        assert long["messages"][0]["text"] == LONG_WORD
        assert long["tool_usage"][0]["output"] == LONG_WORD


HOSTILE_PATHS = [
    # (path, status): each answer JSON, errors `{"error": ...}`
    ("/api/sessions/" + "a" * 10_000, 404),
    ("/api/sessions/" + "a" * 10_000 + "/events", 404),
    ("/api/sessions/..%2f..%2fetc%2fpasswd", 404),
    ("/api/sessions/%2e%2e", 404),
    ("/api/sessions/%00", 404),
    ("/api/sessions/%00/events", 404),
    ("/api/sessions/%00/tree", 404),
    ("/api/sessions/%E2%80%AE", 404),
    ("/api/sessions/%ED%A0%80", 404),  # an encoded lone surrogate
    ("/api/sessions/%FF%FE", 404),
    ("/api/sessions/%25", 404),  # "%": LIKE's wildcard, taken literally
    ("/api/sessions/_", 404),
    ("/api/sessions/%20", 404),
    ("/api/sessions/%E2%80%8B", 404),  # a zero-width space
    ("/api/sessions/{markup}%0A", 404),
    ("/api/sessions/{markup}/events?after=abc", 422),
    ("/api/sessions/{markup}/events?after=%00", 422),
    ("/api/sessions/{markup}/events?after=-2", 422),
    ("/api/sessions/{markup}/events?after=99999999999999999999", 422),
    ("/api/sessions?limit=%00", 422),
    ("/api/sessions?limit=1e3", 422),
    ("/api/sessions?limit=%EF%BC%91", 422),  # a fullwidth digit one
    ("/api/sessions?limit=0", 422),
    ("/api/sessions?offset=-1", 422),
    ("/api/sessions?offset=99999999999999999999", 200),
    ("/api/sessions?limit=200&offset=0&limit=%3Cscript%3E", 422),
]


@pytest.mark.parametrize(("path", "status"), HOSTILE_PATHS, ids=[p[:60] for p, _ in HOSTILE_PATHS])
def test_hostile_ids_and_query_values_are_json_answers(
    hostile: Hostile, path: str, status: int
) -> None:
    """Very long ids, `../`, NUL, bidi and zero-width characters, an encoded lone surrogate,
    LIKE wildcards and hostile query values get their status (404 for no such session, 422 for
    a bad value) with a JSON body, never a 500, and the server answers normally afterwards."""
    path = path.replace("{markup}", hostile.runs["markup"])
    with hostile.server.client() as c:
        r = c.get(path)
        assert r.status_code == status, (r.status_code, r.text[:300])
        data = r.json()
        if status >= 400:
            assert isinstance(data["error"], str), data
            # a value is quoted back at most 200 characters long (a 10,000-character id came
            # back twice: ~20 KB)
            assert len(r.content) < 2_000, len(r.content)
        assert c.get("/api/health").status_code == 200


def test_hostile_session_ids_in_bodies_are_404(hostile: Hostile) -> None:
    """The analysis and the accusation name their session in the body or path: NUL, `../`,
    bidi, wildcards are 404 JSON, a lone surrogate 422."""
    with hostile.server.client() as c:
        for sid in ("\x00", "../../etc/passwd", "e\u202e", "%", "_", "a" * 200):
            r = c.post("/api/ai-detect/analyze", json={"session_id": sid})
            assert r.status_code == 404 and r.json()["session_id"] == sid, r.text[:300]
        r = c.post(
            "/api/ai-detect/analyze",
            content=b'{"session_id": "\\ud800"}',
            headers={"Content-Type": "application/json"},
        )
        assert r.status_code == 422 and "error" in r.json()
        r = c.post("/api/sessions/%00/accuse", json={"suspect": "a"})
        assert r.status_code == 404 and "error" in r.json()


def test_a_nul_in_a_session_id_is_404_on_postgresql(pg_url: str, tmp_path: Path) -> None:
    """On a PostgreSQL journal a session id holding NUL (`/api/sessions/%00`, or in the
    analysis's body) names no session as on SQLite: 404 JSON, like every unknown id. It was a
    500 ("internal error (JournalError)"): PostgreSQL refuses NUL in a text parameter, and the
    lookup sent it."""
    from journal_helpers import fresh_pg_database

    target = fresh_pg_database(pg_url, "hostile")
    sid = import_into(target, bidi_trace(), tmp_path / "t.json")
    with car_serve(target, "--workers", "0") as s:  # type: ignore[arg-type]
        answers = {}
        for p in (
            "/api/sessions/%00",
            f"/api/sessions/{sid[:4]}%00",
            f"/api/sessions/{sid}%00/tree",
            "/api/sessions/%00/events",
        ):
            # a connection of its own each: the server drops one that ended in a 500
            with s.client() as c:
                answers[p] = c.get(p)
        with s.client() as c:
            answers["analyze"] = c.post("/api/ai-detect/analyze", json={"session_id": "\x00"})
        got = {k: (r.status_code, r.json().get("error")) for k, r in answers.items()}
        assert all(status == 404 for status, _ in got.values()), got
        with s.client() as c:
            assert c.get(f"/api/sessions/{sid}").status_code == 200


# ------------------------------------------------------------------ the page stays usable


@pytest.mark.parametrize(
    ("run", "viewport"),
    [("heist", WIDE), ("heist", NARROW), ("long", WIDE), ("long", NARROW)],
    ids=["ordinary-wide", "ordinary-narrow", "long-words-wide", "long-words-narrow"],
)
def test_long_words_and_names_stay_inside_the_viewport(
    browser: Browser,  # noqa: F811
    hostile: Hostile,
    run: str,
    viewport: dict[str, int],
) -> None:
    """After the analysis, no element of the page reaches past the viewport's edge by more
    than 8 px: not the page (its scroll width), not a crew badge, not the tool statistics or
    the analysis table (whose numbers would sit tens of thousands of pixels to the right of
    their agent). An ordinary heist holds this (the check itself is sound); a run with a
    300-letter agent name, 100 KB words and a 48-character name did not: the badge of the
    long name made the page 67,000 px wide, and on a phone even a 48-character name's badge
    ran past the edge."""
    page = open_run(browser, hostile.server, hostile.runs[run], viewport)
    page.click("#btn-analyze")
    page.wait_for_selector("#analysis-summary", timeout=T)
    page.wait_for_timeout(300)
    layout = page.evaluate(OVERFLOWING, 8)
    path = shot(page, f"layout-{run}-{viewport['width']}")
    assert layout["count"] == 0 and layout["scrollWidth"] <= viewport["width"] + 8, (
        str(path),
        layout,
    )
    assert_nothing_ran(page)


def test_a_bidi_override_in_a_name_does_not_reorder_the_page(
    browser: Browser,  # noqa: F811
    hostile: Hostile,
) -> None:
    """An agent name with U+202E (right-to-left override) and a tool name with U+2067
    (right-to-left isolate), neither closed, keep their effect to themselves: the page's own
    text after them ("step 1", the tool call's parameters) reads in its own order and place.
    The override used to run on to the end of the line: "x step 1" read "x 1 pets", and the
    tool line `x…-tool({"q": "x"})` showed the parameters inside the tool's name."""
    page = open_run(browser, hostile.server, hostile.runs["bidi"])
    found = page.evaluate(
        """() => {
          const lefts = (node, from, to) => { const xs = [];
            for (let i = from; i < to; i++) { if (node.textContent[i] === ' ') continue;
              const r = document.createRange(); r.setStart(node, i); r.setEnd(node, i + 1);
              xs.push(r.getBoundingClientRect().left); }
            return xs; };
          const increasing = (xs) => xs.every((x, i) => i === 0 || x > xs[i - 1]);
          const out = [];
          for (const li of document.querySelectorAll('#feed li.msg')) {
            const label = li.querySelector('.step').firstChild;
            if (!increasing(lefts(label, 0, label.textContent.length)))
              out.push(`step label of ${li.dataset.step} reads out of order`);
            for (const code of li.querySelectorAll('.tool code')) {
              const bdi = [...code.querySelectorAll('bdi')].pop();  // the parameters
              const params = bdi.getBoundingClientRect();
              const name = document.createRange(); name.setStart(code, 0);
              name.setEndBefore(bdi);
              const right = Math.max(...[...name.getClientRects()].map((r) => r.right));
              if (params.left < right - 1)
                out.push(`tool call of step ${li.dataset.step}: parameters inside the name`);
            }
          }
          return out; }"""
    )
    path = shot(page, "bidi")
    assert found == [], (str(path), found)


def test_agent_names_that_are_object_properties_count_their_tools(
    browser: Browser,  # noqa: F811
    hostile: Hostile,
) -> None:
    """Agents named `constructor`, `toString` (valid crew names: a heist quick-started with
    such a crew) or `__proto__`, `valueOf`, `hasOwnProperty` (an imported trace) show the tool
    counts the API has for them, on their badge and in the tool statistics. The page counted
    into a plain object indexed by the agent's name, so these found Object's own members
    there: "NaN/NaN tools ok", "undefined/undefined tools ok", empty cells, and
    Object.prototype itself got `calls`, `ok` and `failed` (NaN) set on it."""
    bad: list[Any] = []
    for run in ("crew", "proto"):
        sid = hostile.runs[run]
        with hostile.server.client() as c:
            stats = c.get(f"/api/sessions/{sid}").json()["tool_stats"]
        page = open_run(browser, hostile.server, sid)
        badges = dict(
            zip(
                page.locator(".badge").evaluate_all("(bs) => bs.map((b) => b.dataset.agent)"),
                page.locator(".badge .tools").all_text_contents(),
                strict=True,
            )
        )
        rows = {
            r[0]: r[1:]
            for r in page.locator("#tool-stats tr").evaluate_all(
                "(rows) => rows.map((r) => [...r.cells].map((c) => c.textContent))"
            )
        }
        for agent, s in stats.items():
            if not s["calls"]:
                continue
            tool = "tool" if s["calls"] == 1 else "tools"
            want_badge = f"{s['ok']}/{s['calls']} {tool} ok"
            want_row = [str(s["calls"]), str(s["ok"]), str(s["failed"])]
            if badges.get(agent) != want_badge or rows.get(agent, [])[:3] != want_row:
                bad.append((run, agent, badges.get(agent), rows.get(agent)))
        polluted = page.evaluate("() => ['calls', 'ok', 'failed'].filter((k) => k in {})")
        if polluted:
            bad.append((run, "Object.prototype", polluted))
        shot(page, f"object-words-{run}")
        assert_nothing_ran(page)
        page.context.close()
    assert bad == [], bad


@pytest.mark.parametrize("run", ["crowd", "steps"], ids=[f"{CROWD}-agents", f"{MANY_STEPS}-steps"])
def test_a_huge_run_opens_without_freezing_the_page(
    browser: Browser,  # noqa: F811
    hostile: Hostile,
    run: str,
) -> None:
    """A run of 500 agents (one tool call each) or of 3000 steps opens in full, drawing the
    tool statistics and scrolling the feed once per batch of events that arrives, not once per
    event. Every tool result rebuilt the whole tool-statistics table (500 agents: 250,000 rows
    made, one 20 s task on this machine), and every event forced a layout to scroll the feed
    (3000 steps: a 4 s task). Counted, not timed (another machine is faster or slower): the
    page's own counters, `window.__car`."""
    started = time.monotonic()
    page = open_run(browser, hostile.server, hostile.runs[run])
    took = time.monotonic() - started
    with hostile.server.client() as c:
        d = c.get(f"/api/sessions/{hostile.runs[run]}").json()
    assert page.locator("#feed li.msg").count() == len(d["messages"])
    assert page.locator(".badge").count() == len(d["agents"])
    tools = sum(s["calls"] for s in d["tool_stats"].values())
    shown = len(page.evaluate("() => window.__car.shown"))
    drawn, scrolled = page.evaluate("() => [window.__car.statsDrawn, window.__car.scrolled]")
    # per event these were `tools` and `shown`; a batch is many events (a read of the stream,
    # whose size depends on the machine: bounds with room)
    assert drawn <= 5 + tools // 4, (drawn, tools, f"{took:.1f} s")
    assert scrolled <= 5 + shown // 4, (scrolled, shown, f"{took:.1f} s")
    assert_nothing_ran(page)


# ------------------------------------------------------------------ what an import is not


def test_an_imported_trace_claims_no_heist_outcome(
    browser: Browser,  # noqa: F811
    hostile: Hostile,
) -> None:
    """An imported trace has no plan and was never scored: the page did say "the plan works"
    (score "–") and its branch tree an "OK" verdict, because the API gives the run an empty
    outcome `{}` (which JavaScript takes as one) and the tree reads an empty outcome as good."""
    sid = hostile.runs["bidi"]  # completed, no error
    with hostile.server.client() as c:
        tree = c.get(f"/api/sessions/{sid}/tree").json()
        detail = c.get(f"/api/sessions/{sid}").json()
    page = open_run(browser, hostile.server, sid)
    page.wait_for_selector("#finished:not([hidden])", timeout=T)
    if page.is_visible("#lab"):  # its branch tree is loaded once the run has ended
        page.wait_for_selector("#tree button", timeout=T)
    outcome = page.inner_text("#outcome")
    shot(page, "imported-outcome")
    assert "plan" not in outcome.lower(), outcome
    assert page.locator("#tree .pill.ok, #tree .pill.bad").count() == 0
    assert tree["verdict"] is None, tree
    assert not detail["outcome"], detail["outcome"]


def test_an_imported_trace_offers_no_action_the_server_refuses(
    browser: Browser,  # noqa: F811
    hostile: Hostile,
) -> None:
    """On an imported run the page offers only what works: each of Reveal, Attribute failure
    and Fork that is enabled is clicked and must not be refused. They were all enabled, and
    each click ended in a red toast: 409 "run … is not a heist", 409 "imported from a trace and
    has no program to re-run"."""
    page = open_run(browser, hostile.server, hostile.runs["bidi"])
    refused: list[str] = []
    page.on(
        "response",
        lambda r: (
            refused.append(f"{r.status} {r.request.method} {r.url}")
            if r.status >= 400 and "/api/" in r.url
            else None
        ),
    )
    page.locator(".badge").first.click()
    offered = []
    for button in ("#btn-reveal", "#btn-attribute", "#fork-form button[type=submit]"):
        if page.locator(button).is_visible() and page.locator(button).is_enabled():
            offered.append(button)
            if button.startswith("#fork"):
                page.fill("#fork-n", "1")
            with page.expect_response(lambda r: r.request.method == "POST", timeout=T):
                page.click(button)
    shot(page, "imported-actions")
    assert refused == [], (offered, refused)


# ------------------------------------------------------------------ the terminal


def test_the_cli_prints_hostile_runs_without_terminal_control(hostile: Hostile) -> None:
    """`car show`, `car state` and `car detect` (text and --json) of the runs full of markup,
    escapes, bidi overrides and long words print no raw escape, control or bidi character:
    each is shown escaped, and what they say is there (the markup as text)."""
    journal = hostile.server.journal
    for name in ("markup", "long", "bidi"):
        sid = hostile.runs[name]
        for argv in (
            ["show", sid],
            ["show", sid, "--json"],
            ["state", sid, "--at", "2"],
            ["detect", sid],
            ["detect", sid, "--json"],
        ):
            res = car(journal, *argv)
            assert res.returncode == 0, (argv, res.stderr[-500:])
            raw = RAW_CONTROL.findall(res.stdout + res.stderr)
            assert raw == [], (argv, sorted(set(raw)))
    shown = car(journal, "show", hostile.runs["markup"]).stdout
    assert PWN_IMG in shown and r"\x1b]0;PWNED\x07" in shown
    assert r"x\u202espoof" in car(journal, "show", hostile.runs["bidi"]).stdout


def test_car_detect_keeps_every_score_beside_a_long_agent_name(hostile: Hostile) -> None:
    """`car detect` of a run with a 300-letter agent name prints its table with every column
    and every agent's score (the name is cut, not the numbers). The name took the whole width
    and rich dropped every other column: the scores were not printed at all."""
    sid = hostile.runs["long"]
    data = json.loads(car(hostile.server.journal, "detect", sid, "--json").stdout)
    res = car(hostile.server.journal, "detect", sid)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    header = next(line for line in lines if line.split()[:1] == ["agent"])
    assert header.split()[-1] == "score", lines[:4]
    scores = [line.split()[-1] for line in lines[1:] if re.search(r"\d\.\d{3}\s*$", line)]
    want = [f"{data['score_breakdown'][a]['combined']:.3f}" for a in data["ranking"]]
    assert scores == want, res.stdout[:2000]
