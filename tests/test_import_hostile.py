"""`car import` of a hostile or malformed OTLP/JSON trace: each is refused in one line naming
what is wrong (exit 1) before anything is written, so the journal's runs stay as they were;
what an accepted trace carries to the terminal (an agent's name) is shown, never obeyed."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from otel_helpers import car

from engine.journal import Journal

TRACE_ID, SPAN_ID = "ab" * 16, "01" * 8


def kv(key: str, value: dict[str, Any]) -> dict[str, Any]:
    return {"key": key, "value": value}


def text(key: str, value: str) -> dict[str, Any]:
    return kv(key, {"stringValue": value})


def trace(*attrs: dict[str, Any], start: Any = "1000", end: Any = "2000") -> str:
    """One chat span of agent "a" answering "hi", with `attrs` added (later ones win)."""
    out = [{"role": "assistant", "parts": [{"type": "text", "content": "hi"}]}]
    span = {
        "traceId": TRACE_ID,
        "spanId": SPAN_ID,
        "name": "chat",
        "startTimeUnixNano": start,
        "endTimeUnixNano": end,
        "attributes": [
            text("gen_ai.operation.name", "chat"),
            text("gen_ai.agent.name", "a"),
            text("gen_ai.output.messages", json.dumps(out)),
            *attrs,
        ],
    }
    return json.dumps({"resourceSpans": [{"resource": {}, "scopeSpans": [{"spans": [span]}]}]})


TOKENS = "gen_ai.usage.output_tokens"
BAD_TRACES = {
    # name: (file text, what the one line must say)
    "nested 100000 deep": ("[" * 100_000 + "]" * 100_000, "nests JSON"),
    "time past 64 bits": (
        trace(start="99999999999999999999999999"),
        r"spans\[0\]\.startTimeUnixNano: expected an integer time in nanoseconds",
    ),
    "time 1.5e300": (
        trace(start=1.5e300),
        r"spans\[0\]\.startTimeUnixNano: expected an integer time in nanoseconds",
    ),
    "time negative": (trace(end="-5"), r"endTimeUnixNano: expected an integer time in nanoseconds"),
    "time a fraction": (
        trace(start=1.5),
        r"startTimeUnixNano: expected an integer time in nanoseconds",
    ),
    "tokens NaN": (
        trace(kv(TOKENS, {"doubleValue": float("nan")})),
        rf"{TOKENS}: expected a token count .* got nan",
    ),
    "tokens infinite": (
        trace(kv(TOKENS, {"doubleValue": float("inf")})),
        rf"{TOKENS}: expected a token count",
    ),
    "tokens past 64 bits": (
        trace(kv(TOKENS, {"intValue": "99999999999999999999999"})),
        rf"{TOKENS}: expected a token count .* got 99999999999999999999999",
    ),
    "tokens negative": (
        trace(kv("gen_ai.usage.input_tokens", {"intValue": "-3"})),
        r"gen_ai.usage.input_tokens: expected a token count",
    ),
    "tokens text": (trace(text(TOKENS, "many")), rf"{TOKENS}: expected a token count"),
    "seed past 64 bits": (
        trace(kv("gen_ai.request.seed", {"intValue": str(2**70)})),
        r"seed: expected a 64-bit integer",
    ),
    "seed a fraction as text": (
        trace(text("gen_ai.request.seed", "1.5")),
        r"spans\[0\]: seed: expected a 64-bit integer, got '1\.5'",
    ),
    "seed a fraction as a number": (
        trace(kv("gen_ai.request.seed", {"doubleValue": 1.5})),
        r"spans\[0\]: seed: expected a 64-bit integer, got 1\.5",
    ),
    "seed a fraction as an intValue": (
        trace(kv("gen_ai.request.seed", {"intValue": 1.5})),
        r"spans\[0\]: attribute 'gen_ai\.request\.seed': intValue is not an integer: 1\.5",
    ),
    "seed a fraction in the invocation parameters": (
        trace(text("llm.invocation_parameters", '{"seed": 1.5}')),
        r"spans\[0\]: seed: expected a 64-bit integer, got 1\.5",
    ),
    "seed in exponent notation as text": (
        trace(text("gen_ai.request.seed", "1e3")),
        r"spans\[0\]: seed: expected a 64-bit integer, got '1e3'",
    ),
    "seed NaN as text": (
        trace(text("gen_ai.request.seed", "NaN")),
        r"spans\[0\]: seed: expected a 64-bit integer, got 'NaN'",
    ),
    "seed 5000 digits as text": (
        trace(text("gen_ai.request.seed", "9" * 5000)),
        r"spans\[0\]: seed: expected a 64-bit integer, got '9{30}",
    ),
    "time 5000 digits": (
        trace(start="9" * 5000),
        r"startTimeUnixNano: expected an integer time in nanoseconds",
    ),
    "time a bare number of 5000 digits": (
        trace().replace('"startTimeUnixNano": "1000"', '"startTimeUnixNano": ' + "9" * 5000),
        r"holds a number of more digits than an integer may have here",
    ),
    "boolValue a word": (
        trace(kv("x", {"boolValue": "no"})),
        r"spans\[0\]: attribute 'x': boolValue is not true or false: 'no'",
    ),
    "intValue not a number": (
        trace(kv("x", {"intValue": "abc"})),
        r"spans\[0\]: attribute 'x': intValue is not an integer: 'abc'",
    ),
    "bytesValue not base64": (
        trace(kv("x", {"bytesValue": "abc"})),
        r"spans\[0\]: attribute 'x': Incorrect padding",
    ),
    "messages nested 100000 deep": (
        trace(text("gen_ai.input.messages", "[" * 100_000 + "]" * 100_000)),
        "nests values too deeply",
    ),
    "agent name a lone surrogate": (
        trace(text("gen_ai.agent.name", "\ud800")),
        "cannot be journaled",
    ),
    "arrayValue a list": (
        trace(kv("x", {"arrayValue": [{"stringValue": "a"}]})),
        r"spans\[0\]: attribute 'x': arrayValue is not an object: \[\{'stringValue': 'a'\}\]",
    ),
    "kvlistValue a list": (
        trace(kv("x", {"kvlistValue": []})),
        r"spans\[0\]: attribute 'x': kvlistValue is not an object: \[\]",
    ),
    "arrayValue.values a number": (
        trace(kv("x", {"arrayValue": {"values": 5}})),
        r"spans\[0\]: attribute 'x': arrayValue.values is not a list: 5",
    ),
    "status not an object": (
        trace().replace('"name": "chat",', '"name": "chat", "status": 5,'),
        r"spans\[0\]\.status is not an object",
    ),
}


@pytest.fixture
def journal(tmp_path: Path) -> Path:
    """A journal holding one imported run (so "unchanged" is not merely "still empty")."""
    path, good = tmp_path / "j.db", tmp_path / "good.json"
    good.write_text(trace())
    res = car(path, "import", str(good))
    assert res.returncode == 0, res.stderr
    return path


def _runs(path: Path) -> list[str]:
    with Journal(path, readonly=True) as j:
        return [r.run_id for r in j.runs()]


@pytest.mark.parametrize("name", sorted(BAD_TRACES))
def test_a_malformed_trace_is_one_line_and_writes_nothing(
    journal: Path, tmp_path: Path, name: str
) -> None:
    """Each malformed trace: one line on stderr saying what and where, exit 1, no traceback,
    and the journal's runs exactly as before (no 0-step `abandoned` run left behind)."""
    body, says = BAD_TRACES[name]
    before = _runs(journal)
    path = tmp_path / "bad.json"
    path.write_text(body, encoding="utf-8", errors="surrogatepass")
    res = car(journal, "import", str(path))
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: "), lines
    assert re.search(says, lines[0]), lines[0]
    assert _runs(journal) == before


