"""OTLP/JSON attribute values (`AnyValue`) to and from plain Python values, and `integer`, the
one reading of an integer in an OTLP/JSON file (span times, `intValue`, token counts, seeds).

OTLP/JSON is the protobuf JSON mapping with two twists that matter here: trace and span ids are
hex strings (not base64), and 64-bit integers travel as decimal strings."""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Mapping
from typing import Any

AttrValue = str | bool | int | float | list[Any]

_DECIMAL = re.compile(r"[+-]?[0-9]+")
#: Python's default limit on the digits int() reads from text: a longer string is no integer
#: here, whatever limit the interpreter is set to (OTLP's widest integer has 20 digits)
_MAX_DIGITS = 4300


def integer(value: Any) -> int | None:
    """An integer as OTLP/JSON carries one, else None.

    An integer is a JSON integer (not a bool), a finite JSON number without a fraction (7.0;
    1e3, which JSON cannot tell from 1000.0) or a string of ASCII decimal digits with an
    optional sign, surrounding whitespace ignored ("7", " -7"), as OTLP/JSON writes 64-bit
    integers. Not one: a fraction (1.5), NaN, an infinity, a string with a fraction or an
    exponent ("1.5", "7.0", "1e3"), underscores or non-ASCII digits, text, a string of more than
    4300 digits, any other value. Callers check the range and say what they expected."""
    if isinstance(value, bool):  # bool before int: bool is an int subclass
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if math.isfinite(value) and value.is_integer() else None
    if isinstance(value, str):
        text = value.strip()
        if len(text) > _MAX_DIGITS + 1 or not _DECIMAL.fullmatch(text):
            return None
        try:
            return int(text)
        except ValueError:  # past a limit set lower than the default
            return None
    return None


def shown(value: Any) -> str:
    """A value as an error message quotes it: its repr, cut at 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."


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
        flag = value["boolValue"]
        if isinstance(flag, bool):
            return flag
        if flag in ("true", "false"):  # as some writers quote it
            return flag == "true"
        raise ValueError(f"boolValue is not true or false: {shown(flag)}")
    if "intValue" in value:
        n = integer(value["intValue"])
        if n is None:
            raise ValueError(f"intValue is not an integer: {shown(value['intValue'])}")
        return n
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "arrayValue" in value:
        return [from_any_value(v) for v in _values(value, "arrayValue")]
    if "kvlistValue" in value:
        return attributes(_values(value, "kvlistValue"))
    if "bytesValue" in value:
        return base64.b64decode(value["bytesValue"]).hex()
    return None


def _values(value: dict[str, Any], kind: str) -> list[Any]:
    """The `values` list of an arrayValue or kvlistValue (absent or null: none); ValueError
    naming the kind when either is not what OTLP/JSON writes (an object holding a list)."""
    inner = value[kind]
    if inner is None:
        return []
    if not isinstance(inner, dict):
        raise ValueError(f"{kind} is not an object: {shown(inner)}")
    values = inner.get("values")
    if values is None:
        return []
    if not isinstance(values, list):
        raise ValueError(f"{kind}.values is not a list: {shown(values)}")
    return values


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
