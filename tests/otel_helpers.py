"""Shared helpers of the OpenTelemetry tests: the CLI, heists with branches, the OTLP schema."""

from __future__ import annotations

import base64
import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from engine.heist.session import record_heist
from engine.heist.sim import SimPolicy
from engine.interventions import fork_many, parse_intervention
from engine.journal import Journal

ROOT = Path(__file__).resolve().parent.parent


def car(journal: Path | str, *args: str) -> subprocess.CompletedProcess[str]:
    """`car --journal J ARGS` in a subprocess, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "cli", "--journal", str(journal), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "200"},
    )


def heist_with_branches(
    j: Journal, seed: int = 5, rounds: int = 2, **heist: Any
) -> tuple[str, list[str]]:
    """A sim heist, two resample branches at step 4 and one forced action at step 7."""
    run = record_heist(j, SimPolicy(), seed=seed, rounds=rounds, **heist).run_id
    report = fork_many(j, run, parse_intervention("resample", 4, None), 2, seed=1)
    forced = fork_many(
        j, run, parse_intervention("action", 7, "We go in at 01:00. [TOOL:calculator:6*7]"), 1
    )
    branches = [b.run_id for b in (*report.branches, *forced.branches) if b.run_id]
    return run, branches


def otlp_message(document: dict[str, Any]) -> ExportTraceServiceRequest:
    """Parse an OTLP/JSON document into the opentelemetry-proto message: a schema check.

    OTLP/JSON differs from protobuf's JSON mapping in one respect: trace and span ids are hex,
    not base64. They are converted (checking that they are hex of the right size) and
    everything else must parse strictly: an unknown field or a wrong type is an error."""
    doc = copy.deepcopy(document)

    def b64(value: str, size: int) -> str:
        raw = bytes.fromhex(value)
        assert len(raw) == size and value == value.lower(), value
        return base64.b64encode(raw).decode()

    for rs in doc["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for span in ss["spans"]:
                span["traceId"] = b64(span["traceId"], 16)
                span["spanId"] = b64(span["spanId"], 8)
                if "parentSpanId" in span:
                    span["parentSpanId"] = b64(span["parentSpanId"], 8)
                for link in span.get("links", []):
                    link["traceId"] = b64(link["traceId"], 16)
                    link["spanId"] = b64(link["spanId"], 8)
    return json_format.Parse(json.dumps(doc), ExportTraceServiceRequest())


def spans_of(document: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for rs in document["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]]


def attrs_of(span: dict[str, Any]) -> dict[str, Any]:
    from engine.otel.attrs import attributes

    return attributes(span.get("attributes"))


def chat_trace(agents: tuple[str, ...], line: str = "{agent} says {i}", rounds: int = 2) -> str:
    """An OTLP/JSON trace of `rounds` chat spans per agent (in turn), each answering with one
    line of text (`line`, formatted with the agent and the span's index)."""
    spans = []
    for i, agent in enumerate(agents * rounds):
        text = line.format(agent=agent, i=i)
        out = [{"role": "assistant", "parts": [{"type": "text", "content": text}]}]
        attrs = {
            "gen_ai.operation.name": "chat",
            "gen_ai.agent.name": agent,
            "gen_ai.output.messages": json.dumps(out),
        }
        spans.append(
            {
                "traceId": "cd" * 16,
                "spanId": f"{i + 1:016x}",
                "name": "chat",
                "startTimeUnixNano": str(1000 * (i + 1)),
                "endTimeUnixNano": str(1000 * (i + 1) + 500),
                "attributes": [{"key": k, "value": {"stringValue": v}} for k, v in attrs.items()],
            }
        )
    return json.dumps({"resourceSpans": [{"resource": {}, "scopeSpans": [{"spans": spans}]}]})


def imported_chat_trace(
    base: Path, agents: tuple[str, ...], line: str = "note {i} [PLAN:route=A{i}]"
) -> tuple[Path, str]:
    """A journal in `base` holding one imported `chat_trace` of `agents`; (journal, run id)."""
    trace, journal = base / "t.json", base / "j.db"
    trace.write_text(chat_trace(agents, line))
    res = car(journal, "import", str(trace), "--json")
    assert res.returncode == 0, res.stderr
    (run,) = json.loads(res.stdout)
    return journal, str(run["run_id"])
