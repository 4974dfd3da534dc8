"""Traces of LLM programs as runs: OTLP/JSON in, one run per trace.

Reads what OpenTelemetry's and OpenInference's instrumentations write:

- LLM spans (`openinference.span.kind=LLM`, or `gen_ai.operation.name` chat / text_completion
  / generate_content) become steps, in start-time order. Messages come from
  `gen_ai.input.messages`/`gen_ai.output.messages` (GenAI v1.37+), OpenInference's
  `llm.input_messages.<i>.message.*`/`llm.output_messages.*`, OpenLLMetry's
  `gen_ai.prompt.<i>.*`/`gen_ai.completion.<i>.*`, GenAI span events (v1.27-era), or finally
  `input.value`/`output.value`.
- Tool spans (`TOOL`, `execute_tool`) become the tool calls of the step they ran in: the last
  LLM step that started before them. A tool call the model asked for without a tool span is
  kept as a call, with its result when a later request answers it (a `tool` message with the
  same call id).
- The acting agent is the span's `gen_ai.agent.name`, else that of its nearest agent span
  (`AGENT`, `invoke_agent`), else "assistant".

The file may be one OTLP/JSON document or JSON Lines of them (the Collector's file exporter);
`engine.otel.otlp` reads it into spans. All journal events are built by one function,
`trace_events`, and written through `Journal.create_run` / `Journal.append`.
"""

from __future__ import annotations

import bisect
import datetime as dt
import json
import os
import stat
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from engine import events as ev
from engine.errors import JournalError
from engine.journal import Journal
from engine.otel.attrs import integer, shown
from engine.otel.imported import IMPORTED_SCENARIO
from engine.otel.otlp import Span, TraceImportError, parse_spans

DEFAULT_AGENT = "assistant"
# what the event schema holds (msgpack's 64-bit integers): token counts are signed, seeds may
# be any 64-bit value, signed or not
MAX_COUNT = 2**63 - 1
SEED_RANGE = (-(2**63), 2**64 - 1)
_LLM_OPERATIONS = {"chat", "text_completion", "generate_content", "completion"}


# ----------------------------------------------------------------------- interpretation


class ImportedTool(msgspec.Struct, frozen=True):
    name: str
    param: str
    ok: bool = True
    output: str = ""
    error: str | None = None
    answered: bool = True  # False: the model asked for it, nothing in the trace answered
    from_span: bool = False  # executed in a tool span (not only asked for by the model)


class ImportedStep(msgspec.Struct, frozen=True):
    agent: str
    request: list[dict[str, str]]
    response: str
    model: str
    finish_reason: str
    seed: int
    prompt_tokens: int
    completion_tokens: int
    latency_ms: float
    tools: list[ImportedTool]


class ImportedTrace(msgspec.Struct, frozen=True):
    trace_id: str
    source: str
    service: str | None
    started_at: str
    agents: list[str]
    steps: list[ImportedStep]
    provider: str | None
    model: str | None
    error: str | None  # the root span's error: the program failed


def span_kind(span: Span) -> str | None:
    """LLM, TOOL, AGENT (or another OpenInference kind), from either convention."""
    kind = span.attrs.get("openinference.span.kind")
    if isinstance(kind, str) and kind:
        return kind.upper()
    op = span.attrs.get("gen_ai.operation.name")
    if op in _LLM_OPERATIONS:
        return "LLM"
    if op == "execute_tool":
        return "TOOL"
    if op in ("invoke_agent", "create_agent"):
        return "AGENT"
    if "llm.model_name" in span.attrs or "gen_ai.request.model" in span.attrs:
        return "LLM"
    return None


def _loads(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return None
    return value


def _list(value: Any) -> list[Any]:
    """A list a message should hold (parts, tool calls); anything else there is none."""
    return value if isinstance(value, list) else []


def _dict(value: Any) -> dict[str, Any]:
    """An object a message should hold (a tool call's function); anything else is empty."""
    return value if isinstance(value, dict) else {}


def _parts_text(message: dict[str, Any]) -> str:
    """The text of a GenAI (v1.37) message's parts, or of an OpenAI-style message's content."""
    parts = message.get("parts")
    if isinstance(parts, list):
        texts = []
        for p in parts:
            if not isinstance(p, dict):
                continue
            if p.get("type") == "text":
                texts.append(str(p.get("content", "")))
            elif p.get("type") == "tool_call_response":
                texts.append(_as_text(p.get("response", p.get("result", ""))))
        return "".join(texts)
    return _as_text(message.get("content", ""))


def _as_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # OpenAI content parts
        return "".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in value)
    return json.dumps(value, ensure_ascii=False)


