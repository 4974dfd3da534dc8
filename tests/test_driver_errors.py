"""What the database driver raises never leaves the journal as itself: a write the file refuses
(read-only, full) is one JournalError naming the journal and the driver's first line, chained
to the driver's error; a cell whose bytes were retyped or garbled is one TamperedJournal naming
the run, seq and cell and pointing at `car verify`, which reports it too. Through the CLI each
is one line on stderr and exit 1, never a traceback."""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from journal_helpers import car

from engine import events as ev
from engine.errors import ConcurrencyError, JournalError, TamperedJournal, UnknownRun
from engine.journal import Journal


def _say(step: int, text: str = "the vault opens at midnight") -> list[ev.Event]:
    return [ev.ChatMessage(step=step, agent="planner", text=text)]


@pytest.fixture
def small(tmp_path: Path) -> Iterator[tuple[Journal, str, int]]:
    """An open journal holding one run with one step: (journal, run, head)."""
    with Journal(tmp_path / "j.db") as j:
        run = j.create_run("s")
        head = j.append(run, _say(0), 0)
        yield j, run, head


# ------------------------------------------------------------------ refused writes (engine)

WRITES = {
    "create_run": lambda j, run, head: j.create_run("s"),
    "fork": lambda j, run, head: j.fork(run, 1),
    "append": lambda j, run, head: j.append(run, _say(1), head),
    "append_unseqd": lambda j, run, head: j.append(run, _say(1)),
    "acquire_lease": lambda j, run, head: j.acquire_lease(run),
}


@pytest.mark.parametrize("write", sorted(WRITES))
def test_a_read_only_journal_refuses_a_write_in_one_journal_error(
    small: tuple[Journal, str, int], write: str
) -> None:
    """With the connection read-only (`PRAGMA query_only`, which gives SQLite's own
    SQLITE_READONLY, as a file without write permission does), every public write is one
    JournalError naming the journal and the driver's reason, chained to sqlite3's error;
    nothing is written, and once writable again the same write succeeds."""
    j, run, head = small
    j._conn.execute("PRAGMA query_only=1")
    with pytest.raises(JournalError, match=r"'.*j\.db'.*attempt to write a readonly database") as e:
        WRITES[write](j, run, head)
    assert "\n" not in str(e.value)
    assert isinstance(e.value.__cause__, sqlite3.Error)
    assert [r.run_id for r in j.runs()] == [run] and j.head(run) == head
    j._conn.execute("PRAGMA query_only=0")
    WRITES[write](j, run, head)
    assert j.verify().ok


def test_a_full_disk_is_one_journal_error_and_nothing_written(
    small: tuple[Journal, str, int],
) -> None:
    """A database that cannot grow (`PRAGMA max_page_count` at its size: SQLite's real
    SQLITE_FULL) refuses a large step with one JournalError naming the journal and "database
    or disk is full"; the run is unchanged and takes the step once there is room."""
    j, run, head = small
    (pages,) = j._conn.execute("PRAGMA page_count").fetchone()
    j._conn.execute(f"PRAGMA max_page_count={pages}")
    big = _say(1, os.urandom(300_000).hex())
    with pytest.raises(JournalError, match=r"'.*j\.db'.* failed: database or disk is full") as e:
        j.append(run, big, head)
    assert isinstance(e.value.__cause__, sqlite3.OperationalError)
    assert j.head(run) == head
    j._conn.execute("PRAGMA max_page_count=1073741823")
    assert j.append(run, big, head) == head + 1
    assert j.verify().ok


def test_the_specific_mappings_still_win(small: tuple[Journal, str, int]) -> None:
    """A lost race is still ConcurrencyError and an unknown run UnknownRun (both inside the
    write transaction), not the generic JournalError."""
    j, run, _head = small
    with pytest.raises(ConcurrencyError, match="already written"):
        j.append(run, _say(0), 0)
    with pytest.raises(UnknownRun, match="nope"):
        j.append("nope", _say(0), 0)


def test_a_read_the_database_refuses_is_one_journal_error(tmp_path: Path) -> None:
    """A read the database cannot answer (a table dropped under the journal) is one
    JournalError naming the journal and the driver's first line, chained."""
    path = tmp_path / "j.db"
    with Journal(path) as j:
        run = j.create_run("s")
        j.append(run, _say(0), 0)
        db = sqlite3.connect(path)
        for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'"):
            db.execute(f"DROP TRIGGER {name}")
        db.execute("DROP TABLE leases")
        db.commit()
        db.close()
        with pytest.raises(JournalError, match=r"cannot read journal '.*j\.db': no such table"):
            j.lease(run)


# ------------------------------------------------------------------- read-only file (CLI)


@contextlib.contextmanager
def _read_only(path: Path) -> Iterator[bool]:
    """Make the file read-only for real: chmod 444 for a user, `chattr +i` for root (whom
    permissions do not stop). Yields False where neither works here."""
    if os.geteuid() != 0:
        path.chmod(0o444)
        try:
            yield True
        finally:
            path.chmod(0o644)
        return
    if shutil.which("chattr") is None:
        yield False
        return
    done = subprocess.run(["chattr", "+i", str(path)], capture_output=True)
    try:
        yield done.returncode == 0
    finally:
        if done.returncode == 0:
            subprocess.run(["chattr", "-i", str(path)], check=True)


