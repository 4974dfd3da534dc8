"""Runs as OTLP/JSON traces: one trace per run, branches as their own traces linked to their parent.

Span layout (docs/decisions.md, entry 17):

    car.run <scenario>              root, OpenInference CHAIN; outcome, intervention, controls
      invoke_agent <agent>          one per agent turn (step), AGENT
        chat <model>                the step's LLM call, LLM (absent for a forced action)
        execute_tool <tool>         one per tool call of the step, TOOL

Every span carries the GenAI semantic conventions' `gen_ai.*` attributes (v1.37.0 names, with
v1.36.0's `gen_ai.system` alongside) and OpenInference's (`openinference.span.kind`,
`llm.*`, `tool.*`, `input.value`/`output.value`). Ids are derived from the run id and the
journal seq of the event a span stands for, so exporting twice gives the same bytes, and a
branch can link to its parent's spans without exporting the parent.

What is read comes from `engine.otel.source` only: the public view (see its docstring).
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

from engine.errors import EngineError
from engine.journal import Journal
from engine.otel.attrs import AttrValue, key_values
from engine.otel.source import ExportSource, LlmFacts, read_source
from engine.public import PublicRun, public_view

SEMCONV_VERSION = "1.37.0"
SCHEMA_URL = f"https://opentelemetry.io/schemas/{SEMCONV_VERSION}"
SCOPE_NAME = "causal-agent-replay"

# The journal records when a run was created, not when each step ran, and step latencies are
# not public (the mole's longer prompt takes longer). Steps are therefore laid out on a fixed
# grid from the run's recorded start: a layout, not a measurement (car.timing = "layout").
STEP_NS = 1_000_000

SPAN_KIND_INTERNAL = 1
SPAN_KIND_CLIENT = 3
STATUS_OK = 1
STATUS_ERROR = 2


class ExportError(EngineError):
    """A run cannot be exported, or the receiver refused the export."""


# ------------------------------------------------------------------------------------ ids


def trace_id(run_id: str) -> str:
    """The trace of a run: 16 bytes of blake2b over its id (hex, as OTLP/JSON wants)."""
    return hashlib.blake2b(f"car-trace:{run_id}".encode(), digest_size=16).hexdigest()


def span_id(run_id: str, what: str, seq: int = -1) -> str:
    """A span of a run: 8 bytes of blake2b over the run id, the span's role and its event seq."""
    return hashlib.blake2b(f"car-span:{run_id}:{what}:{seq}".encode(), digest_size=8).hexdigest()


def _owner(journal: Journal, run_id: str, seq: int) -> str:
    """The run whose own events hold `seq` of this run's history (a branch shares a prefix)."""
    for seg in reversed(journal.lineage(run_id)):
        if seq >= seg.start:
            return seg.run_id
    return run_id


# ---------------------------------------------------------------------------------- spans


def _ns(iso: str) -> int:
    t = dt.datetime.fromisoformat(iso)
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.UTC)
    delta = t - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
    return (delta.days * 86_400 + delta.seconds) * 1_000_000_000 + delta.microseconds * 1000


