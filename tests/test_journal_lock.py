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
from engine.errors import JournalBusy, JournalError
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


def _append_while_held(
    j: Journal, path: Path, run: str, head: int, hold: float
) -> tuple[int, float]:
    """Append one step while another connection holds the write lock for `hold` seconds:
    the new head and the seconds the append took."""
    other = _hold_lock(path)
    release = threading.Timer(hold, lambda: other.execute("COMMIT"))
    release.start()
    t0 = time.perf_counter()
    head = j.append(run, _say(1), head)
    waited = time.perf_counter() - t0
    release.join()
    other.close()
    return head, waited


@pytest.mark.parametrize("parallel", [True, False])
def test_a_writer_waits_for_the_lock_then_appends(tmp_path: Path, parallel: bool) -> None:
    """The lock is held by another connection for 0.15 s: the append waits for it, then
    writes its step whole; the connection's busy timeout is what it was."""
    path = tmp_path / "j.db"
    with Journal(path) as j:
        run, head = _one_step(j, parallel)
        head, waited = _append_while_held(j, path, run, head, 0.15)
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


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("write", ["append", "create_run"])
def test_readers_read_on_while_a_writer_waits_for_another_process(
    tmp_path: Path, parallel: bool, write: str
) -> None:
    """Another process holds the database's write lock (a real one, in a process of its
    own); a thread of this journal waits for it to append. The journal's other threads (the
    server's requests) still read meanwhile: the wait lets the journal's thread lock go
    between tries (it held it for up to the 30 s busy timeout, and every read waited too)."""
    import subprocess
    import sys

    path = tmp_path / "j.db"
    with Journal(path) as j:
        run, head = _one_step(j, parallel)
        other = subprocess.Popen(
            [sys.executable, "-c",
             "import sqlite3, sys; c = sqlite3.connect(sys.argv[1], isolation_level=None);"
             " c.execute('BEGIN IMMEDIATE'); print('held', flush=True); sys.stdin.readline();"
             " c.execute('ROLLBACK')", str(path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert other.stdout is not None and other.stdin is not None
        assert other.stdout.readline() == "held\n"
        done: list[object] = []

        def writer() -> None:
            if write == "append":
                done.append(j.append(run, _say(1), head))
            else:
                done.append(j.create_run("test", label="second"))

        t = threading.Thread(target=writer)
        t.start()
        try:
            time.sleep(0.3)  # the writer is waiting for the other process by now
            t0 = time.monotonic()
            assert run in {r.run_id for r in j.runs()}
            assert [e.text for e in j.events(run)] == ["line 0"]  # type: ignore[attr-defined]
            assert j.status(run) == "recording"
            took = time.monotonic() - t0
            assert t.is_alive() and not done  # still waiting, and the reads were answered
            assert took < 2.0
        finally:
            other.stdin.write("\n")
            other.stdin.flush()
            other.wait(timeout=30)
        t.join(timeout=30)
        assert done and not t.is_alive()
        assert verify_journal(j).ok


def test_a_writer_follows_a_release_within_its_poll_interval(tmp_path: Path) -> None:
    """The wait polls every 50 us to 1 ms: a lock let go after 0.5 s is taken well before
    0.75 s (a first pause of a second, or pauses that keep doubling past 1 ms, come back
    late)."""
    path = tmp_path / "j.db"
    with Journal(path) as j:
        run, head = _one_step(j, False)
        _, waited = _append_while_held(j, path, run, head, 0.5)
        assert 0.49 <= waited < 0.75


def test_a_writer_that_gives_up_says_the_journal_is_busy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(journal_mod, "BUSY_TIMEOUT_S", 0.2)
    path = tmp_path / "j.db"
    with Journal(path) as j:
        run, head = _one_step(j, False)
        other = _hold_lock(path)
        try:
            with pytest.raises(JournalBusy) as e:
                j.append(run, _say(1), head)
        finally:
            other.execute("ROLLBACK")
            other.close()
        assert str(e.value) == f"cannot write to journal {str(path)!r}: database is locked"
        assert j.append(run, _say(1), head) == 2
