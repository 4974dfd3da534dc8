"""The journal's smaller promises, each pinned where a changed line would otherwise go
unnoticed: a run's status from its last events, writer leases and abandoned runs, the error
classification of the database's messages, redaction, and the branch-aware reads."""

from __future__ import annotations

import os
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from engine import events as ev
from engine import journal as jm
from engine.errors import JournalError
from engine.journal import Journal, Lease


def chat(step: int, text: str = "x") -> ev.ChatMessage:
    return ev.ChatMessage(step=step, agent="a", text=text)


@pytest.fixture
def j(tmp_path: Path) -> Journal:
    journal = Journal(tmp_path / "j.db")
    yield journal
    journal.close()


ACCUSE = ev.SuspicionDeclared(suspect="a", verdict="SUCCESS", mole="a", strategy="S")


@pytest.mark.parametrize(
    "tail,status",
    [
        ([], "recording"),
        ([chat(0)], "recording"),
        ([chat(0), ev.Control(action="pause")], "paused"),
        ([ev.Control(action="pause"), chat(0)], "recording"),  # the pause was not the last word
        ([ev.Control(action="pause"), ev.Control(action="resume")], "recording"),
        ([ev.Control(action="stop")], "recording"),
        ([chat(0), ev.RunEnded(status="completed")], "completed"),
        ([ev.RunEnded(status="failed"), ACCUSE], "failed"),  # an accusation after the end
        ([ev.RunEnded(status="stopped"), ACCUSE, ACCUSE], "stopped"),
        ([ev.Control(action="pause"), ACCUSE], "paused"),
        ([ev.RunEnded(status="completed"), ACCUSE, ACCUSE, ACCUSE], "recording"),  # 3 back only
    ],
)
def test_status_from_the_last_events(j: Journal, tail: list[ev.Event], status: str) -> None:
    """status(): RunEnded's status (looking past up to two accusations), paused after a
    pause, else recording while this process holds the lease. The tails past one accusation
    are journals the append rule refuses (decision 49), written before it or forged: written
    here with the rule off, as the reader must still read them."""
    run = j.create_run("s")
    if tail:
        with mock.patch.object(jm, "after_end", lambda _r, _e, state, _s: state):
            j.append(run, tail, 0)
    assert j.status(run) == status


def test_status_of_a_branch_reads_through_the_parent(j: Journal) -> None:
    """A branch with no events of its own has the status its history ends with."""
    run = j.create_run("s")
    j.append(run, [chat(0), ev.Control(action="pause"), chat(1)], 0)
    child = j.fork(run, 2)
    assert j.status(child) == "paused"
    assert j.events(child) == [chat(0), ev.Control(action="pause")]
    assert j.events(child, 1) == [chat(0)]
    assert j.last_event(child) is not None and j.last_event(child).seq == 1  # type: ignore[union-attr]
    assert [c.run_id for c in j.children(run)] == [child]
    assert j.children(child) == []
    empty = j.create_run("s")
    assert j.last_event(empty) is None


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _plant_lease(path: Path, run: str, lease: Lease) -> None:
    con = sqlite3.connect(path)
    con.execute("DELETE FROM leases WHERE run_id = ?", (run,))
    con.execute(
        "INSERT INTO leases (run_id, pid, host, boot_id, proc_start, heartbeat)"
        " VALUES (?, ?, ?, ?, ?, ?)",
        (run, lease.pid, lease.host, lease.boot_id, lease.proc_start, lease.heartbeat),
    )
    con.commit()
    con.close()


def test_lease_is_this_process_and_heartbeats(tmp_path: Path) -> None:
    """A new run's lease names this process (pid, host, boot, start time); heartbeat moves its
    time forward; a finished run keeps no lease."""
    clock = iter([100.0, 250.0, 400.0])
    with Journal(tmp_path / "j.db", wall=lambda: next(clock)) as j:
        run = j.create_run("s")
        lease = j.lease(run)
        assert lease is not None
        assert (lease.pid, lease.host) == (os.getpid(), socket.gethostname())
        assert lease.boot_id == jm._boot_id() and lease.proc_start == jm._proc_start(os.getpid())
        assert lease.proc_start != "" and lease.heartbeat == 100.0
        j.heartbeat(run)
        assert j.lease(run).heartbeat == 250.0  # type: ignore[union-attr]
        assert not j.writer_gone(j.lease(run))  # type: ignore[arg-type]
        assert j.status(run) == "recording"


