"""OTLP/JSON attribute values (`AnyValue`) to and from plain Python values.

OTLP/JSON is the protobuf JSON mapping with two twists that matter here: trace and span ids are
hex strings (not base64), and 64-bit integers travel as decimal strings."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

AttrValue = str | bool | int | float | list[Any]


def any_value(value: AttrValue) -> dict[str, Any]:
    """One OTLP `AnyValue` for a str, bool, int, float or a list of them."""
    if isinstance(value, bool):  # bool before int: bool is an int subclass
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
    if isinstance(value, list):
        return {"arrayValue": {"values": [any_value(v) for v in value]}}
    return {"stringValue": str(value)}


def key_values(attrs: Mapping[str, AttrValue | None]) -> list[dict[str, Any]]:
    """OTLP `KeyValue` list, in the given order; None values are left out."""
    return [{"key": k, "value": any_value(v)} for k, v in attrs.items() if v is not None]


def from_any_value(value: Any) -> Any:
    """A plain Python value from an OTLP `AnyValue` (unknown shapes become None)."""
    if not isinstance(value, dict):
        return None
    if "stringValue" in value:
        return str(value["stringValue"])
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "intValue" in value:
        return int(value["intValue"])
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "arrayValue" in value:
        return [from_any_value(v) for v in (value["arrayValue"] or {}).get("values", [])]
    if "kvlistValue" in value:
        return attributes((value["kvlistValue"] or {}).get("values", []))
    if "bytesValue" in value:
        return base64.b64decode(value["bytesValue"]).hex()
    return None


def attributes(kvs: Any) -> dict[str, Any]:
    """A flat dict from an OTLP `KeyValue` list (later duplicates win, as in the SDK)."""
    out: dict[str, Any] = {}
    if not isinstance(kvs, list):
        return out
    for kv in kvs:
        if isinstance(kv, dict) and isinstance(kv.get("key"), str):
            try:
                out[kv["key"]] = from_any_value(kv.get("value"))
            except (ValueError, TypeError, OverflowError) as e:  # binascii.Error is a ValueError
                raise ValueError(f"attribute {kv['key']!r}: {e}") from e
    return out
