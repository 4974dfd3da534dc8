"""What several journal tests share: a run's stored rows read straight from the SQLite file,
a clock that does not move, and `car` on a journal as a user runs it."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# the events rows of a run by its public id (they carry its run_key, docs/decisions.md 41)
KEY_OF = "(SELECT run_key FROM runs WHERE run_id = ?)"


def stored_rows(path: Path, run: str) -> list[tuple[int, int, bytes]]:
    """(seq, version, payload as stored) of a run's own events, in seq order."""
    db = sqlite3.connect(path)
    try:
        return db.execute(
            f"SELECT seq, version, payload FROM events WHERE run_key = {KEY_OF} ORDER BY seq",
            (run,),
        ).fetchall()
    finally:
        db.close()


class StillClock:
    """Time that does not move: latencies are 0.0 and timestamps one value, so that a
    recorded heist's stored bytes are the same on every machine and in every run."""

    def now_iso(self) -> str:
        return "2026-12-01T00:00:00.000000+00:00"

    def monotonic(self) -> float:
        return 0.0


def car(journal: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`car --journal J ARGS` in a subprocess, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "cli", "--journal", str(journal), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
    )


def unjournalable_crew() -> Any:
    """A two-agent crew built without the loader (which refuses it) whose first role holds a
    lone surrogate: no journal event can hold its RunStarted."""
    from engine.heist.config import AgentSpec, HeistConfig

    return HeistConfig(
        agents=(
            AgentSpec(name="boss", role="\ud800x", goal="Plan", tools=("calculator",)),
            AgentSpec(name="eye", role="Lookout", goal="Watch", tools=("file_reader",)),
        ),
        source="crafted",
    )


def fresh_pg_database(pg_url: str, prefix: str) -> str:
    """The URL of a new, empty database named `prefix_<random>` on the test PostgreSQL
    server of `pg_url` (a journal of its own for one test)."""
    import uuid

    import psycopg
    from sqlalchemy.engine import make_url

    url = make_url(pg_url)
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = url.set(drivername="postgresql", database="postgres").render_as_string(False)
    with psycopg.connect(admin, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    return url.set(database=name).render_as_string(hide_password=False)


def run_count(path: Path) -> int:
    """How many runs the journal at `path` holds (a refused fork adds none, not even a
    half-written one)."""
    import sqlite3

    db = sqlite3.connect(path)
    try:
        (n,) = db.execute("SELECT COUNT(*) FROM runs").fetchone()
        return int(n)
    finally:
        db.close()