def _span(
    tid: str,
    sid: str,
    parent: str | None,
    name: str,
    kind: int,
    start: int,
    end: int,
    attrs: dict[str, AttrValue | None],
    *,
    status: tuple[int, str] | None = None,
    links: list[dict[str, Any]] | None = None,
    events: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    span: dict[str, Any] = {"traceId": tid, "spanId": sid}
    if parent is not None:
        span["parentSpanId"] = parent
    span.update(
        name=name,
        kind=kind,
        startTimeUnixNano=str(start),
        endTimeUnixNano=str(end),
        attributes=key_values(attrs),
    )
    if events:
        span["events"] = events
    if links:
        span["links"] = links
    if status is not None:
        code, message = status
        span["status"] = {"code": code, **({"message": message} if message else {})}
    return span


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _text_message(role: str, content: str, **extra: Any) -> dict[str, Any]:
    return {"role": role, "parts": [{"type": "text", "content": content}], **extra}


def _input_messages(run: PublicRun, step: int, agent: str, llm: LlmFacts | None) -> list[Any]:
    """gen_ai.input.messages of a step.

    A transparent run shows the recorded request. Any other run shows the public conversation
    the agent saw before its turn: every message of earlier steps and the results of its own
    earlier tool calls, in step order. The system prompt is left out for every agent alike (the
    mole's holds its instructions), and so is the recorded request."""
    if llm is not None and llm.request is not None:
        return [
            _text_message(str(m.get("role", "user")), str(m.get("content", "")))
            for m in llm.request
        ]
    items: list[tuple[int, int, dict[str, Any]]] = []
    for m in run.messages:
        if m.step < step:
            items.append((m.step, 0, _text_message("user", f"{m.agent}: {m.text}")))
    for t in run.tool_usage:
        if t.step < step and t.agent == agent:
            shown = t.output if t.success else f"FAILED: {t.error or t.output}"
            items.append((t.step, 1, _text_message("tool", f"{t.tool}({t.param}): {shown}")))
    return [m for _, _, m in sorted(items, key=lambda i: (i[0], i[1]))]


def _flat_messages(prefix: str, messages: list[dict[str, Any]]) -> dict[str, AttrValue | None]:
    """OpenInference's flattened message attributes (llm.input_messages.<i>.message.*)."""
    out: dict[str, AttrValue | None] = {}
    for i, m in enumerate(messages):
        out[f"{prefix}.{i}.message.role"] = m["role"]
        out[f"{prefix}.{i}.message.content"] = "".join(
            str(p.get("content", "")) for p in m["parts"] if p.get("type") == "text"
        )
    return out


def _chat_span(
    src: ExportSource,
    tid: str,
    parent: str,
    sid: str,
    step: int,
    agent: str,
    text: str,
    llm: LlmFacts,
    start: int,
    end: int,
) -> dict[str, Any]:
    run = src.run
    model = src.model or llm.model
    inputs = _input_messages(run, step, agent, llm)
    outputs = [_text_message("assistant", text, finish_reason=llm.finish_reason)]
    invocation: dict[str, Any] = {"model": model}
    if llm.seed is not None:
        invocation["seed"] = llm.seed
    out_tokens = llm.completion_tokens or None
    total = None
    if llm.prompt_tokens is not None and out_tokens is not None:
        total = llm.prompt_tokens + out_tokens
    attrs: dict[str, AttrValue | None] = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": src.provider,
        "gen_ai.system": src.provider,
        "gen_ai.request.model": model,
        "gen_ai.request.seed": llm.seed,
        "gen_ai.response.model": llm.model,
        "gen_ai.response.finish_reasons": [llm.finish_reason],
        "gen_ai.usage.input_tokens": llm.prompt_tokens,
        "gen_ai.usage.output_tokens": out_tokens,
        "gen_ai.conversation.id": run.run_id,
        "gen_ai.agent.name": agent,
        "gen_ai.input.messages": _json(inputs),
        "gen_ai.output.messages": _json(outputs),
        "openinference.span.kind": "LLM",
        "llm.system": src.provider,
        "llm.provider": src.provider,
        "llm.model_name": model,
        "llm.invocation_parameters": _json(invocation),
        "llm.token_count.prompt": llm.prompt_tokens,
        "llm.token_count.completion": out_tokens,
        "llm.token_count.total": total,
        **_flat_messages("llm.input_messages", inputs),
        **_flat_messages("llm.output_messages", outputs),
        "input.value": _json(inputs),
        "input.mime_type": "application/json",
        "output.value": text,
        "output.mime_type": "text/plain",
        "car.step": step,
    }
    return _span(tid, sid, parent, f"chat {model}", SPAN_KIND_CLIENT, start, end, attrs)