def test_large_but_valid_numbers_import(tmp_path: Path) -> None:
    """The limits are the schema's, not tighter: the largest time OTLP can carry, a token
    count of 2**63-1 and an unsigned 64-bit seed import and read back."""
    path, file = tmp_path / "j.db", tmp_path / "t.json"
    file.write_text(
        trace(
            kv(TOKENS, {"intValue": str(2**63 - 1)}),
            kv("gen_ai.request.seed", {"intValue": str(2**64 - 1)}),
            start=str(2**64 - 2),
            end=str(2**64 - 1),
        )
    )
    res = car(path, "import", str(file))
    assert res.returncode == 0, res.stderr
    with Journal(path, readonly=True) as j:
        (run,) = j.runs()
        (call,) = [e for e in j.events(run.run_id) if type(e).__name__ == "LlmCall"]
        assert (call.completion_tokens, call.seed) == (2**63 - 1, 2**64 - 1)  # type: ignore[attr-defined]


def test_seeds_read_alike_as_integer_float_and_text(tmp_path: Path) -> None:
    """A seed given as 7, 7.0 or "7" (an attribute, or `seed` in OpenInference's invocation
    parameters) is 7; text that is no number, like an absent seed, is no seed (0)."""
    given = [
        [kv("gen_ai.request.seed", {"intValue": "7"})],
        [kv("gen_ai.request.seed", {"intValue": 7})],
        [kv("gen_ai.request.seed", {"doubleValue": 7.0})],
        [text("gen_ai.request.seed", "7")],
        [text("gen_ai.request.seed", " 7 ")],
        [text("llm.invocation_parameters", '{"seed": 7}')],
        [text("llm.invocation_parameters", '{"seed": 7.0}')],
        [text("llm.invocation_parameters", '{"seed": "7"}')],
        [text("gen_ai.request.seed", "abc")],
        [text("llm.invocation_parameters", '{"seed": "abc"}')],
        [],
    ]
    spans = []
    for i, attrs in enumerate(given):
        (span,) = json.loads(trace(*attrs))["resourceSpans"][0]["scopeSpans"][0]["spans"]
        span["spanId"] = f"{i + 1:016x}"
        span["startTimeUnixNano"] = str(1000 * (i + 1))
        span["endTimeUnixNano"] = str(1000 * (i + 1) + 500)
        spans.append(span)
    file, path = tmp_path / "t.json", tmp_path / "j.db"
    doc = {"resourceSpans": [{"resource": {}, "scopeSpans": [{"spans": spans}]}]}
    file.write_text(json.dumps(doc))
    res = car(path, "import", str(file))
    assert res.returncode == 0, res.stderr
    with Journal(path, readonly=True) as j:
        (run,) = j.runs()
        calls = [e for e in j.events(run.run_id) if type(e).__name__ == "LlmCall"]
    assert [c.seed for c in calls] == [7] * 8 + [0] * 3  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (7, 7),
        (-7, -7),
        (7.0, 7),
        (1e3, 1000),
        ("7", 7),
        (" -7\n", -7),
        ("+7", 7),
        (str(2**64 - 1), 2**64 - 1),
        (True, None),
        (1.5, None),
        (float("nan"), None),
        (float("inf"), None),
        ("1.5", None),
        ("7.0", None),
        ("1e3", None),
        ("1_000", None),
        ("\u0667", None),  # an Arabic-Indic seven: a digit to Python's int(), not to OTLP/JSON
        ("", None),
        ("abc", None),
        ("9" * 5000, None),  # past Python's 4300-digit limit on int(str)
        (None, None),
        ([7], None),
    ],
)
def test_integer_as_otlp_json_carries_one(value: object, expected: int | None) -> None:
    """The one reading of an integer in an OTLP/JSON file (span times, token counts, seeds,
    intValue): a JSON integer, a whole finite number or a string of decimal digits."""
    from engine.otel.attrs import integer

    assert integer(value) == expected


