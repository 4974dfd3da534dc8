"""The engine's version as installed (journaled in RunStarted, shown by `car --version`)."""

from __future__ import annotations

import functools


@functools.cache
def engine_version() -> str:
    # importlib.metadata costs ~8 ms: only commands that record or print the version pay it
    from importlib import metadata

    try:
        return metadata.version("causal-agent-replay")
    except metadata.PackageNotFoundError:
        return "0+unknown"
