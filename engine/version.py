"""The engine's version as installed (journaled in RunStarted, shown by `car --version`)."""

from __future__ import annotations

import functools
from importlib import metadata


@functools.cache
def engine_version() -> str:
    try:
        return metadata.version("causal-agent-replay")
    except metadata.PackageNotFoundError:
        return "0+unknown"