def _run_spans(journal: Journal, src: ExportSource) -> Iterator[dict[str, Any]]:
    run = src.run
    info = journal.run(run.run_id)
    own_from = info.fork_seq or 0
    tid = trace_id(run.run_id)
    root = span_id(run.run_id, "run")
    base = _ns(src.created_at)
    messages = [m for m in run.messages if m.seq >= own_from]
    tools = [t for t in run.tool_usage if t.seq >= own_from]
    forced = {int(i["at"]) for i in run.interventions if i.get("op") == "action"}
    first_step = messages[0].step if messages else 0
    n_steps = (messages[-1].step - first_step + 1) if messages else 0

    def step_start(step: int) -> int:
        return base + (step - first_step) * STEP_NS

    root_attrs: dict[str, AttrValue | None] = {
        "openinference.span.kind": "CHAIN",
        "session.id": info.root_run_id,
        "gen_ai.conversation.id": run.run_id,
        "car.run.id": run.run_id,
        "car.scenario": run.scenario,
        "car.status": run.status,
        "car.steps": run.steps,
        "car.agents": list(run.agents),
        "car.policy": run.policy or None,
        "car.timing": "layout",
        "car.parent_run.id": run.parent_run_id,
        "car.fork.step": run.fork_step,
    }
    opening = next((i for i in run.interventions if i["seq"] == info.fork_seq), None)
    if opening is not None:
        root_attrs["car.intervention.op"] = str(opening["op"])
        root_attrs["car.intervention.at"] = int(opening["at"])
        value = opening.get("value")
        root_attrs["car.intervention.value"] = None if value is None else _json(value)
    if run.outcome is not None:
        root_attrs["car.outcome"] = _json(run.outcome)
        root_attrs["output.value"] = _json(run.outcome)
        root_attrs["output.mime_type"] = "application/json"
        if isinstance(run.outcome.get("bad"), bool):
            root_attrs["car.outcome.bad"] = run.outcome["bad"]
        if isinstance(run.outcome.get("score"), int | float):
            root_attrs["car.outcome.score"] = float(run.outcome["score"])
    links = _parent_links(journal, run)
    events = [
        {
            "timeUnixNano": str(step_start(int(c["step"] or first_step))),
            "name": "car.control",
            "attributes": key_values(
                {"car.control.action": str(c["action"]), "car.control.reason": c.get("reason")}
            ),
        }
        for c in run.controls
        if int(c["seq"]) >= own_from
    ]
    failed = run.status == "failed"
    yield _span(
        tid,
        root,
        None,
        f"car.run {run.scenario}",
        SPAN_KIND_INTERNAL,
        base,
        base + max(n_steps, 1) * STEP_NS,
        root_attrs,
        status=(STATUS_ERROR, "run failed") if failed else None,
        links=links,
        events=events,
    )
    for m in messages:
        start = step_start(m.step)
        agent_sid = span_id(run.run_id, "agent", m.seq)
        step_tools = [t for t in tools if t.step == m.step]
        agent_attrs: dict[str, AttrValue | None] = {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.agent.name": m.agent,
            "gen_ai.conversation.id": run.run_id,
            "gen_ai.provider.name": src.provider,
            "openinference.span.kind": "AGENT",
            "agent.name": m.agent,
            "output.value": m.text,
            "output.mime_type": "text/plain",
            "car.step": m.step,
            "car.forced": True if m.step in forced else None,
        }
        yield _span(
            tid,
            agent_sid,
            root,
            f"invoke_agent {m.agent}",
            SPAN_KIND_INTERNAL,
            start,
            start + STEP_NS - 1000,
            agent_attrs,
        )
        llm = src.llm.get(m.step)
        if llm is not None and m.step not in forced:
            yield _chat_span(
                src,
                tid,
                agent_sid,
                span_id(run.run_id, "chat", m.seq),
                m.step,
                m.agent,
                m.text,
                llm,
                start + 10_000,
                start + 400_000,
            )
        slot = 500_000 // max(len(step_tools), 1)
        for i, t in enumerate(step_tools):
            t0 = start + 450_000 + i * slot
            shown = t.output if t.success else (t.error or t.output)
            tool_attrs: dict[str, AttrValue | None] = {
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": t.tool,
                "gen_ai.tool.type": "function",
                "gen_ai.tool.call.arguments": t.param,
                "gen_ai.tool.call.result": shown,
                "gen_ai.agent.name": t.agent,
                "openinference.span.kind": "TOOL",
                "tool.name": t.tool,
                "tool.parameters": _json({"param": t.param}),
                "input.value": t.param,
                "input.mime_type": "text/plain",
                "output.value": shown,
                "output.mime_type": "text/plain",
                "car.step": t.step,
                "car.tool.success": t.success,
            }
            yield _span(
                tid,
                span_id(run.run_id, "tool", t.seq),
                agent_sid,
                f"execute_tool {t.tool}",
                SPAN_KIND_INTERNAL,
                t0,
                t0 + slot - 1000,
                tool_attrs,
                status=None if t.success else (STATUS_ERROR, t.error or "tool failed"),
            )


def _parent_links(journal: Journal, run: PublicRun) -> list[dict[str, Any]]:
    """A branch links to its parent run's root span and to the parent's span of the step it
    re-decided (when the parent has a message at that step)."""
    if run.parent_run_id is None:
        return []
    parent = run.parent_run_id
    links = [
        {
            "traceId": trace_id(parent),
            "spanId": span_id(parent, "run"),
            "attributes": key_values({"car.link": "parent_run"}),
        }
    ]
    if run.fork_step is not None:
        at = next(
            (m for m in public_view(journal, parent).messages if m.step == run.fork_step), None
        )
        if at is not None:
            owner = _owner(journal, parent, at.seq)
            links.append(
                {
                    "traceId": trace_id(owner),
                    "spanId": span_id(owner, "agent", at.seq),
                    "attributes": key_values({"car.link": "forked_step", "car.step": at.step}),
                }
            )
    return links