def test_an_agent_name_with_escape_sequences_is_printed_escaped(tmp_path: Path) -> None:
    """An agent name carrying OSC (retitle), a bell, a clear-screen and a colour is shown in
    `car import`'s summary as visible escapes: no ESC or BEL byte reaches the terminal."""
    name = "a\x1b]0;PWNED\x07\x1b[2J\x1b[31m"
    file = tmp_path / "t.json"
    file.write_text(trace(text("gen_ai.agent.name", name)))
    res = car(tmp_path / "j.db", "import", str(file))
    assert res.returncode == 0, res.stderr
    assert "\x1b" not in res.stdout and "\x07" not in res.stdout
    assert r"agents a\x1b]0;PWNED\x07\x1b[2J\x1b[31m (completed)" in res.stdout


# Shapes a trace may hold that are odd but not wrong: each imports as one step of agent "a"
# (each was a traceback: int() of a digit that is no ASCII digit, or of 5000 digits; iterating
# a number; ** of a list or a string).
ODD_BUT_READABLE = {
    "a superscript two as a message index": [
        text("llm.input_messages.\u00b2.message.content", "x"),
        text("llm.input_messages.0.message.content", "hello"),
    ],
    "a 5000-digit message index": [text("llm.input_messages." + "9" * 5000 + ".message.role", "x")],
    "a superscript tool-call index": [
        text("gen_ai.output.messages", "null"),  # no GenAI output: OpenInference's is read
        text("llm.output_messages.0.message.content", "hi"),
        text("llm.output_messages.0.message.tool_calls.\u00b3.tool_call.function.name", "f"),
    ],
    "parts a number": [text("gen_ai.input.messages", json.dumps([{"role": "user", "parts": 5}]))],
    "tool_calls a number": [
        text("input.value", json.dumps({"messages": [{"role": "user", "tool_calls": 5}]}))
    ],
    "a tool call's function a list": [
        text("gen_ai.output.messages", "null"),
        text(
            "output.value",
            json.dumps(
                {"choices": [{"message": {"content": "hi", "tool_calls": [{"function": [1]}]}}]}
            ),
        ),
    ],
    "a tool call's function a string": [
        text("gen_ai.output.messages", "null"),
        text(
            "output.value",
            json.dumps(
                {"choices": [{"message": {"content": "hi", "tool_calls": [{"function": "f"}]}}]}
            ),
        ),
    ],
}


