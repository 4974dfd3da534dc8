"""Injected time. Engine code never calls datetime.now() or time.perf_counter() inline, so tests
freeze time (freezegun) and replays can run under the recorded clock."""

from __future__ import annotations

import datetime as dt
import time
from typing import Protocol


class Clock(Protocol):
    def now_iso(self) -> str: ...

    def monotonic(self) -> float: ...


class SystemClock:
    """Wall-clock time (UTC) and a monotonic timer for latencies."""

    def now_iso(self) -> str:
        return dt.datetime.now(dt.UTC).isoformat(timespec="microseconds")

    def monotonic(self) -> float:
        return time.perf_counter()
