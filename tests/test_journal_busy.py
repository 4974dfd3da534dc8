"""A journal that another writer keeps locked past the wait allowed for it is JournalBusy (a
JournalError, so every `except JournalError` still holds): "try again later", told apart from
"broken". The server answers it with 503, a Retry-After header and the usual JSON error; the
CLI with its one `error:` line and exit 1. Nothing of the refused write is in the journal.

The lock is a real second `sqlite3` connection holding BEGIN IMMEDIATE on a real journal file
(a PostgreSQL journal: a second session holding a table lock). The journal's wait for the
SQLite write lock, `engine.journal.BUSY_TIMEOUT_S` (30 s), is a module constant with no setting
of its own: these tests patch it to a second or less (in this process by monkeypatch; in the
`car` subprocesses by setting it before `cli.main()` runs), so that a refusal takes a second
instead of half a minute.
"""

from __future__ import annotations

import contextlib
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
import server_helpers
from journal_helpers import ROOT, car, fresh_pg_database
from server_helpers import Server, car_serve, finished_heist, wait_status
from sqlalchemy.engine import make_url

from engine import events as ev
from engine import journal as journal_module
from engine.errors import JournalBusy, JournalError
from engine.journal import Journal

#: `car` with the journal's busy timeout cut to one second (see the module's docstring)
PATCHED_CAR = [
    sys.executable,
    "-c",
    "import engine.journal as j; j.BUSY_TIMEOUT_S = 1; import cli; cli.main()",
]


def _say(step: int) -> list[ev.Event]:
    return [ev.ChatMessage(step=step, agent="planner", text="the vault opens at midnight")]


@contextlib.contextmanager
def write_lock(path: Path) -> Iterator[sqlite3.Connection]:
    """Another process's long write transaction: a second connection to the file holding
    BEGIN IMMEDIATE (SQLite's write lock) until the block ends, then rolling back."""
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("BEGIN IMMEDIATE")
        yield db
        db.execute("ROLLBACK")
    finally:
        db.close()


def counts(path: Path) -> tuple[int, int, int, int]:
    """(runs, events, texts, leases) rows in the file, read by a connection of its own."""
    db = sqlite3.connect(path)
    try:
        return tuple(  # type: ignore[return-value]
            db.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
            for t in ("runs", "events", "texts", "leases")
        )
    finally:
        db.close()


# ------------------------------------------------------------------------------- engine


@pytest.mark.parametrize("parallel", [False, True], ids=["one-writer", "parallel-writers"])
def test_a_write_lock_held_too_long_is_journal_busy_and_nothing_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, parallel: bool
) -> None:
    """create_run, append and acquire_lease each wait for the lock as long as the journal
    allows, then raise JournalBusy (a JournalError) naming the journal and SQLite's "database
    is locked", chained to sqlite3's SQLITE_BUSY; nothing is written, and once the lock is
    free the same writes succeed. Also with `parallel_writers`, which polls for the lock."""
    monkeypatch.setattr(journal_module, "BUSY_TIMEOUT_S", 0.3)
    path = tmp_path / "j.db"
    with Journal(path) as j:
        j.parallel_writers = parallel
        run = j.create_run("s")
        head = j.append(run, _say(0), 0)
        before = counts(path)
        with write_lock(path):
            for write in (
                lambda: j.create_run("s"),
                lambda: j.append(run, _say(1), head),
                lambda: j.acquire_lease(run),
            ):
                started = time.monotonic()
                with pytest.raises(JournalBusy, match=r"'.*j\.db'.*database is locked") as e:
                    write()
                assert time.monotonic() - started >= 0.25  # it did wait for the lock
                assert isinstance(e.value, JournalError)
                cause = e.value.__cause__
                assert isinstance(cause, sqlite3.OperationalError)
                assert cause.sqlite_errorcode & 0xFF == sqlite3.SQLITE_BUSY
            # reads go on meanwhile (WAL)
            assert j.head(run) == head and [r.run_id for r in j.runs()] == [run]
        assert counts(path) == before
        assert j.append(run, _say(1), head) == head + 1
        j.create_run("s")
        assert j.verify().ok