def _index(text: str) -> int | None:
    """The list index of a flattened key's part (`llm.input_messages.<i>.`): ASCII decimal
    digits, at most 18 of them. Anything else (a superscript two, which str.isdigit takes for
    a digit and int() does not; 5000 digits, past int()'s limit) is no index."""
    if not (text.isascii() and text.isdigit()) or len(text) > 18:
        return None
    return int(text)


def _indexed(attrs: dict[str, Any], prefix: str) -> list[dict[str, Any]]:
    """Flattened lists (`prefix.<i>.<rest>`) back into a list of dicts keyed by <rest>."""
    found: dict[int, dict[str, Any]] = {}
    for key, value in attrs.items():
        if not key.startswith(prefix + "."):
            continue
        head, _, rest = key[len(prefix) + 1 :].partition(".")
        i = _index(head)
        if i is not None and rest:
            found.setdefault(i, {})[rest] = value
    return [found[i] for i in sorted(found)]


def _oi_messages(attrs: dict[str, Any], prefix: str) -> list[dict[str, Any]]:
    out = []
    for m in _indexed(attrs, prefix):
        content = m.get("message.content")
        if content is None:  # multimodal: message.contents.<j>.message_content.text
            texts = [
                str(v)
                for k, v in sorted(m.items())
                if k.startswith("message.contents.") and k.endswith("message_content.text")
            ]
            content = "".join(texts)
        calls = _oi_tool_calls(m)
        out.append(
            {
                "role": str(m.get("message.role", "user")),
                "content": _as_text(content),
                "tool_call_id": m.get("message.tool_call_id"),
                "tool_calls": calls,
            }
        )
    return out


def _oi_tool_calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    calls: dict[int, dict[str, Any]] = {}
    for key, value in message.items():
        if not key.startswith("message.tool_calls."):
            continue
        head, _, rest = key[len("message.tool_calls.") :].partition(".")
        i = _index(head)
        if i is not None:
            calls.setdefault(i, {})[rest] = value
    return [
        {
            "id": c.get("tool_call.id"),
            "name": c.get("tool_call.function.name"),
            "arguments": c.get("tool_call.function.arguments"),
        }
        for _, c in sorted(calls.items())
        if c.get("tool_call.function.name")
    ]


def _genai_messages(value: Any) -> list[dict[str, Any]] | None:
    data = _loads(value)
    if not isinstance(data, list):
        return None
    out = []
    for m in data:
        if not isinstance(m, dict):
            continue
        calls = []
        call_id = m.get("tool_call_id")
        for p in _list(m.get("parts")):
            if isinstance(p, dict) and p.get("type") == "tool_call":
                calls.append(
                    {"id": p.get("id"), "name": p.get("name"), "arguments": p.get("arguments")}
                )
            if isinstance(p, dict) and p.get("type") == "tool_call_response":
                call_id = p.get("id", call_id)
        out.append(
            {
                "role": str(m.get("role", "user")),
                "content": _parts_text(m),
                "tool_call_id": call_id,
                "tool_calls": calls,
                "finish_reason": m.get("finish_reason"),
            }
        )
    return out


def _event_messages(span: Span) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """GenAI messages written as span events (gen_ai.user.message, gen_ai.choice, ...)."""
    inputs: list[dict[str, Any]] = []
    outputs: list[dict[str, Any]] = []
    for name, a in span.events:
        if name == "gen_ai.choice":
            msg = _loads(a.get("message")) or {}
            content = msg.get("content") if isinstance(msg, dict) else None
            outputs.append(
                {
                    "role": "assistant",
                    "content": _as_text(content or a.get("content")),
                    "tool_calls": [],
                    "finish_reason": a.get("finish_reason"),
                }
            )
        elif name.startswith("gen_ai.") and name.endswith(".message"):
            role = name.removeprefix("gen_ai.").removesuffix(".message")
            inputs.append(
                {
                    "role": role,
                    "content": _as_text(a.get("content")),
                    "tool_call_id": a.get("id"),
                    "tool_calls": [],
                }
            )
    return inputs, outputs


