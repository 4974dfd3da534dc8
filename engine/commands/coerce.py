"""Command-line values converted without importing pydantic for the plain cases.

Typer (0.2x) converts every parameter through a pydantic TypeAdapter, and importing pydantic
and building the adapters is ~0.15-0.2 s of a short command's start-up, most of `car state`.
`install()` gives typer a runtime parameter that converts the plain values itself - a `str`,
a `bool`, an `int` or a `float` written in plain decimal form, inside the parameter's min/max - and
hands every other value (another type, another spelling, a value out of range) to the adapter
typer would have built, built on first use. What it accepts it converts to exactly what the
adapter returns (`tests/test_cli_start.py` checks that against pydantic itself); everything
else, every error message included, is typer's own.

Any other parameter (a list, a path, a choice) gets typer's runtime parameter, built when a
value is first converted. A typer without this hook (an older release converts through click,
not pydantic) is left as it is: `install()` then changes nothing.
"""

from __future__ import annotations

import re
from typing import Any

_INT = re.compile(r"-?[0-9]{1,18}")
_FLOAT = re.compile(r"-?[0-9]{1,15}(?:\.[0-9]{1,15})?")
_MISSING = object()


def plain_value(annotation: Any, parameter_info: Any, value: Any) -> Any:
    """The converted value, or _MISSING when the value is not plain (the adapter decides)."""
    if annotation is str:
        return value if type(value) is str else _MISSING
    if annotation is bool:
        return value if type(value) is bool else _MISSING
    if annotation is int:
        if type(value) is str and _INT.fullmatch(value):
            number: Any = int(value)
        elif type(value) is int:
            number = value
        else:
            return _MISSING
    elif annotation is float:
        if type(value) is str and _FLOAT.fullmatch(value):
            number = float(value)
        elif type(value) is float:
            number = value
        else:
            return _MISSING
    else:
        return _MISSING
    if getattr(parameter_info, "clamp", False):
        return _MISSING
    low = getattr(parameter_info, "min", None)
    high = getattr(parameter_info, "max", None)
    if (low is not None and number < low) or (high is not None and number > high):
        return _MISSING  # out of range: the adapter says so in its own words
    return number


def install() -> bool:
    """Hook the plain conversions into typer; False (and nothing changed) when this typer has
    no such place to hook into."""
    try:
        from typer import _coercion, core
    except ImportError:  # pragma: no cover - a typer without the pydantic layer
        return False
    found = getattr(core, "build_runtime_param", None)
    base = getattr(_coercion, "RuntimeParam", None)
    if found is None or base is None:
        return False
    if getattr(found, "_car_plain", False):
        return True  # installed already
    original: Any = found
    if not (hasattr(base, "_coerce_value") and hasattr(base, "coerce")):
        return False  # pragma: no cover - another shape of typer's runtime parameters

    class PlainFirst(base):  # type: ignore[misc, valid-type]
        """Plain values here; the rest through the runtime parameter typer builds, built on
        first use (a list or path option costs nothing while it is not given). `coerce`, which
        maps a missing value to None or () before any conversion, is typer's own."""

        def __init__(self, descriptor: Any) -> None:
            # typer's RuntimeParam is a frozen dataclass: set the fields as it would
            object.__setattr__(self, "parameter_info", descriptor.parameter_info)
            object.__setattr__(self, "annotation", descriptor.annotation)
            object.__setattr__(self, "_descriptor", descriptor)
            object.__setattr__(self, "_full", None)

        def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
            plain = plain_value(self.annotation, self.parameter_info, value)
            if plain is not _MISSING:
                return plain
            if self._full is None:
                object.__setattr__(self, "_full", original(self._descriptor))
            return self._full._coerce_value(value, param=param, ctx=ctx)

    def build(descriptor: Any) -> Any:
        if descriptor.file_annotation is not None:
            return original(descriptor)  # opens files: typer's own, which needs no pydantic
        return PlainFirst(descriptor)

    build._car_plain = True  # type: ignore[attr-defined]
    core.build_runtime_param = build
    return True