@pytest.mark.parametrize("name", sorted(ODD_BUT_READABLE))
def test_odd_but_readable_shapes_import(tmp_path: Path, name: str) -> None:
    file = tmp_path / "t.json"
    file.write_text(trace(*ODD_BUT_READABLE[name]))
    res = car(tmp_path / "j.db", "import", str(file))
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    with Journal(tmp_path / "j.db", readonly=True) as j:
        (run,) = j.runs()
        assert j.steps(run.run_id) == 1


def test_files_that_are_no_regular_file_are_refused_at_once(journal: Path, tmp_path: Path) -> None:
    """A named pipe nobody writes to (reading it waited for a writer: `car import` hung) and a
    device are refused in one line without being read; nothing is written."""
    import os

    from journal_helpers import car as car_within

    fifo = tmp_path / "trace.fifo"
    os.mkfifo(fifo)
    before = _runs(journal)
    for target in (fifo, Path("/dev/null")):
        res = car_within(journal, "import", str(target), timeout=60)
        assert res.returncode == 1, res.stderr
        (line,) = res.stderr.strip().splitlines()
        assert line == (
            f"error: {str(target)!r} is not a regular file (a named pipe, a device or a "
            "socket); write the trace to a file and import that"
        ), line
    assert _runs(journal) == before


def test_gzip_is_named(journal: Path, tmp_path: Path) -> None:
    """A gzip-compressed trace is refused as such, unread past its magic bytes."""
    import gzip

    file = tmp_path / "t.json.gz"
    file.write_bytes(gzip.compress(trace().encode()))
    res = car(journal, "import", str(file))
    assert res.returncode == 1
    assert (
        res.stderr
        == "error: t.json.gz is gzip-compressed: decompress it (gunzip) and import the JSON\n"
    )


