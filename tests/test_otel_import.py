"""`car import`: OTLP/JSON traces of LLM programs become runs whose transcript and tool usage
`car show`, the public view and `car diff` read; malformed files are one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from otel_helpers import attrs_of, car, heist_with_branches, otlp_message, spans_of

from engine.journal import Journal
from engine.otel.exporter import trace_document
from engine.otel.importer import TraceImportError, read_traces
from engine.public import public_view

# A user's program: two agents on an OpenAI-compatible server, traced by OpenInference's OpenAI
# instrumentation and OpenInference's own agent and tool spans, written as OTLP/JSON by the
# OpenTelemetry SDK's OTLP encoder (ids turned to hex, as OTLP/JSON has them).
PROGRAM = r"""
import base64, json, sys
import openai
from google.protobuf import json_format
from openinference.instrumentation import OITracer, TraceConfig
from openinference.instrumentation.openai import OpenAIInstrumentor
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

base_url, out = sys.argv[1], sys.argv[2]
exporter = InMemorySpanExporter()
provider = TracerProvider(resource=Resource({"service.name": "research-bot"}))
provider.add_span_processor(SimpleSpanProcessor(exporter))
OpenAIInstrumentor().instrument(tracer_provider=provider)
tracer = OITracer(provider.get_tracer("research-bot"), config=TraceConfig())
client = openai.OpenAI(base_url=base_url, api_key="none")

def ask(messages, seed):
    r = client.chat.completions.create(
        model="smollm2", messages=messages, seed=seed, max_tokens=24, temperature=0.0
    )
    return r.choices[0].message.content or ""

with tracer.start_as_current_span("program", openinference_span_kind="chain"):
    with tracer.start_as_current_span("researcher", openinference_span_kind="agent") as agent:
        agent.set_attribute("agent.name", "researcher")
        question = [
            {"role": "system", "content": "You are a researcher. Be brief."},
            {"role": "user", "content": "What is 6*7? Say which tool you would use."},
        ]
        first = ask(question, 42)
        with tracer.start_as_current_span("calculator", openinference_span_kind="tool") as tool:
            tool.set_tool(name="calculator", parameters={"expression": "6*7"})
            tool.set_input("6*7")
            tool.set_output("42")
        second = ask(question + [
            {"role": "assistant", "content": first},
            {"role": "user", "content": "TOOL RESULT calculator(6*7): 42. Answer in one line."},
        ], 43)
    with tracer.start_as_current_span("writer", openinference_span_kind="agent") as agent:
        agent.set_attribute("agent.name", "writer")
        ask([{"role": "user", "content": "Summarise: " + second}], 44)

provider.force_flush()
doc = json_format.MessageToDict(encode_spans(exporter.get_finished_spans()))
for rs in doc["resourceSpans"]:
    for ss in rs["scopeSpans"]:
        for s in ss["spans"]:
            for k in ("traceId", "spanId", "parentSpanId"):
                if k in s:
                    s[k] = base64.b64decode(s[k]).hex()
with open(out, "w") as f:
    json.dump(doc, f)
