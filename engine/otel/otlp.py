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
from engine.otel.attrs import attributes, integer

#: OTLP times are fixed64: nanoseconds since 1970, 0 to 2**64 - 1 (the year 2554, well within
#: what a datetime holds)
MAX_TIME_NS = 2**64 - 1


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
    where: str = ""  # "file: resourceSpans[r].scopeSpans[s].spans[n]", for errors


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
    """A time in nanoseconds: an integer as OTLP/JSON carries one (`attrs.integer`) from 0 to
    MAX_TIME_NS."""
    n = integer(value)
    if n is None or not 0 <= n <= MAX_TIME_NS:
        shown = value if not isinstance(value, str) or len(value) <= 40 else value[:40] + "..."
        raise TraceImportError(
            f"{where}: expected an integer time in nanoseconds since 1970 (0 to 2**64-1),"
            f" got {shown!r}"
        )
    return n


def _attributes(kvs: Any, where: str) -> dict[str, Any]:
    try:
        return attributes(kvs)
    except ValueError as e:
        raise TraceImportError(f"{where}: {e}") from None


_TOO_LONG = "{where} holds a number of more digits than an integer may have here (4300)"


def _documents(text: str, source: str) -> list[tuple[str, Any]]:
    """The JSON documents of a file: one document, or one per line (JSON Lines)."""
    try:
        return [(source, json.loads(text))]
    except RecursionError:
        raise TraceImportError(f"{source} nests JSON arrays or objects too deeply") from None
    except json.JSONDecodeError as whole:
        return _lines(text, source, whole)
    except ValueError:  # a bare number past the interpreter's digit limit
        raise TraceImportError(_TOO_LONG.format(where=source)) from None


def _lines(text: str, source: str, whole: json.JSONDecodeError) -> list[tuple[str, Any]]:
    """The documents of a JSON Lines file (`whole`: why the text is no single document)."""
    lines = [(i, line) for i, line in enumerate(text.splitlines(), 1) if line.strip()]
    if len(lines) <= 1:
        raise TraceImportError(
            f"{source} is not JSON: {whole.msg} at line {whole.lineno} column {whole.colno}"
        ) from None
    docs = []
    for i, line in lines:
        where = f"{source} line {i}"
        try:
            docs.append((where, json.loads(line)))
        except json.JSONDecodeError as e:
            raise TraceImportError(f"{where} is not JSON: {e.msg} at column {e.colno}") from None
        except RecursionError:
            raise TraceImportError(f"{where} nests JSON arrays or objects too deeply") from None
        except ValueError:
            raise TraceImportError(_TOO_LONG.format(where=where)) from None
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
            res = rs.get("resource") or {}
            if not isinstance(res, dict):
                raise TraceImportError(f"{where}: resourceSpans[{r}].resource is not an object")
            resource = _attributes(res.get("attributes"), f"{where}: resourceSpans[{r}].resource")
            service = resource.get("service.name")
            scopes = rs.get("scopeSpans", rs.get("instrumentationLibrarySpans", []))
            for s, ss in enumerate(scopes if isinstance(scopes, list) else []):
                raws = (ss if isinstance(ss, dict) else {}).get("spans") or []
                if not isinstance(raws, list):
                    raise TraceImportError(
                        f"{where}: resourceSpans[{r}].scopeSpans[{s}].spans is not a list"
                    )
                for n, raw in enumerate(raws):
                    at = f"{where}: resourceSpans[{r}].scopeSpans[{s}].spans[{n}]"
                    spans.append(_span(raw, at, service, len(spans)))
    return spans


def _span(raw: Any, at: str, service: Any, order: int) -> Span:
    if not isinstance(raw, dict):
        raise TraceImportError(f"{at} is not an object")
    parent = raw.get("parentSpanId") or None
    status = raw.get("status") or {}
    if not isinstance(status, dict):
        raise TraceImportError(f"{at}.status is not an object")
    code = status.get("code")
    error = None
    if code in (2, "STATUS_CODE_ERROR", "ERROR"):
        error = str(status.get("message") or "error")
    raw_events = raw.get("events") or []
    if not isinstance(raw_events, list):
        raise TraceImportError(f"{at}.events is not a list")
    events = [
        (str(e.get("name", "")), _attributes(e.get("attributes"), f"{at}.events[{i}]"))
        for i, e in enumerate(raw_events)
        if isinstance(e, dict)
    ]
    return Span(
        trace_id=_id(raw.get("traceId"), 16, f"{at}.traceId"),
        span_id=_id(raw.get("spanId"), 8, f"{at}.spanId"),
        parent_id=_id(parent, 8, f"{at}.parentSpanId") if parent else None,
        name=str(raw.get("name", "")),
        start=_int(raw.get("startTimeUnixNano", 0), f"{at}.startTimeUnixNano"),
        end=_int(raw.get("endTimeUnixNano", 0), f"{at}.endTimeUnixNano"),
        attrs=_attributes(raw.get("attributes"), at),
        events=events,
        error=error,
        service=str(service) if service is not None else None,
        order=order,
        where=at,
    )