def test_a_byte_order_mark_and_a_name_that_is_no_utf8(tmp_path: Path) -> None:
    """A trace with a UTF-8 byte order mark imports (it was "not JSON: Unexpected UTF-8 BOM"),
    and so does one whose file name is no UTF-8 (it was "cannot be journaled": the name goes
    into RunStarted.config), the name journaled with its odd byte escaped."""
    import os

    file = Path(os.fsdecode(bytes(tmp_path) + b"/t\xff.json"))
    file.write_bytes(b"\xef\xbb\xbf" + trace().encode())
    res = car(tmp_path / "j.db", "import", str(file))
    assert res.returncode == 0, res.stderr
    with Journal(tmp_path / "j.db", readonly=True) as j:
        (run,) = j.runs()
        started = j.events(run.run_id)[0]
        assert started.config["source"]["file"] == "t\\xff.json"  # type: ignore[attr-defined]


def _chain_trace(n: int, tools: int) -> str:
    """n chat spans each the child of the one before (no agent named anywhere, and the first
    span's parent the last: a cycle), then `tools` tool spans that all started at once."""
    spans = []
    for i in range(n):
        (span,) = json.loads(trace())["resourceSpans"][0]["scopeSpans"][0]["spans"]
        span["attributes"] = [a for a in span["attributes"] if a["key"] != "gen_ai.agent.name"]
        span["spanId"] = f"{i + 1:016x}"
        span["parentSpanId"] = f"{(i - 1) % n + 1:016x}"
        span["startTimeUnixNano"] = str(10 * i + 1)
        spans.append(span)
    for i in range(tools):
        spans.append(
            {
                "traceId": TRACE_ID,
                "spanId": f"{n + i + 1:016x}",
                "name": "execute_tool f",
                "startTimeUnixNano": "5",
                "attributes": [text("gen_ai.operation.name", "execute_tool")],
            }
        )
    return json.dumps({"resourceSpans": [{"resource": {}, "scopeSpans": [{"spans": spans}]}]})


def test_deep_parent_chains_and_many_tool_spans_import_in_linear_time(tmp_path: Path) -> None:
    """30000 chat spans nested in a cycle of parent links, and 30000 tool spans in one step:
    the importer looked for each span's agent up the whole chain and placed every tool span
    by scanning every step and every earlier tool of its step (quadratic: minutes); it now
    takes about a second. The bound, 30 s, is far from either."""
    import time

    from engine.otel.importer import read_traces

    file = tmp_path / "t.json"
    file.write_text(_chain_trace(30_000, 30_000))
    started = time.monotonic()
    (imported,) = read_traces(file)
    took = time.monotonic() - started
    assert imported.agents == ["assistant"] and len(imported.steps) == 30_000
    assert len(imported.steps[0].tools) == 30_000
    assert took < 30, took


def test_tool_spans_take_the_calls_the_model_asked_for_in_order(tmp_path: Path) -> None:
    """Two tool spans of tool f stand for the model's two calls of f, in order (each keeps its
    call's arguments); a third f span, with no call left to stand for, is a call of its own."""
    from engine.otel.importer import read_traces

    calls = [
        {"type": "tool_call", "id": f"c{i}", "name": "f", "arguments": f"arg{i}"} for i in (1, 2)
    ]
    out = [{"role": "assistant", "parts": calls}]
    doc = json.loads(trace(text("gen_ai.output.messages", json.dumps(out))))
    spans = doc["resourceSpans"][0]["scopeSpans"][0]["spans"]
    for i in range(3):
        spans.append(
            {
                "traceId": TRACE_ID,
                "spanId": f"{i + 10:016x}",
                "name": "execute_tool f",
                "startTimeUnixNano": str(1500 + i),
                "attributes": [
                    text("gen_ai.operation.name", "execute_tool"),
                    text("gen_ai.tool.call.result", f"out{i}"),
                ],
            }
        )
    file = tmp_path / "t.json"
    file.write_text(json.dumps(doc))
    ((step,),) = [t.steps for t in read_traces(file)]
    assert [(t.param, t.output, t.from_span) for t in step.tools] == [
        ("arg1", "out0", True),
        ("arg2", "out1", True),
        ("", "out2", True),
    ]