def test_a_postgresql_lock_timeout_is_journal_busy(pg_url: str) -> None:
    """On PostgreSQL, a write that waits past `lock_timeout` for a table another session
    holds (SQLSTATE 55P03) is JournalBusy too, whether it was the run's insert or the events'
    (which the append maps itself); nothing is written."""
    target = make_url(fresh_pg_database(pg_url, "busy"))
    with Journal(target.render_as_string(hide_password=False)) as j:
        run = j.create_run("s")
        head = j.append(run, _say(0), 0)
        cur = j._conn.cursor()
        cur.execute("SET lock_timeout = '300ms'")
        cur.close()
        j._conn.commit()
        other = target.set(drivername="postgresql").render_as_string(hide_password=False)
        for table, write in (
            ("runs", lambda: j.create_run("s")),
            ("events", lambda: j.append(run, _say(1), head)),
        ):
            with psycopg.connect(other) as holder:
                holder.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
                with pytest.raises(JournalBusy, match="lock timeout") as e:
                    write()
                assert getattr(e.value.__cause__, "sqlstate", None) == "55P03"
                holder.rollback()
        assert [r.run_id for r in j.runs()] == [run] and j.head(run) == head
        assert j.append(run, _say(1), head) == head + 1


# ---------------------------------------------------------------------------------- CLI


def test_the_cli_says_one_line_and_exits_1_on_a_busy_journal(tmp_path: Path) -> None:
    """`car accuse` and `car heist` on a journal whose write lock another process holds: one
    `error:` line naming the journal and "database is locked", exit 1 (the JournalError
    status), no traceback, nothing written."""
    path = tmp_path / "j.db"
    res = car(path, "heist", "-q", "--seed", "7")
    assert res.returncode == 0, res.stderr
    with Journal(path, readonly=True) as j:
        run = j.runs()[0].run_id
    before = counts(path)
    with write_lock(path):
        for args in (["accuse", run, "planner"], ["heist", "-q"]):
            res = subprocess.run(
                [*PATCHED_CAR, "--journal", str(path), *args],
                capture_output=True,
                text=True,
                cwd=ROOT,
                timeout=120,
            )
            assert res.returncode == 1, (args, res.stdout, res.stderr)
            assert "Traceback" not in res.stderr, res.stderr
            lines = res.stderr.strip().splitlines()
            assert len(lines) == 1, (args, res.stderr)
            assert lines[0].startswith("error: ") and "database is locked" in lines[0], lines
            assert "j.db" in lines[0], lines
    assert counts(path) == before


# ------------------------------------------------------------------------------- server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`car serve` with the busy timeout patched to one second (see the module's docstring),
    started as tests/server_helpers.py starts it."""
    journal = tmp_path_factory.mktemp("busy") / "journal.db"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(server_helpers, "CAR", PATCHED_CAR)
        with car_serve(journal, "--sim-step-delay", "0") as s:
            yield s


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[httpx.Client]:
    with server.client(timeout=60) as c:
        yield c


def _assert_busy(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text
    retry = r.headers.get("Retry-After")
    assert retry is not None and retry.isdigit() and 1 <= int(retry) <= 60, retry
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}, body
    assert "database is locked" in body["error"] and "\n" not in body["error"], body


def test_a_quick_start_on_a_busy_journal_is_503_with_retry_after(
    server: Server, client: httpx.Client
) -> None:
    """POST /api/sessions while another process holds the journal's write lock: 503, a
    Retry-After in seconds and the JSON error naming the lock, not a generic 500; no run,
    event, text or lease was written. Reads are answered meanwhile, and once the lock is
    free the same request starts the heist."""
    before = counts(server.journal)
    with write_lock(server.journal):
        r = client.post("/api/sessions", json={"step_delay": 0, "rounds": 1})
        _assert_busy(r)
        assert client.get("/api/health").status_code == 200
    assert counts(server.journal) == before
    assert client.get("/api/sessions").json()["total"] == before[0]
    r = client.post("/api/sessions", json={"step_delay": 0, "rounds": 1})
    assert r.status_code == 202, r.text
    wait_status(client, r.json()["session_id"], {"completed"})


def test_an_accusation_on_a_busy_journal_is_503_not_409(
    server: Server, client: httpx.Client
) -> None:
    """POST /accuse, whose route answers the engine's errors with 409, answers a busy journal
    with 503 and Retry-After: the run's state did not refuse anything. The run is unchanged,
    and the same accusation succeeds once the lock is free."""
    sid = finished_heist(client)
    with Journal(server.journal, readonly=True) as j:
        head = j.head(sid)
    with write_lock(server.journal):
        _assert_busy(client.post(f"/api/sessions/{sid}/accuse", json={"suspect": "intel"}))
    with Journal(server.journal, readonly=True) as j:
        assert j.head(sid) == head and j.verify(sid).ok
    r = client.post(f"/api/sessions/{sid}/accuse", json={"suspect": "intel"})
    assert r.status_code == 200, r.text
    assert r.json()["verdict"] in ("SUCCESS", "FAILURE")