def _messages(span: Span) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    a = span.attrs
    inputs = _genai_messages(a.get("gen_ai.input.messages"))
    outputs = _genai_messages(a.get("gen_ai.output.messages"))
    if inputs is not None and "gen_ai.system_instructions" in a:
        system = _loads(a["gen_ai.system_instructions"])
        text = (
            "".join(_parts_text({"parts": [p]}) for p in system)
            if isinstance(system, list)
            else _as_text(a["gen_ai.system_instructions"])
        )
        inputs = [{"role": "system", "content": text, "tool_calls": []}, *inputs]
    if inputs is None and any(k.startswith("llm.input_messages.") for k in a):
        inputs = _oi_messages(a, "llm.input_messages")
    if outputs is None and any(k.startswith("llm.output_messages.") for k in a):
        outputs = _oi_messages(a, "llm.output_messages")
    if inputs is None and any(k.startswith("gen_ai.prompt.") for k in a):
        inputs = [
            {
                "role": str(m.get("role", "user")),
                "content": _as_text(m.get("content")),
                "tool_calls": [],
            }
            for m in _indexed(a, "gen_ai.prompt")
        ]
    if outputs is None and any(k.startswith("gen_ai.completion.") for k in a):
        outputs = [
            {
                "role": str(m.get("role", "assistant")),
                "content": _as_text(m.get("content")),
                "tool_calls": [],
                "finish_reason": m.get("finish_reason"),
            }
            for m in _indexed(a, "gen_ai.completion")
        ]
    if inputs is None or outputs is None:
        ev_in, ev_out = _event_messages(span)
        inputs = inputs if inputs is not None else (ev_in or None)
        outputs = outputs if outputs is not None else (ev_out or None)
    if inputs is None:
        inputs = _from_value(a.get("input.value"), "messages", "user")
    if outputs is None:
        outputs = _from_value(a.get("output.value"), "choices", "assistant")
    return inputs, outputs


def _from_value(value: Any, key: str, role: str) -> list[dict[str, Any]]:
    """OpenInference's input.value / output.value: an OpenAI request or response body, or text."""
    if value is None:
        return []
    data = _loads(value)
    if isinstance(data, dict) and isinstance(data.get(key), list):
        out = []
        for item in data[key]:
            if not isinstance(item, dict):
                continue
            m = item.get("message", item) if key == "choices" else item
            if not isinstance(m, dict):
                continue
            out.append(
                {
                    "role": str(m.get("role", role)),
                    "content": _as_text(m.get("content")),
                    "tool_call_id": m.get("tool_call_id"),
                    "tool_calls": [
                        {"id": c.get("id"), **_dict(c.get("function"))}
                        for c in _list(m.get("tool_calls"))
                        if isinstance(c, dict)
                    ],
                    "finish_reason": item.get("finish_reason") if key == "choices" else None,
                }
            )
        return out
    return [{"role": role, "content": _as_text(value), "tool_calls": []}]