def test_ctrl_c_between_traces_says_how_far_the_import_got(tmp_path: Path) -> None:
    """Ctrl-C while a file of many traces is imported: the traces written so far stay (each
    whole, in its own transaction) and the command said only `interrupted`, so a user could
    not tell that importing again would add them twice. It now says how many of how many,
    and which runs. (The interrupt is raised by the journal at the third run: a real Ctrl-C
    lands between two traces only by chance, an import of 400 traces taking 0.7 s.)"""
    from engine.heist.session import record_heist
    from engine.heist.sim import SimPolicy
    from engine.interventions import DoResample, fork_many
    from engine.otel.exporter import export_runs, trace_document
    from engine.otel.importer import import_file
    from engine.workers import Interrupted

    with Journal(tmp_path / "src.db") as j:
        run = record_heist(j, SimPolicy(), seed=3, rounds=1).run_id
        fork_many(j, run, DoResample(5), 4)
        doc = trace_document(j, export_runs(j, run, with_branches=True))
    path = tmp_path / "traces.json"
    path.write_text(json.dumps(doc))

    class CutAtTheThird(Journal):
        made = 0

        def create_run(self, *args: Any, **kwargs: Any) -> str:
            if CutAtTheThird.made == 2:
                raise KeyboardInterrupt
            CutAtTheThird.made += 1
            return super().create_run(*args, **kwargs)

    with CutAtTheThird(tmp_path / "j.db") as j:
        with pytest.raises(Interrupted) as e:
            import_file(j, path)
        made = [r.run_id for r in j.runs()]
    assert len(made) == 2
    assert e.value.message == (
        f"interrupted: 2 of 5 traces imported (runs {made[0]} .. {made[1]}); importing the "
        "file again skips the traces the journal holds"
    )
    # and it does: the two are named, the three others imported, nothing twice
    again = json.loads(car(tmp_path / "j.db", "import", str(path), "--json").stdout)
    assert [r["already_imported"] for r in again] == [True, True, False, False, False]
    assert [r["run_id"] for r in again[:2]] == made
    with Journal(tmp_path / "j.db") as j:
        assert len(j.runs()) == 5


def test_importing_a_file_again_names_the_runs_and_writes_nothing(tmp_path: Path) -> None:
    """A file imported twice (or the same trace from a file of another name) made a second run
    of every trace; now the second import names the first's runs, `--again` imports them
    anyway, and a trace of the same id whose spans differ is a new run."""
    from engine.heist.session import record_heist
    from engine.heist.sim import SimPolicy
    from engine.otel.exporter import export_runs, trace_document

    with Journal(tmp_path / "src.db") as j:
        run = record_heist(j, SimPolicy(), seed=3, rounds=1).run_id
        doc = trace_document(j, export_runs(j, run))
    first, renamed = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps(doc))
    renamed.write_text(json.dumps(doc))
    journal = tmp_path / "j.db"
    (made,) = json.loads(car(journal, "import", str(first), "--json").stdout)
    assert made["already_imported"] is False
    second = car(journal, "import", str(renamed))
    assert second.returncode == 0, second.stderr
    assert second.stdout.splitlines()[0] == (
        f"trace {made['trace_id']} is run {made['run_id']} already: not imported again "
        "(--again imports it as a new run)"
    )
    with Journal(journal) as j:
        assert [r.run_id for r in j.runs()] == [made["run_id"]]
    (forced,) = json.loads(car(journal, "import", str(first), "--again", "--json").stdout)
    assert forced["already_imported"] is False and forced["run_id"] != made["run_id"]
    # the same trace id with one call's token count changed: another trace, imported
    spans = doc["resourceSpans"][0]["scopeSpans"][0]["spans"]
    key = "gen_ai.usage.output_tokens"
    tokens = next(a for s in spans for a in s.get("attributes", []) if a["key"] == key)
    tokens["value"] = {"intValue": "999"}
    changed = tmp_path / "c.json"
    changed.write_text(json.dumps(doc))
    (other,) = json.loads(car(journal, "import", str(changed), "--json").stdout)
    assert other["already_imported"] is False and other["trace_id"] == made["trace_id"]
    with Journal(journal) as j:
        assert len(j.runs()) == 3