@pytest.fixture(scope="module")
def heist(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A journal with one recorded heist: (path, run)."""
    path = tmp_path_factory.mktemp("heist") / "j.db"
    res = car(path, "heist", "-q")
    assert res.returncode == 0, res.stderr
    with Journal(path, readonly=True) as j:
        return path, j.runs()[0].run_id


def test_every_writing_command_on_a_read_only_file_is_one_line(
    heist: tuple[Path, str], tmp_path: Path
) -> None:
    """On a journal file the process may not write, heist, fork, import, detect -m causal,
    detect-eval and accuse each end with one line naming the journal (exit 1), no traceback;
    reading commands still work."""
    path = tmp_path / "ro.db"
    shutil.copy(heist[0], path)
    run = heist[1]
    trace = tmp_path / "t.json"
    trace.write_text(
        '{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "' + "ab" * 16 + '",'
        ' "spanId": "' + "01" * 8 + '", "name": "chat", "startTimeUnixNano": "1",'
        ' "endTimeUnixNano": "2", "attributes": [{"key": "gen_ai.operation.name",'
        ' "value": {"stringValue": "chat"}}]}]}]}]}'
    )
    with _read_only(path) as ok:
        if not ok:
            pytest.skip("neither chmod nor chattr makes a file read-only on this machine")
        for args in (
            ["heist", "-q"],
            ["fork", run, "-k", "2", "-n", "1", "--do", "resample"],
            ["import", str(trace)],
            ["detect", run, "-m", "causal"],
            ["detect-eval", "-n", "1"],
            ["accuse", run, "planner"],
        ):
            res = car(path, *args)
            assert res.returncode == 1, (args, res.stdout, res.stderr)
            assert "Traceback" not in res.stderr, (args, res.stderr)
            lines = res.stderr.strip().splitlines()
            assert len(lines) == 1, (args, res.stderr)
            assert "ro.db" in lines[0] and "readonly database" in lines[0], (args, lines)
        res = car(path, "runs")
        assert res.returncode == 0 and run in res.stdout, res.stderr


# -------------------------------------------------------------- retyped and garbled cells

_ROW = "(SELECT min(id) + 5 FROM events)"
TAMPERINGS = {
    # what was done to the file, and what `car verify` says of it
    "texts.body as text": (
        "UPDATE texts SET body = CAST(body AS TEXT) WHERE rowid = 1",
        "stored as text, not as bytes",
    ),
    "events.payload as text": (
        f"UPDATE events SET payload = CAST(payload AS TEXT) WHERE id = {_ROW}",
        "payload stored as text",
    ),
    "events.payload as UTF-8 text": (
        f"UPDATE events SET payload = 'plain words' WHERE id = {_ROW}",
        "payload stored as text",
    ),
    "events.hash as text": (
        f"UPDATE events SET hash = CAST(hash AS TEXT) WHERE id = {_ROW}",
        "hash cell is text",
    ),
    "events.step text": (
        f"UPDATE events SET step = 'abc' WHERE id = {_ROW}",
        "step cell is a text",
    ),
    "runs.created_at garbage": (
        "UPDATE runs SET created_at = 'garbage'",
        "created_at 'garbage' is not an ISO 8601 time",
    ),
}


def _tamper(path: Path, sql: str) -> None:
    """Apply `sql` as someone with write access would: the append-only triggers dropped
    around it and put back."""
    db = sqlite3.connect(path)
    triggers = db.execute("SELECT name, sql FROM sqlite_master WHERE type = 'trigger'").fetchall()
    for name, _ in triggers:
        db.execute(f"DROP TRIGGER {name}")
    assert db.execute(sql).rowcount >= 1
    for _, create in triggers:
        db.execute(create)
    db.commit()
    db.close()


@pytest.mark.parametrize("tampering", sorted(TAMPERINGS))
def test_a_retyped_cell_is_a_finding_and_one_line_in_every_reader(
    heist: tuple[Path, str], tmp_path: Path, tampering: str
) -> None:
    """`car verify` flags the cell (exit 1); show and export, which read it, fail with one
    TamperedJournal line pointing at `car verify` (exit 1), never a traceback (they once
    crashed with sqlite3's "Could not decode to UTF-8", a TypeError or a ValueError)."""
    sql, finding = TAMPERINGS[tampering]
    path = tmp_path / "j.db"
    shutil.copy(heist[0], path)
    run = heist[1]
    _tamper(path, sql)
    res = car(path, "verify")
    assert res.returncode == 1, res.stdout + res.stderr
    assert finding in res.stdout + res.stderr
    for args in (["show", run], ["export", run, "-o", str(tmp_path / "out.json")]):
        res = car(path, *args)
        assert res.returncode == 1, (args, res.stdout, res.stderr)
        assert "Traceback" not in res.stderr, (args, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and "(see `car verify`)" in lines[0], (args, res.stderr)


def test_a_retyped_payload_names_its_run_seq_and_cell(
    heist: tuple[Path, str], tmp_path: Path
) -> None:
    """The reader's error names the cell that is wrong: the run, the seq and the column,
    whether the text it holds is UTF-8 or not."""
    path = tmp_path / "j.db"
    shutil.copy(heist[0], path)
    run = heist[1]
    _tamper(path, TAMPERINGS["events.payload as text"][0])
    with Journal(path, readonly=True) as j:
        (seq,) = j.query("SELECT seq FROM events WHERE typeof(payload) != 'blob'")[0]
        with pytest.raises(
            TamperedJournal, match=rf"the payload cell of event {seq} of run '{run}' in"
        ):
            list(j.read(run))
