"""Helpers the benchmark scripts share: timing, SQLite files, progress, the result table.

The scripts are run as `.venv/bin/python bench/bench_x.py`; Python puts bench/ first on
sys.path then, so they import this module as `common`. Importing it also makes `engine`
importable from a checkout without the package installed, so a script imports it before
anything from `engine`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

try:
    import engine  # noqa: F401
except ModuleNotFoundError:  # run from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

#: One table row: measure, value, target, verdict ("PASS", "MISS" or "").
Row = tuple[str, str, str, str]

#: The files of one SQLite database in WAL mode, as suffixes of the main file's path.
DB_SUFFIXES = ("", "-wal", "-shm")


# ------------------------------------------------------------------ timing


def ms(seconds: float) -> float:
    return seconds * 1000.0


def us(seconds: float) -> float:
    return seconds * 1e6


def median_time(fn: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _cpu_work() -> None:
    """Pure-Python work of the kind a branch does (dicts, strings), ~0.3-0.6 s."""
    d: dict[int, str] = {}
    for i in range(2_000_000):
        d[i & 1023] = str(i)


def _timed_work(_: int) -> float:
    t0 = time.perf_counter()
    _cpu_work()
    return time.perf_counter() - t0


def two_process_throughput(reps: int = 3) -> float:
    """How much more pure-Python work this machine does with two processes at once than with
    one: 2 x (one process alone) / (two at once), median of `reps` alternating rounds. 2.0 on
    two free cores; less when the two "cores" share a physical one or a busy host. The floor a
    -c 2 speed-up is to be read against."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    ratios = []
    with ctx.Pool(2) as pool:
        for _ in range(reps):
            one = pool.apply(_timed_work, (0,))
            t0 = time.perf_counter()
            pool.map(_timed_work, [0, 1], chunksize=1)
            two = time.perf_counter() - t0
            ratios.append(2 * one / two)
    return statistics.median(ratios)


def settle() -> None:
    """Flush dirty pages of earlier runs so their write-back does not land in a timed run."""
    if hasattr(os, "sync"):
        os.sync()


# ------------------------------------------------------------------ files


def remove_db(path: Path) -> None:
    for suffix in DB_SUFFIXES:
        Path(str(path) + suffix).unlink(missing_ok=True)


@contextmanager
def work_dir(prefix: str, parent: str | None) -> Iterator[Path]:
    """A temporary directory (under `parent`, if given), removed with all it holds at the end."""
    work = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ------------------------------------------------------------------ machine


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def environment(**extra: Any) -> dict[str, Any]:
    """The machine a result came from: python, sqlite and cpus, then `extra` in order."""
    return {
        "python": sys.version.split()[0],
        "sqlite": sqlite3.sqlite_version,
        "cpus": os.cpu_count(),
        **extra,
    }


# ------------------------------------------------------------------ command line and report


def add_output_options(p: argparse.ArgumentParser) -> None:
    """--json and --dir, which every table-printing benchmark takes."""
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")
    p.add_argument("--dir", default=None, help="parent of the temporary directory")


def say(quiet: bool, msg: str) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def print_rows(rows: Sequence[Row]) -> None:
    """The rows under a "measure / value / target" header, each column as wide as it needs."""
    w = [max(len(row[i]) for row in rows) for i in range(4)]
    header = ("measure", "value", "target", "")
    print(f"{header[0]:<{w[0]}}  {header[1]:>{w[1]}}  {header[2]}")
    print("-" * (sum(w) + 8))
    for row in rows:
        print(f"{row[0]:<{w[0]}}  {row[1]:>{w[1]}}  {row[2]:<{w[2]}}  {row[3]}".rstrip())


def print_footer(env: dict[str, Any], note: str) -> None:
    """After a blank line: the machine (load average and wall time where recorded), then `note`."""
    line = f"python {env['python']}, sqlite {env['sqlite']}, {env['cpus']} cpus"
    if "loadavg_start" in env:
        line += f", load average {env['loadavg_start']} -> {env['loadavg_end']}"
    if "wall_s" in env:
        line += f", {env['wall_s']:.0f} s"
    print(f"\n{line}; {note}")


def emit(res: dict[str, Any], as_json: bool, table: Callable[[dict[str, Any]], None]) -> None:
    """The result as indented JSON, or as the benchmark's table."""
    if as_json:
        print(json.dumps(res, indent=2))
    else:
        table(res)