"""


def test_import_an_openinference_trace(tmp_path: Path, llama_base_url: str) -> None:
    """A trace that OpenInference's OpenAI instrumentation wrote against the real llama.cpp
    server imports as one run: three LLM steps of two agents, the tool call in the step it ran
    in; `car show`, the public view and `car detect` read its transcript and tool usage; its
    export carries the recorded seeds; fork refuses it in one line."""
    program, trace = tmp_path / "program.py", tmp_path / "trace.json"
    program.write_text(PROGRAM)
    res = subprocess.run(
        [sys.executable, str(program), llama_base_url, str(trace)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    otlp_message(json.loads(trace.read_text()))  # what the program wrote is OTLP/JSON
    journal = tmp_path / "j.db"
    res = car(journal, "import", str(trace), "--json")
    assert res.returncode == 0, res.stderr
    (imported,) = json.loads(res.stdout)
    assert imported["steps"] == 3 and imported["tool_calls"] == 1
    assert imported["agents"] == ["researcher", "writer"]
    run = imported["run_id"]

    shown = json.loads(car(journal, "show", run, "--json").stdout)
    assert shown["run"]["scenario"] == "imported" and shown["status"] == "completed"
    said = [line for line in shown["lines"] if line.startswith("[")]
    assert [line.split(":")[0] for line in said] == [
        "[0] researcher",
        "[1] researcher",
        "[2] writer",
    ]
    assert any("-> calculator(" in line and "= 42" in line for line in shown["lines"])

    with Journal(journal) as j:
        view = public_view(j, run)
        assert view.agents == ["researcher", "writer"]
        assert [(t.step, t.agent, t.tool, t.output, t.success) for t in view.tool_usage] == [
            (0, "researcher", "calculator", "42", True)
        ]
        assert json.loads(view.tool_usage[0].param) == {"expression": "6*7"}
        texts = [m.text for m in view.messages]
        chats = [s for s in spans_of(trace_document(j, [run])) if s["name"].startswith("chat")]
    # the model's words are the program's, whatever they are on this CPU
    program_out = json.loads(trace.read_text())
    llm_out = [
        attrs_of(s)["llm.output_messages.0.message.content"]
        for s in spans_of(program_out)
        if attrs_of(s).get("openinference.span.kind") == "LLM"
    ]
    assert sorted(texts) == sorted(llm_out)
    assert [attrs_of(s)["gen_ai.request.seed"] for s in chats] == [42, 43, 44]
    assert all(attrs_of(s)["gen_ai.usage.input_tokens"] > 0 for s in chats)

    detected = json.loads(car(journal, "detect", run, "--json").stdout)
    assert set(detected["suspicion_scores"]) == {"researcher", "writer"}

    fork = car(journal, "fork", run, "--at", "1", "--do", "resample", "-n", "1")
    assert fork.returncode == 1 and "no program to re-run" in fork.stderr
    assert len(fork.stderr.strip().splitlines()) == 1


def test_exported_heist_imports_back_the_same(tmp_path: Path) -> None:
    """A heist exported and imported back reads the same step for step: `car diff` finds no
    difference between the original and the imported run, their tool usage agrees, and the
    detector (which reads the public view only) scores both alike."""
    journal = tmp_path / "j.db"
    with Journal(journal) as j:
        run, _ = heist_with_branches(j, seed=4)
    out = tmp_path / "heist.json"
    assert car(journal, "export", run, "-o", str(out)).returncode == 0
    (imported,) = json.loads(car(journal, "import", str(out), "--json").stdout)
    diff = json.loads(car(journal, "diff", run, imported["run_id"], "--json").stdout)
    assert diff["first_divergence"] is None and diff["relation"] == "unrelated"
    with Journal(journal) as j:
        a, b = public_view(j, run), public_view(j, imported["run_id"])
    assert [(t.agent, t.tool, t.param, t.success) for t in a.tool_usage] == [
        (t.agent, t.tool, t.param, t.success) for t in b.tool_usage
    ]
    assert b.agents == a.agents
    scores = [
        json.loads(car(journal, "detect", rid, "--json").stdout)["suspicion_scores"]
        for rid in (run, imported["run_id"])
    ]
    assert scores[0] == scores[1] and set(scores[0]) == set(a.agents)


def _genai_trace() -> dict[str, Any]:
    """The shape OpenTelemetry's GenAI instrumentations write with
    OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental: messages as JSON attributes,
    an invoke_agent parent, an execute_tool span and a tool call answered in the next request."""

    def kv(key: str, value: Any) -> dict[str, Any]:
        if isinstance(value, int):
            return {"key": key, "value": {"intValue": str(value)}}
        if isinstance(value, list):
            return {
                "key": key,
                "value": {"arrayValue": {"values": [{"stringValue": v} for v in value]}},
            }
        return {"key": key, "value": {"stringValue": value}}

    tid, agent, c1, tool, c2 = "ab" * 16, "01" * 8, "02" * 8, "03" * 8, "04" * 8
    ask = [{"role": "user", "parts": [{"type": "text", "content": "weather in Oslo?"}]}]
    call = {"type": "tool_call", "id": "call_1", "name": "weather", "arguments": {"city": "Oslo"}}
    answer = {"type": "tool_call_response", "id": "call_1", "response": "-3C, snow"}
    spans = [
        {"traceId": tid, "spanId": agent, "name": "invoke_agent forecaster", "kind": 1,
         "startTimeUnixNano": "1000", "endTimeUnixNano": "9000",
         "attributes": [kv("gen_ai.operation.name", "invoke_agent"),
                        kv("gen_ai.agent.name", "forecaster")]},
        {"traceId": tid, "spanId": c1, "parentSpanId": agent, "name": "chat gpt-x", "kind": 3,
         "startTimeUnixNano": "2000", "endTimeUnixNano": "3000",
         "attributes": [kv("gen_ai.operation.name", "chat"), kv("gen_ai.provider.name", "openai"),
                        kv("gen_ai.request.model", "gpt-x"), kv("gen_ai.request.seed", 7),
                        kv("gen_ai.usage.input_tokens", 12), kv("gen_ai.usage.output_tokens", 5),
                        kv("gen_ai.response.finish_reasons", ["tool_calls"]),
                        kv("gen_ai.input.messages", json.dumps(ask)),
                        kv("gen_ai.output.messages", json.dumps(
                            [{"role": "assistant", "parts": [call], "finish_reason": "tool_calls"}]
                        ))]},
        {"traceId": tid, "spanId": tool, "parentSpanId": agent, "name": "execute_tool weather",
         "kind": 1, "startTimeUnixNano": "3500", "endTimeUnixNano": "3900",
         "attributes": [kv("gen_ai.operation.name", "execute_tool"),
                        kv("gen_ai.tool.name", "weather")]},
        {"traceId": tid, "spanId": c2, "parentSpanId": agent, "name": "chat gpt-x", "kind": 3,
         "startTimeUnixNano": "4000", "endTimeUnixNano": "5000",
         "attributes": [kv("gen_ai.operation.name", "chat"), kv("gen_ai.request.model", "gpt-x"),
                        kv("gen_ai.input.messages", json.dumps(
                            [*ask, {"role": "assistant", "parts": [call]},
                             {"role": "tool", "parts": [answer]}])),
                        kv("gen_ai.output.messages", json.dumps(
                            [{"role": "assistant", "finish_reason": "stop",
                              "parts": [{"type": "text", "content": "Snowy, -3C."}]}]))]},
    ]  # fmt: skip
    return {"resourceSpans": [{"resource": {}, "scopeSpans": [{"spans": spans}]}]}


def test_import_genai_conventions(tmp_path: Path) -> None:
    """gen_ai.* messages, the agent's name from its invoke_agent span, the execute_tool span
    standing for the call the model asked for, answered from the next request."""
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_genai_trace()))
    (trace,) = read_traces(path)
    assert trace.agents == ["forecaster"] and trace.provider == "openai"
    first, second = trace.steps
    assert first.request == [{"role": "user", "content": "weather in Oslo?"}]
    assert (first.seed, first.prompt_tokens, first.completion_tokens) == (7, 12, 5)
    assert first.finish_reason == "tool_calls" and second.response == "Snowy, -3C."
    (tool,) = first.tools
    assert (tool.name, tool.ok) == ("weather", True)
    assert second.request[-1] == {"role": "tool", "content": "-3C, snow"}
    assert not second.tools


def test_import_base64_ids_and_json_lines(tmp_path: Path) -> None:
    """protobuf's JSON mapping (base64 ids) and JSON Lines of documents both import; a span
    sent twice (an exporter's retry) is read once."""
    import base64

    doc = _genai_trace()
    for s in doc["resourceSpans"][0]["scopeSpans"][0]["spans"]:
        for k in ("traceId", "spanId", "parentSpanId"):
            if k in s:
                s[k] = base64.b64encode(bytes.fromhex(s[k])).decode()
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(doc) + "\n" + json.dumps(_genai_trace()) + "\n")
    traces = read_traces(path)
    assert [t.trace_id for t in traces] == ["ab" * 16]
    assert len(traces[0].steps) == 2


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "is not JSON"),
        ("{not json", "is not JSON"),
        ("[1, 2]", "is not an OTLP/JSON trace"),
        ('{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz"}]}]}]}', "traceId"),
        ('{"resourceSpans": []}', "holds no spans"),
        (
            '{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "' + "ab" * 16
            + '", "spanId": "' + "01" * 8 + '", "name": "GET /"}]}]}]}',
            "but no LLM call",
        ),
        (
            '{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "' + "ab" * 16
            + '", "spanId": "' + "01" * 8 + '", "startTimeUnixNano": "soon"}]}]}]}',
            "expected an integer time",
        ),
    ],
)  # fmt: skip
def test_malformed_files_are_refused(tmp_path: Path, content: str, message: str) -> None:
    """Each malformed file is refused with a message that says what is wrong and where."""
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(TraceImportError, match=message):
        read_traces(path)


def test_malformed_file_on_the_cli_writes_nothing(tmp_path: Path) -> None:
    """`car import` of a malformed file: one `error:` line, exit 1, and no run in the journal."""
    path = tmp_path / "bad.json"
    path.write_text('{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz"}]}]}]}')
    journal = tmp_path / "j.db"
    res = car(journal, "import", str(path))
    assert res.returncode == 1 and res.stderr.startswith("error: bad.json: resourceSpans[0]")
    assert len(res.stderr.strip().splitlines()) == 1
    with Journal(journal) as j:
        assert j.runs() == []


def test_missing_and_unreadable_files(tmp_path: Path) -> None:
    """A missing file, a directory and a binary file are one-line errors."""
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00")
    for target, message in [
        (tmp_path / "nope.json", "no such file"),
        (tmp_path, "is a directory"),
        (tmp_path / "bin.json", "not UTF-8"),
    ]:
        res = car(tmp_path / "j.db", "import", str(target))
        assert res.returncode == 1 and message in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1
