"""Crash safety, schema ownership and bad-input handling of the journal (SQLite)."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine

from engine.errors import NotAJournal, SchemaTooNew
from engine.journal import Journal
from engine.tables import metadata

WRITER = textwrap.dedent(
    """
    import sys
    from engine import events as ev
    from engine.journal import Journal
    j = Journal(sys.argv[1])
    run = j.create_run("crash")
    head = j.append(run, [ev.RunStarted(scenario="crash", config={}, agents=["a"],
        policy={}, root_seed=0, engine_version="t", started_at="t")], 0)
    print(run, flush=True)
    k = 0
    while True:
        head = j.append(run, [ev.ChatMessage(step=k, agent="a", text="x" * 2000) for _ in range(3)],
                        head)
        k += 1
    """
)


# the events rows of a run by its public id (they carry its run_key, docs/decisions.md 38)
KEY_OF = "(SELECT run_key FROM runs WHERE run_id = ?)"


@pytest.mark.parametrize("delay", [0.3, 0.7, 1.1])
def test_killed_writer_leaves_whole_steps(tmp_path: Path, delay: float) -> None:
    """SIGKILL at an arbitrary moment: every step is fully present or absent, the chain intact."""
    path = tmp_path / "j.db"
    Journal(path).close()
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert proc.stdout is not None
    run = proc.stdout.readline().strip()
    time.sleep(delay)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    db = sqlite3.connect(path)
    counts = db.execute("SELECT step, count(*) FROM events WHERE step IS NOT NULL GROUP BY step")
    per_step = dict(counts.fetchall())
    assert per_step, "the writer committed nothing before it was killed"
    assert set(per_step.values()) == {3}
    assert sorted(per_step) == list(range(len(per_step)))
    with Journal(path) as j:
        assert j.verify(run).ok


def test_models_and_migrations_agree(tmp_path: Path) -> None:
    """Upgrading an empty database yields exactly the schema the SQLModel tables describe."""
    Journal(tmp_path / "j.db").close()
    eng = create_engine(f"sqlite:///{tmp_path / 'j.db'}")
    with eng.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), metadata)
    assert diff == []


def test_not_a_journal_random_bytes(tmp_path: Path) -> None:
    """A file of random bytes is refused as not a journal, and left untouched."""
    p = tmp_path / "junk.db"
    data = os.urandom(4096)
    p.write_bytes(data)
    with pytest.raises(NotAJournal, match="is not a journal"):
        Journal(p)
    assert p.read_bytes() == data


def test_not_a_journal_foreign_sqlite(tmp_path: Path) -> None:
    """Another application's SQLite database is refused, not migrated."""
    p = tmp_path / "other.db"
    sqlite3.connect(p).execute("CREATE TABLE customers (id INTEGER)")
    with pytest.raises(NotAJournal, match="customers"):
        Journal(p)


def test_newer_schema_refused(tmp_path: Path) -> None:
    """A journal at a schema revision this engine does not know is refused, not downgraded."""
    p = tmp_path / "j.db"
    Journal(p).close()
    db = sqlite3.connect(p)
    db.execute("UPDATE alembic_version SET version_num = '0099_from_the_future'")
    db.commit()
    with pytest.raises(SchemaTooNew, match="0099_from_the_future"):
        Journal(p)


def car(*args: str, journal: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli", "--journal", str(journal), *args],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )


@pytest.mark.parametrize(
    ("setup", "args", "message"),
    [
        ("empty", ("show", "nope"), "unknown run id 'nope'"),
        ("junk", ("runs",), "is not a journal"),
        ("future", ("runs",), "written by a newer causal-agent-replay"),
        ("missing", ("runs",), "no journal at"),
        ("tampered", ("verify",), "journal tampered: run"),
        ("empty", ("state", "nope", "--at", "1"), "unknown run id"),
    ],
)
def test_cli_bad_input_one_line(
    tmp_path: Path, setup: str, args: tuple[str, ...], message: str
) -> None:
    """Each bad input gives one clean error line on stderr and a non-zero exit."""
    p = tmp_path / "j.db"
    if setup == "junk":
        p.write_bytes(b"not a database at all" * 100)
    elif setup in ("empty", "future", "tampered"):
        with Journal(p) as j:
            if setup == "tampered":
                from test_journal_contract import record

                run = record(j, 2)
    if setup == "future":
        db = sqlite3.connect(p)
        db.execute("UPDATE alembic_version SET version_num = 'zz_future'")
        db.commit()
    if setup == "tampered":
        db = sqlite3.connect(p)
        db.execute("DROP TRIGGER events_no_update")
        db.execute(
            f"UPDATE events SET payload = x'00' WHERE seq = 2 AND run_key = {KEY_OF}", (run,)
        )
        db.commit()
    res = car(*args, journal=p)
    assert res.returncode != 0
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert message in lines[0]
    assert "Traceback" not in res.stderr
