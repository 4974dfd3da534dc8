"""Reading OTLP/JSON: documents (one, or JSON Lines of them) into spans with plain attributes.

Ids may be hex (OTLP/JSON) or base64 (protobuf's JSON mapping); both become lowercase hex.
Everything malformed is a TraceImportError that says what is wrong and where
(`file line N: resourceSpans[r].scopeSpans[s].spans[n].traceId: ...`)."""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

import msgspec

from engine.errors import EngineError
from engine.otel.attrs import attributes


class TraceImportError(EngineError):
    """A file is not a readable OTLP/JSON trace of an LLM program."""


class Span(msgspec.Struct, frozen=True):
    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    start: int
    end: int
    attrs: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    error: str | None  # status message when the span's status is ERROR
    service: str | None
    order: int  # position in the file: a tie-break for equal start times


def _id(value: Any, size: int, where: str) -> str:
    """A trace/span id as lowercase hex: OTLP/JSON's hex, or base64 from protobuf's mapping."""
    if not isinstance(value, str) or not value:
        raise TraceImportError(f"{where}: expected a {size}-byte id, got {value!r}")
    text = value.strip()
    if len(text) == 2 * size:
        try:
            bytes.fromhex(text)
            return text.lower()
        except ValueError:
            pass
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != size:
        raise TraceImportError(f"{where}: expected a {size}-byte id (hex), got {value!r}")
    return raw.hex()


def _int(value: Any, where: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise TraceImportError(f"{where}: expected an integer time, got {value!r}") from None


def _documents(text: str, source: str) -> list[tuple[str, Any]]:
    """The JSON documents of a file: one document, or one per line (JSON Lines)."""
    try:
        return [(source, json.loads(text))]
    except json.JSONDecodeError as whole:
        lines = [(i, line) for i, line in enumerate(text.splitlines(), 1) if line.strip()]
        if len(lines) <= 1:
            raise TraceImportError(
                f"{source} is not JSON: {whole.msg} at line {whole.lineno} column {whole.colno}"
            ) from None
        docs = []
        for i, line in lines:
            try:
                docs.append((f"{source} line {i}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise TraceImportError(
                    f"{source} line {i} is not JSON: {e.msg} at column {e.colno}"
                ) from None
        return docs


def parse_spans(text: str, source: str = "trace") -> list[Span]:
    """Every span of an OTLP/JSON file, with attributes flattened to plain values."""
    spans: list[Span] = []
    for where, doc in _documents(text, source):
        if not isinstance(doc, dict) or not isinstance(doc.get("resourceSpans"), list):
            got = type(doc).__name__ if not isinstance(doc, dict) else sorted(doc)[:5]
            raise TraceImportError(
                f"{where} is not an OTLP/JSON trace: expected an object with 'resourceSpans', "
                f"got {got!r}"
            )
        for r, rs in enumerate(doc["resourceSpans"]):
            if not isinstance(rs, dict):
                raise TraceImportError(f"{where}: resourceSpans[{r}] is not an object")
            resource = attributes((rs.get("resource") or {}).get("attributes"))
            service = resource.get("service.name")
            scopes = rs.get("scopeSpans", rs.get("instrumentationLibrarySpans", []))
            for s, ss in enumerate(scopes if isinstance(scopes, list) else []):
                for n, raw in enumerate((ss or {}).get("spans") or []):
                    at = f"{where}: resourceSpans[{r}].scopeSpans[{s}].spans[{n}]"
                    spans.append(_span(raw, at, service, len(spans)))
    return spans


def _span(raw: Any, at: str, service: Any, order: int) -> Span:
    if not isinstance(raw, dict):
        raise TraceImportError(f"{at} is not an object")
    parent = raw.get("parentSpanId") or None
    status = raw.get("status") or {}
    code = status.get("code")
    error = None
    if code in (2, "STATUS_CODE_ERROR", "ERROR"):
        error = str(status.get("message") or "error")
    events = [
        (str(e.get("name", "")), attributes(e.get("attributes")))
        for e in raw.get("events") or []
        if isinstance(e, dict)
    ]
    return Span(
        trace_id=_id(raw.get("traceId"), 16, f"{at}.traceId"),
        span_id=_id(raw.get("spanId"), 8, f"{at}.spanId"),
        parent_id=_id(parent, 8, f"{at}.parentSpanId") if parent else None,
        name=str(raw.get("name", "")),
        start=_int(raw.get("startTimeUnixNano", 0), f"{at}.startTimeUnixNano"),
        end=_int(raw.get("endTimeUnixNano", 0), f"{at}.endTimeUnixNano"),
        attrs=attributes(raw.get("attributes")),
        events=events,
        error=error,
        service=str(service) if service is not None else None,
        order=order,
    )
