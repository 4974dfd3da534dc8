"""Every recorder of a process has its run's lease refreshed by one thread of that process,
until the run ends; a forked process (a branch worker) beats for its own recorders."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest

from engine import events as ev
from engine.journal import Journal
from engine.runtime import recorder as rec
from engine.state import State


def _lease_beat(j: Journal, run: str) -> float | None:
    lease = j.lease(run)
    return None if lease is None else lease.heartbeat


def _child(path: str, out: Connection) -> None:
    """Two recorders in a forked process: both beat; after one run ends, only the other."""
    ticks = iter(range(1, 1_000_000))
    with Journal(Path(path), wall=lambda: float(next(ticks))) as j:
        a, b = j.create_run("a"), j.create_run("b")
        ra = rec.Recorder(j, a, State(), 0)
        rb = rec.Recorder(j, b, State(), 0)
        start = (_lease_beat(j, a), _lease_beat(j, b))
        time.sleep(0.5)
        both = (_lease_beat(j, a), _lease_beat(j, b))
        ra.append([ev.RunEnded(status="completed")])
        ra.flush()
        after_end = _lease_beat(j, b)
        time.sleep(0.5)
        later = (_lease_beat(j, a), _lease_beat(j, b))
        threads = sum(1 for t in threading.enumerate() if t.name == "leases")
        out.send({"start": start, "both": both, "after_end": after_end, "later": later,
                  "threads": threads, "alive": rb is not None})  # fmt: skip


def test_one_thread_beats_every_open_recorder_of_a_forked_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a forked child (the parent may have a heartbeat thread of its own, which a fork does
    not copy), two open recorders get their leases refreshed by a single 'leases' thread; once
    one run has ended its lease is gone and only the other keeps beating."""
    monkeypatch.setattr(rec, "HEARTBEAT_EVERY", 0.05)
    path = tmp_path / "j.db"
    Journal(path).close()
    # a recorder in this process first, so that the child inherits a started heartbeat
    with Journal(path) as j:
        run = j.create_run("here")
        rec.Recorder(j, run, State(), 0)
    ctx = mp.get_context("fork")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(str(path), theirs))
    proc.start()
    got: dict[str, Any] = mine.recv() if mine.poll(30) else {}
    proc.join(10)
    assert proc.exitcode == 0, got
    (a0, b0), (a1, b1) = got["start"], got["both"]
    assert a0 is not None and b0 is not None
    assert a1 > a0 and b1 > b0  # both refreshed, by the wall clock the journal was given
    a2, b2 = got["later"]
    assert a2 is None  # the ended run released its lease and is not beaten back to life
    assert b2 > got["after_end"]
    assert got["threads"] == 1


_CLOSE_UNDER_BEATS = """
import os, sys, tempfile, threading, time
from engine.journal import Journal
d = tempfile.mkdtemp()
for i in range(40):
    j = Journal(os.path.join(d, f"j{i}.db"))
    run = j.create_run("s")
    stop = threading.Event()
    def beat():
        while not stop.is_set():
            try:
                j.heartbeat(run)
            except Exception:
                pass  # the journal is closed: what the heartbeat thread is told
    threads = [threading.Thread(target=beat) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.002)
    j.close()
    stop.set()
    for t in threads:
        t.join()
print("closed 40")
"""


def test_closing_a_journal_while_its_lease_is_beaten_never_crashes() -> None:
    """The heartbeat's thread may be inside a transaction when the journal is closed (a run's
    last command ending, a test's `with Journal`): closing the connection under it crashed
    the process with a segfault (seen once in a CI run). Two threads beat a lease as fast as
    they can while the journal closes, 40 times over, in a child process so that a crash
    fails this test rather than the suite: it must exit 0."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    res = subprocess.run(
        [sys.executable, "-c", _CLOSE_UNDER_BEATS],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, (res.returncode, res.stderr[-2000:])
    assert res.stdout.strip() == "closed 40"