def _first(a: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        if a.get(k) not in (None, ""):
            return a[k]
    return None


def _agent_of(span: Span, by_id: dict[str, Span], found: dict[str, str] | None = None) -> str:
    """The span's own agent name, else that of its nearest agent span above it, else
    DEFAULT_AGENT (a cycle in the parent links ends the search too). `found` remembers, for
    the spans passed on the way up, what the search from each of them gives, so that the
    LLM spans of one trace cost time linear in the spans, however deep they nest."""
    own = _first(span.attrs, "gen_ai.agent.name", "agent.name")
    if own:
        return str(own)
    found = {} if found is None else found
    path: list[str] = []
    on_path: set[str] = set()
    node = by_id.get(span.parent_id or "")
    name = DEFAULT_AGENT
    while node is not None and node.span_id not in on_path:
        if node.span_id in found:
            name = found[node.span_id]
            break
        if span_kind(node) == "AGENT":
            named = _first(node.attrs, "gen_ai.agent.name", "agent.name")
            name = str(named or node.name.removeprefix("invoke_agent ").strip() or DEFAULT_AGENT)
            found[node.span_id] = name
            break
        path.append(node.span_id)
        on_path.add(node.span_id)
        node = by_id.get(node.parent_id or "")
    for span_id in path:  # each of them finds the same: the first agent above (or none)
        found[span_id] = name
    return name


def _tool_from_span(span: Span) -> ImportedTool:
    a = span.attrs
    name = _first(a, "gen_ai.tool.name", "tool.name") or span.name.removeprefix("execute_tool ")
    param = _first(a, "gen_ai.tool.call.arguments", "tool.parameters", "input.value")
    params = _loads(param)
    if isinstance(params, dict) and set(params) == {"param"}:
        param = params["param"]
    output = _as_text(_first(a, "gen_ai.tool.call.result", "output.value"))
    if span.error is not None:
        return ImportedTool(
            str(name), _as_text(param), False, "", span.error or output, from_span=True
        )
    return ImportedTool(str(name), _as_text(param), True, output, from_span=True)


def _step(
    span: Span, by_id: dict[str, Span], agents: dict[str, str] | None = None
) -> tuple[ImportedStep, list[dict[str, Any]]]:
    a = span.attrs
    inputs, outputs = _messages(span)
    invocation = _loads(a.get("llm.invocation_parameters"))
    invocation = invocation if isinstance(invocation, dict) else {}
    seed = _first(a, "gen_ai.request.seed") or invocation.get("seed") or 0
    finishes = a.get("gen_ai.response.finish_reasons")
    finish = (
        finishes[0]
        if isinstance(finishes, list) and finishes
        else next((m.get("finish_reason") for m in outputs if m.get("finish_reason")), None)
    )
    if span.error is not None:
        finish = "error"
    model = _first(a, "gen_ai.request.model", "llm.model_name", "gen_ai.response.model")
    model = model or invocation.get("model") or "unknown"
    text = "".join(m["content"] for m in outputs if m.get("role", "assistant") == "assistant")
    asked = [c for m in outputs for c in m.get("tool_calls") or []]
    step = ImportedStep(
        agent=_agent_of(span, by_id, agents),
        request=[{"role": m["role"], "content": m["content"]} for m in inputs],
        response=text,
        model=str(model),
        finish_reason=str(finish or "unknown"),
        seed=_seed(seed, span),
        prompt_tokens=_count(
            span,
            "gen_ai.usage.input_tokens",
            "llm.token_count.prompt",
            "gen_ai.usage.prompt_tokens",
        ),
        completion_tokens=_count(
            span,
            "gen_ai.usage.output_tokens",
            "llm.token_count.completion",
            "gen_ai.usage.completion_tokens",
        ),
        latency_ms=round(max(0, span.end - span.start) / 1e6, 3),
        tools=[],
    )
    return step, asked


def _count(span: Span, *keys: str) -> int:
    """A token count from the first of `keys` the span sets (0 if none): an integer from 0
    to MAX_COUNT, else TraceImportError naming the span and the attribute."""
    for key in keys:
        value = span.attrs.get(key)
        if value in (None, ""):
            continue
        n = integer(value)
        if n is None or not 0 <= n <= MAX_COUNT:
            raise TraceImportError(
                f"{span.where or span.span_id}: {key}: expected a token count (an integer from"
                f" 0 to 2**63-1), got {shown(value)}"
            )
        return n
    return 0


def _seed(value: Any, span: Span) -> int:
    """The request's seed: an integer as OTLP/JSON carries one (`attrs.integer`: 7, 7.0 and "7"
    are 7) from -2**63 to 2**64-1.

    A number, or text that reads as one, that is not such an integer is malformed and refused,
    as is one out of range: 1.5 and "1.5" alike, NaN and "NaN", "1e3" and "7.0" (a seed written
    as text is decimal digits, as OTLP/JSON writes integers). Text that is no number ("abc")
    and values that are neither number nor text (a bool, a list) are no seed (0), as is an
    absent seed."""
    n = integer(value)
    if n is None and not _numeric(value):
        return 0
    if n is None or not SEED_RANGE[0] <= n <= SEED_RANGE[1]:
        raise TraceImportError(
            f"{span.where or span.span_id}: seed: expected a 64-bit integer, got {shown(value)}"
        )
    return n


def _numeric(value: Any) -> bool:
    """A number (not a bool), or text that Python reads as one ("1.5", "1e3", "NaN")."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int | float):
        return True
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return False
        return True
    return False


def _answers(spans: list[Span]) -> dict[str, str]:
    """Tool results that later requests carry: tool_call_id -> content."""
    out: dict[str, str] = {}
    for s in spans:
        inputs, _ = _messages(s)
        for m in inputs:
            if m.get("role") == "tool" and m.get("tool_call_id"):
                out[str(m["tool_call_id"])] = m["content"]
    return out


def interpret(spans: list[Span], source: str) -> list[ImportedTrace]:
    """One ImportedTrace per trace id that holds at least one LLM span."""
    by_trace: dict[str, list[Span]] = {}
    seen: set[tuple[str, str]] = set()
    for s in spans:
        if (s.trace_id, s.span_id) in seen:  # sent twice (an exporter's retry): read once
            continue
        seen.add((s.trace_id, s.span_id))
        by_trace.setdefault(s.trace_id, []).append(s)
    traces = []
    for tid, group in by_trace.items():
        by_id = {s.span_id: s for s in group}
        ordered = sorted(group, key=lambda s: (s.start, s.order))
        llm_spans = [s for s in ordered if span_kind(s) == "LLM"]
        if not llm_spans:
            continue
        answers = _answers(llm_spans)
        found_agents: dict[str, str] = {}  # what the search for an agent found, by span
        steps: list[ImportedStep] = []
        tools: list[list[ImportedTool]] = []
        for s in llm_spans:
            step, asked = _step(s, by_id, found_agents)
            steps.append(step)
            tools.append(
                [
                    ImportedTool(
                        str(c.get("name")),
                        _as_text(c.get("arguments")),
                        output=answers.get(str(c.get("id")), ""),
                        answered=str(c.get("id")) in answers,
                    )
                    for c in asked
                ]
            )
        starts = [llm.start for llm in llm_spans]  # ascending: llm_spans are in start order
        asked_calls = [_asked_by_name(t) for t in tools]
        for s in ordered:
            if span_kind(s) != "TOOL":
                continue
            # the last LLM step that started before the tool span (the first step if none)
            k = max(bisect.bisect_right(starts, s.start) - 1, 0)
            _merge(tools[k], asked_calls[k], _tool_from_span(s))
        steps = [msgspec.structs.replace(st, tools=t) for st, t in zip(steps, tools, strict=True)]
        roots = [s for s in group if s.parent_id is None or s.parent_id not in by_id]
        error = next((s.error for s in roots if s.error is not None), None)
        agents: list[str] = []
        for st in steps:
            if st.agent not in agents:
                agents.append(st.agent)
        provider = _first(
            llm_spans[0].attrs,
            "gen_ai.provider.name",
            "gen_ai.system",
            "llm.provider",
            "llm.system",
        )
        traces.append(
            ImportedTrace(
                trace_id=tid,
                source=source,
                service=next((s.service for s in group if s.service), None),
                started_at=_iso(min(s.start for s in group)),
                agents=agents,
                steps=steps,
                provider=str(provider) if provider else None,
                model=steps[0].model if steps else None,
                error=error,
            )
        )
    return traces


def _asked_by_name(tools: list[ImportedTool]) -> dict[str, deque[int]]:
    """Where in a step's tool list the calls the model asked for are, by tool name, in order."""
    found: dict[str, deque[int]] = {}
    for i, t in enumerate(tools):
        if not t.from_span:
            found.setdefault(t.name, deque()).append(i)
    return found


def _merge(tools: list[ImportedTool], asked: dict[str, deque[int]], executed: ImportedTool) -> None:
    """Add a tool span to its step's `tools` (in place). It is the execution of the first call
    of that tool the model asked for that no span took yet (`asked`: their places, taken off
    as spans take them), so it takes that call's place (and what the span leaves out, the
    call's arguments and answer, is taken from the call); else it is appended. Constant time
    a span, so a trace of many tool spans imports in time linear in them."""
    waiting = asked.get(executed.name)
    if not waiting:
        tools.append(executed)
        return
    i = waiting.popleft()
    t = tools[i]
    tools[i] = msgspec.structs.replace(
        executed,
        param=executed.param or t.param,
        output=executed.output or (t.output if executed.ok else ""),
    )


def _iso(ns: int) -> str:
    """UTC ISO time of `ns` nanoseconds since 1970 (a span time: 0 to 2**64-1, checked when
    read), without the platform's time_t."""
    t = dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(microseconds=ns // 1000)
    return t.isoformat(timespec="microseconds")


# --------------------------------------------------------------------------------- events


def trace_events(trace: ImportedTrace) -> list[ev.Event]:
    """Every journal event of an imported run. The only place an import builds events."""
    from engine.version import engine_version

    events: list[ev.Event] = [
        ev.RunStarted(
            scenario=IMPORTED_SCENARIO,
            config={
                "source": {
                    "file": trace.source,
                    "trace_id": trace.trace_id,
                    "service": trace.service,
                },
            },
            agents=list(trace.agents),
            policy={"name": IMPORTED_SCENARIO, "provider": trace.provider, "model": trace.model},
            root_seed=0,
            engine_version=engine_version(),
            started_at=trace.started_at,
        )
    ]
    for k, s in enumerate(trace.steps):
        events.append(
            ev.LlmCall(
                step=k,
                agent=s.agent,
                request=s.request,
                seed=s.seed,
                model=s.model,
                response=s.response,
                finish_reason=s.finish_reason,
                prompt_tokens=s.prompt_tokens,
                completion_tokens=s.completion_tokens,
                latency_ms=s.latency_ms,
            )
        )
        for t in s.tools:
            events.append(ev.ToolCall(step=k, agent=s.agent, tool=t.name, param=t.param))
            if t.answered:
                events.append(
                    ev.ToolResult(
                        step=k,
                        agent=s.agent,
                        tool=t.name,
                        param=t.param,
                        ok=t.ok,
                        output=t.output,
                        error=t.error,
                    )
                )
        events.append(ev.ChatMessage(step=k, agent=s.agent, text=s.response))
    if trace.error is not None:
        events.append(ev.RunEnded(status="failed", error=trace.error))
    else:
        events.append(ev.RunEnded(status="completed"))
    return events


class ImportedRun(msgspec.Struct, frozen=True):
    run_id: str
    trace_id: str
    agents: list[str]
    steps: int
    tool_calls: int
    status: str
    # the journal held this trace already (imported before, from this file or another): its
    # run is named, nothing was written
    already_imported: bool = False


def read_traces(path: str | Path) -> list[ImportedTrace]:
    """Parse and interpret a trace file; TraceImportError (one line) on anything malformed."""
    p = Path(path)
    # the file's name as text: a name that is no UTF-8 (bytes the file system kept as they
    # are) is shown with those bytes escaped, and so is journaled (RunStarted.config)
    name = os.fsencode(p.name).decode("utf-8", "backslashreplace")
    data = _read_file(p)
    if data.startswith(b"\x1f\x8b"):
        raise TraceImportError(
            f"{name} is gzip-compressed: decompress it (gunzip) and import the JSON"
        )
    try:
        # UTF-8, with the byte order mark some Windows editors write taken off
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise TraceImportError(f"{str(p)!r} is not UTF-8 text (OTLP/JSON expected)") from None
    try:
        spans = parse_spans(text, name)
        if not spans:
            raise TraceImportError(f"{name} holds no spans")
        traces = interpret(spans, name)
    except RecursionError:
        # values nested deeper than Python recurses (arrays in attributes, JSON in strings)
        raise TraceImportError(f"{name} nests values too deeply to read") from None
    if not traces:
        raise TraceImportError(
            f"{name} holds {len(spans)} spans but no LLM call (expected spans with "
            "openinference.span.kind=LLM or gen_ai.operation.name=chat)"
        )
    return traces


def _read_file(p: Path) -> bytes:
    """The bytes of the regular file `p`. Opened without blocking and checked before it is
    read, so that a named pipe (which would wait for a writer) or a device such as
    /dev/zero (which never ends) is refused at once; a directory likewise."""
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise TraceImportError(f"no such file: {str(p)!r}") from None
    except IsADirectoryError:
        raise TraceImportError(f"{str(p)!r} is a directory, not a trace file") from None
    except OSError as e:
        raise TraceImportError(f"cannot read {str(p)!r}: {e.strerror}") from e
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise TraceImportError(f"{str(p)!r} is a directory, not a trace file")
        if not stat.S_ISREG(mode):
            raise TraceImportError(
                f"{str(p)!r} is not a regular file (a named pipe, a device or a socket); "
                "write the trace to a file and import that"
            )
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    except OSError as e:
        raise TraceImportError(f"cannot read {str(p)!r}: {e.strerror}") from e
    finally:
        os.close(fd)


def import_traces(
    journal: Journal, traces: Iterable[ImportedTrace], *, again: bool = False
) -> list[ImportedRun]:
    """One run per trace, each appended whole in one transaction. Every event of every trace
    is encoded (and checked to read back) before the first run is created, so a trace the
    journal would refuse leaves nothing behind. A trace the journal holds already (the same
    trace id and the same spans, from any file) is not imported again unless `again`: its run
    is named with `already_imported` (an import interrupted, or an exporter's file read twice)."""
    ready = []
    for t in traces:
        events = trace_events(t)
        try:
            payloads = [ev.encode_checked(e) for e in events]
        except JournalError as e:
            raise TraceImportError(
                f"{t.source}: trace {t.trace_id} cannot be journaled: {e}"
            ) from e
        ready.append((t, events, payloads))
    held = {} if again else _imported_runs(journal, {t.trace_id for t, _, _ in ready})
    done: list[ImportedRun] = []
    try:
        for t, events, payloads in ready:
            run_id = next(
                (r for r in held.get(t.trace_id, ()) if _same_trace(journal, r, events)), None
            )
            already = run_id is not None
            if run_id is None:
                # the run and its events in one transaction: never an empty run left behind
                run_id = journal.create_run(
                    IMPORTED_SCENARIO,
                    label=_label(t.trace_id),
                    events=events,
                    payloads=payloads,
                )
            done.append(
                ImportedRun(
                    run_id=run_id,
                    trace_id=t.trace_id,
                    agents=list(t.agents),
                    steps=len(t.steps),
                    tool_calls=sum(len(s.tools) for s in t.steps),
                    status="failed" if t.error is not None else "completed",
                    already_imported=already,
                )
            )
    except KeyboardInterrupt:
        # Ctrl-C between two traces (each is whole): say how far the import got
        from engine.workers import Interrupted

        which = f" (runs {done[0].run_id} .. {done[-1].run_id})" if done else ""
        raise Interrupted(
            f"interrupted: {len(done)} of {len(ready)} traces imported{which}; importing the "
            "file again skips the traces the journal holds"
        ) from None
    return done


def _label(trace_id: str) -> str:
    return f"trace {trace_id}"


def _imported_runs(journal: Journal, trace_ids: set[str]) -> dict[str, list[str]]:
    """The imported runs of the journal that may hold one of `trace_ids` (by their label)."""
    wanted = {_label(t): t for t in trace_ids}
    found: dict[str, list[str]] = {}
    for r in journal.runs():
        if r.scenario == IMPORTED_SCENARIO and r.parent_run_id is None and r.label in wanted:
            found.setdefault(wanted[r.label], []).append(r.run_id)
    return found


def _same_trace(journal: Journal, run_id: str, events: Sequence[ev.Event]) -> bool:
    """Whether run `run_id` holds `events`: the same events, apart from the name of the file
    they came from and the version of the engine that imported them (RunStarted)."""
    stored = journal.events(run_id)
    if len(stored) != len(events):
        return False

    def neutral(e: Any) -> Any:
        if isinstance(e, ev.RunStarted):
            config = dict(e.config)
            if isinstance(config.get("source"), dict):
                config["source"] = {k: v for k, v in config["source"].items() if k != "file"}
            return msgspec.structs.replace(e, config=config, engine_version="")
        return e

    return all(
        ev.encode(neutral(a)) == ev.encode(neutral(b)) for a, b in zip(stored, events, strict=True)
    )


def import_file(journal: Journal, path: str | Path, *, again: bool = False) -> list[ImportedRun]:
    """`car import FILE`: every trace of the file as a run (nothing written if it is malformed);
    a trace the journal holds already is named, not imported again, unless `again`."""
    return import_traces(journal, read_traces(path), again=again)
