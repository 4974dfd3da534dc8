"""A writer among others on one SQLite file (a pool's worker, or the command beside its
workers: `Journal.parallel_writers`) polls for the write lock instead of sleeping in SQLite's
busy handler, and still gives up at the same deadline. Real locks: a second connection to the
same file holds the write lock while the journal appends."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import pytest

from engine import events as ev
from engine import journal as journal_mod
from engine.errors import JournalError
from engine.journal import Journal
from engine.verify import verify_journal


def _say(step: int) -> list[ev.Event]:
    return [ev.ChatMessage(step=step, agent="a", text=f"line {step}")]


def _hold_lock(path: Path) -> sqlite3.Connection:
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")
    return other


def _one_step(j: Journal, parallel: bool) -> tuple[str, int]:
    """A run of one step in `j`, whose writer is `parallel` or not: (run, head)."""
    j.parallel_writers = parallel
    run = j.create_run("test")
    return run, j.append(run, _say(0), 0)


def _busy_timeout(j: Journal) -> int:
    return int(j._conn.execute("PRAGMA busy_timeout").fetchone()[0])


@pytest.mark.parametrize("parallel", [True, False])
def test_a_writer_waits_for_the_lock_then_appends(tmp_path: Path, parallel: bool) -> None:
    """The lock is held by another connection for 0.15 s: the append waits for it, then
    writes its step whole; the connection's busy timeout is what it was."""
    path = tmp_path / "j.db"
    with Journal(path) as j:
        run, head = _one_step(j, parallel)
        other = _hold_lock(path)
        release = threading.Timer(0.15, lambda: other.execute("COMMIT"))
        release.start()
        t0 = time.perf_counter()
        head = j.append(run, _say(1), head)
        waited = time.perf_counter() - t0
        release.join()
        other.close()
        assert head == 2 and waited >= 0.14
        assert [e.text for e in j.events(run)] == ["line 0", "line 1"]  # type: ignore[attr-defined]
        assert _busy_timeout(j) == journal_mod.BUSY_TIMEOUT_S * 1000
        assert verify_journal(j).ok


def test_a_parallel_writer_gives_up_at_the_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lock never released: the parallel writer fails once BUSY_TIMEOUT_S is over (not
    before, not never), nothing of its step is written, and it appends again afterwards."""
    monkeypatch.setattr(journal_mod, "BUSY_TIMEOUT_S", 0.3)
    path = tmp_path / "j.db"
    with Journal(path) as j:
        run, head = _one_step(j, True)
        other = _hold_lock(path)
        t0 = time.perf_counter()
        with pytest.raises(JournalError, match="database is locked") as e:
            j.append(run, _say(1), head)
        assert isinstance(e.value.__cause__, sqlite3.OperationalError)
        waited = time.perf_counter() - t0
        other.execute("ROLLBACK")
        other.close()
        assert 0.29 <= waited < 2.0
        assert j.head(run) == 1
        assert _busy_timeout(j) == 300
        assert j.append(run, _say(1), head) == 2
        assert verify_journal(j).ok