def test_a_forked_child_leases_as_itself(tmp_path: Path) -> None:
    """The lease identity is cached per process: a child forked after the parent asked
    (as a pool's workers are) writes its own pid and start time, not the parent's."""
    parent = jm._this_process()
    assert parent.pid == os.getpid()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: create a run, report its lease, leave at once
        code = 1
        try:
            with Journal(tmp_path / "j.db") as j:
                lease = j.lease(j.create_run("s"))
            assert lease is not None
            os.write(w, f"{lease.pid} {lease.proc_start} {os.getpid()}".encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    got = os.read(r, 200).decode().split()
    os.close(r)
    child_start = jm._proc_start(pid)  # a zombie until reaped: its /proc entry is there
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert got[0] == got[2] == str(pid) and got[1] == child_start != parent.proc_start
    assert jm._this_process() == parent


def test_abandoned_run_is_found_and_closed(tmp_path: Path) -> None:
    """A run whose writer process is gone reads `abandoned`; close_abandoned appends stop and
    RunEnded(stopped) naming the writer, after which the run is stopped."""
    path = tmp_path / "j.db"
    with Journal(path) as j:
        run = j.create_run("s")
        j.append(run, [chat(0)], 0)
        with pytest.raises(JournalError, match=r"is recording, not abandoned"):
            j.close_abandoned(run)
    me = jm._this_process()
    pid = _dead_pid()
    _plant_lease(path, run, Lease(pid, me.host, me.boot_id, "1", 0.0))
    with Journal(path) as j:
        assert j.status(run) == "abandoned"
        why = j.close_abandoned(run)
        assert why == f"abandoned: writer pid {pid} on {me.host} gone"
        assert j.events(run)[-2:] == [
            ev.Control(action="stop", reason=why),
            ev.RunEnded(status="stopped", error=why),
        ]
        assert j.status(run) == "stopped"


def test_writer_gone_rules() -> None:
    """Same host: gone when the boot changed, or no process has that pid and start time; a
    live process with the same pid but another start time is a reused pid. Another host: gone
    only when the heartbeat is older than LEASE_TTL."""
    me = jm._this_process()
    now = 10_000.0
    with_clock = Journal.__new__(Journal)
    with_clock._wall = lambda: now  # type: ignore[method-assign]
    alive = Lease(me.pid, me.host, me.boot_id, me.proc_start, 0.0)
    assert not with_clock.writer_gone(alive)
    assert with_clock.writer_gone(Lease(me.pid, me.host, "another-boot", me.proc_start, 0.0))
    assert not with_clock.writer_gone(Lease(me.pid, me.host, "", me.proc_start, 0.0))
    assert with_clock.writer_gone(Lease(me.pid, me.host, me.boot_id, "1", 0.0))  # reused pid
    assert with_clock.writer_gone(Lease(_dead_pid(), me.host, me.boot_id, "", 0.0))
    other = "not-" + me.host
    assert not with_clock.writer_gone(Lease(1, other, "b", "s", now - jm.LEASE_TTL))
    assert with_clock.writer_gone(Lease(1, other, "b", "s", now - jm.LEASE_TTL - 0.5))


def test_process_alive() -> None:
    """This process is alive with its start time or without one; a dead pid is not; pid 1
    (another owner's, when not root) counts as alive."""
    me = os.getpid()
    assert jm._process_alive(me, jm._proc_start(me))
    assert jm._process_alive(me, "")
    assert not jm._process_alive(me, "1")
    assert not jm._process_alive(_dead_pid(), "")
    assert jm._process_alive(1, jm._proc_start(1))


def test_proc_start_reads_field_22_of_stat() -> None:
    """The start time is field 22 of /proc/PID/stat (20th after the command's ')')."""
    stat = Path(f"/proc/{os.getpid()}/stat").read_text()
    assert jm._proc_start(os.getpid()) == stat.rsplit(")", 1)[1].split()[19]
    assert jm._proc_start(_dead_pid()) == ""


@pytest.mark.parametrize(
    "url,shown",
    [
        ("postgresql+psycopg://car:s3cret@db:5432/j", "postgresql+psycopg://car:***@db:5432/j"),
        ("postgresql://car:a:b@db/j", "postgresql://car:***@db/j"),
        ("postgresql://car@db/j", "postgresql://car:***@db/j"),
        ("postgresql://u:p@ss@db/j", "postgresql://u:***@db/j"),
        ("sqlite:///tmp/a@b.db", "sqlite:///tmp/a@b.db"),
        ("sqlite:////data/team@x/j.db", "sqlite:////data/team@x/j.db"),
        ("postgresql://db/j", "postgresql://db/j"),
        ("user@host", "user@host"),
    ],
    ids=[
        "password",
        "colon-in-password",
        "user-only",
        "at-in-password",
        "sqlite-path-with-at",
        "sqlite-absolute-path-with-at",
        "no-user",
        "no-url",
    ],
)
def test_redact(url: str, shown: str) -> None:
    """A URL's password never shows; the user, host and path do; no URL, no change."""
    assert jm.redacted_url(url) == shown


def test_first_line_and_violation_classes() -> None:
    """Errors are reported by their first line (the wrapped driver error's, if any); unique
    and foreign-key violations are recognised from SQLite's and PostgreSQL's messages and
    PostgreSQL's SQLSTATE, and nothing else is taken for one."""

    class Wrapped(Exception):
        orig = ValueError("  inner first\nsecond  ")

    class State(Exception):
        def __init__(self, code: str) -> None:
            super().__init__("x")
            self.sqlstate = code

    assert jm._first_line(Wrapped("outer")) == "inner first"
    assert jm._first_line(ValueError("a\nb")) == "a"
    assert jm._first_line(ValueError("  ")) == "ValueError"
    unique = [
        sqlite3.IntegrityError("UNIQUE constraint failed: events.run_id, events.seq"),
        Exception('duplicate key value violates unique constraint "events_pkey"'),
        Exception("Duplicate key value"),
        Exception("journal events are append-only: row already exists, rewrite refused"),
        State("23505"),
    ]
    assert [jm._is_unique_violation(e) for e in unique] == [True] * 5
    assert not jm._is_unique_violation(Exception("FOREIGN KEY constraint failed"))
    assert not jm._is_unique_violation(State("23503"))
    assert jm._is_fk_violation(sqlite3.IntegrityError("FOREIGN KEY constraint failed"))
    assert jm._is_fk_violation(State("23503"))
    assert not jm._is_fk_violation(State("23505"))
    assert not jm._is_fk_violation(Exception("UNIQUE constraint failed"))


def test_append_to_an_unknown_run_is_refused(j: Journal) -> None:
    """Appending to a run id that has no row fails naming the id."""
    from engine.errors import UnknownRun

    with pytest.raises(UnknownRun, match=r"unknown run id 'nope'"):
        j.append("nope", [chat(0)], 0)
    with pytest.raises(UnknownRun, match=r"unknown run id 'nope'"):
        j.append("nope", [chat(0)], 3)


def test_runs_in_creation_order(tmp_path: Path) -> None:
    """runs() lists every run oldest first (by creation time, then id)."""
    stamps = iter(["2026-01-02", "2026-01-01", "2026-01-01"])
    ids = iter(["b", "c", "a"])
    with Journal(tmp_path / "j.db", clock=lambda: next(stamps), ids=lambda: next(ids)) as j:
        for _ in range(3):
            j.create_run("s")
        assert [r.run_id for r in j.runs()] == ["a", "c", "b"]
        assert [r.created_at for r in j.runs()] == ["2026-01-01", "2026-01-01", "2026-01-02"]


def test_nearest_snapshot_follows_the_lineage(j: Journal) -> None:
    """The nearest snapshot at or below seq, from the run's own segment or its parents' —
    never one of the parent's snapshots past the fork point, never one at the fork point of a
    later segment (it belongs to the branch's history only if taken in the parent)."""
    run = j.create_run("s")
    j.append(run, [chat(i) for i in range(10)], 0)
    for seq in (3, 6, 9):
        j.put_snapshot(run, seq, 1, f"p{seq}".encode())
    child = j.fork(run, 5)
    j.append(child, [chat(i, "b") for i in range(5, 10)], 5)
    j.put_snapshot(child, 8, 1, b"c8")
    assert j.nearest_snapshot(run, 9, 1) == (9, b"p9")
    assert j.nearest_snapshot(run, 8, 1) == (6, b"p6")
    assert j.nearest_snapshot(run, 2, 1) is None
    assert j.nearest_snapshot(run, 9, 2) is None  # another fold version
    assert j.nearest_snapshot(child, 9, 1) == (8, b"c8")
    assert j.nearest_snapshot(child, 7, 1) == (3, b"p3")  # the parent's 6 is past the fork
    assert j.nearest_snapshot(child, 5, 1) == (3, b"p3")
    assert j.nearest_snapshot(child, 3, 1) == (3, b"p3")
    grandchild = j.fork(child, 9)
    assert j.nearest_snapshot(grandchild, 9, 1) == (8, b"c8")
    j.put_snapshot(child, 5, 1, b"c5")  # stored under the parent: seq 5 is still shared
    assert j.nearest_snapshot(child, 5, 1) == (5, b"c5")


def test_step_start_stays_inside_the_branch_history(j: Journal) -> None:
    """step_start finds the first event of a step >= k in the run's own history: a branch
    forked before step 3 does not see the parent's step 3, until it records its own."""
    run = j.create_run("s")
    j.append(run, [chat(k) for k in range(6)], 0)
    assert j.step_start(run, 3) == 3
    assert j.step_start(run, 9) is None
    child = j.fork(run, 3)
    assert j.step_start(child, 2) == 2
    assert j.step_start(child, 3) is None
    j.append(child, [chat(4, "b")], 3)
    assert j.step_start(child, 3) == 3
    assert j.last_stepped(child) == (4, 3)
    one = j.create_run("s")
    j.append(one, [chat(0)], 0)
    assert j.last_event(one) is not None and j.last_event(one).event == chat(0)  # type: ignore[union-attr]


def test_checkpoint_truncates_the_wal(tmp_path: Path) -> None:
    """checkpoint() folds the write-ahead log into the file and truncates it; on a read-only
    journal it does nothing (and does not fail)."""
    path = tmp_path / "j.db"
    with Journal(path) as j:
        run = j.create_run("s")
        j.append(run, [chat(k) for k in range(50)], 0)
        wal = Path(str(path) + "-wal")
        assert wal.stat().st_size > 0
        with Journal(path, readonly=True) as ro:
            ro.checkpoint()
        assert wal.stat().st_size > 0
        j.checkpoint()
        assert wal.stat().st_size == 0