# ------------------------------------------------------------------------------ documents


def run_spans(journal: Journal, run_id: str) -> list[dict[str, Any]]:
    """The spans of one run's trace (its own steps; a branch's prefix is its parent's)."""
    return list(_run_spans(journal, read_source(journal, run_id)))


def export_runs(journal: Journal, run_id: str, *, with_branches: bool = False) -> list[str]:
    """The run ids an export covers: the run, and with branches every descendant (depth first)."""
    first = journal.run(run_id).run_id
    ids = [first]
    if with_branches:
        todo = [first]
        while todo:
            for child in journal.children(todo.pop(0)):
                ids.append(child.run_id)
                todo.append(child.run_id)
    return ids


def trace_document(journal: Journal, run_ids: list[str]) -> dict[str, Any]:
    """One OTLP/JSON `ExportTraceServiceRequest` holding the traces of these runs."""
    from engine.version import engine_version

    version = engine_version()
    spans = [s for rid in run_ids for s in run_spans(journal, rid)]
    resource = {"attributes": key_values({"service.name": "car", "service.version": version})}
    scope = {"name": SCOPE_NAME, "version": version}
    return {
        "resourceSpans": [
            {
                "resource": resource,
                "scopeSpans": [{"scope": scope, "spans": spans, "schemaUrl": SCHEMA_URL}],
                "schemaUrl": SCHEMA_URL,
            }
        ]
    }


def dumps(document: dict[str, Any]) -> str:
    """The document as one line of JSON (Jaeger's UI reads one document per file)."""
    return _json(document)


def traces_endpoint(url: str) -> str:
    """The OTLP/HTTP traces URL: a base URL gets `/v1/traces` appended, a full one is kept."""
    url = url.rstrip("/")
    return url if url.endswith("/v1/traces") else url + "/v1/traces"


PROTOCOLS = ("http/json", "http/protobuf")


def _b64_ids(document: dict[str, Any]) -> dict[str, Any]:
    """A copy with hex ids turned into base64: protobuf's JSON mapping of `bytes` fields."""

    def b64(hex_id: str) -> str:
        return base64.b64encode(bytes.fromhex(hex_id)).decode()

    doc = json.loads(_json(document))
    for rs in doc["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for span in ss["spans"]:
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in span:
                        span[key] = b64(span[key])
                for link in span.get("links", []):
                    link["traceId"], link["spanId"] = b64(link["traceId"]), b64(link["spanId"])
    return doc  # type: ignore[no-any-return]


def to_protobuf(document: dict[str, Any]) -> bytes:
    """The document as a binary `ExportTraceServiceRequest` (receivers such as Phoenix take
    OTLP/HTTP in protobuf only)."""
    try:
        from google.protobuf import json_format
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )
    except ImportError as e:
        raise ExportError(
            f"--otlp-protocol http/protobuf needs the opentelemetry-proto package ({e.name} "
            "is missing)"
        ) from e
    message = json_format.ParseDict(_b64_ids(document), ExportTraceServiceRequest())
    return message.SerializeToString()  # type: ignore[no-any-return]


def post(
    document: dict[str, Any],
    endpoint: str,
    *,
    protocol: str = "http/json",
    timeout: float = 30.0,
) -> str:
    """POST the document over OTLP/HTTP (JSON or protobuf); returns the URL it went to."""
    from engine.urls import http_url_problem

    url = traces_endpoint(endpoint)
    problem = http_url_problem(url)
    if problem is not None:
        raise ExportError(f"--otlp-endpoint must be an http(s) URL, got {endpoint!r} ({problem})")
    if protocol == "http/json":
        body, content_type = dumps(document).encode(), "application/json"
    elif protocol == "http/protobuf":
        body, content_type = to_protobuf(document), "application/x-protobuf"
    else:
        raise ExportError(
            f"unknown OTLP protocol {protocol!r}; expected one of: {', '.join(PROTOCOLS)}"
        )
    req = urllib.request.Request(
        url, data=body, headers={"Content-Type": content_type}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()
    except urllib.error.HTTPError as e:
        answer = e.read().decode(errors="replace").strip().splitlines() or [""]
        detail = f": {answer[0][:200]}" if answer[0] else ""
        hint = ""
        if e.code == 415 and protocol == "http/json":
            hint = " (this receiver may take protobuf only: try --otlp-protocol http/protobuf)"
        raise ExportError(
            f"OTLP receiver at {url} answered {e.code} {e.reason}{detail}{hint}"
        ) from e
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ExportError(f"cannot reach OTLP receiver at {url}: {reason}") from e
    return url
