"""The integer-keyed row layout (revision 0005, docs/decisions.md entry 38): runs carry an
INTEGER run_key, events are one WITHOUT ROWID B-tree keyed by (run_key, seq) with the kind as a
code and the chain hash as its 32 raw bytes. Older journals upgrade to it with every hash, read
and `car verify` answer unchanged; one that cannot be copied whole is refused and left as it
was; a journal written in the layout (tests/fixtures/journal_v5.db) reads to pinned answers.
The same on PostgreSQL, upgraded from revision 0004."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import sqlite3
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import msgspec
import psycopg
import pytest
from sqlalchemy.engine import make_url

from engine import events as ev
from engine.errors import ConcurrencyError, TamperedJournal
from engine.journal import (
    HEAD_REVISION,
    KIND_CODES,
    KIND_NAMES,
    SPAN,
    Journal,
    chain_hash,
)
from engine.verify import verify_journal

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
OLD_FIXTURES = {
    "v2": ("journal_v2.db", "0001_journal_tables"),
    "v3": ("journal_v3.db", "0003_texts"),
    "v4": ("journal_v4.db", "0004_event_refs"),
}


def _car(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli", *args], capture_output=True, text=True, cwd=ROOT, timeout=120
    )


def _summary(j: Journal) -> dict[str, Any]:
    """Per run: head, last chain hash, a digest of the canonical payloads, schema versions."""
    out: dict[str, Any] = {}
    for info in j.runs():
        events = list(j.read(info.run_id))
        out[info.run_id] = {
            "head": len(events),
            "last_hash": events[-1].hash if events else "",
            "payloads_b2": hashlib.blake2b(
                b"".join(s.payload for s in events), digest_size=16
            ).hexdigest(),
            "versions": sorted({s.version for s in events}),
        }
    return out


def _every_row(j: Journal) -> list[tuple[str, int, int | None, str, int, str]]:
    return [
        (s.run_id, s.seq, s.step, s.kind, s.version, s.hash)
        for info in j.runs()
        for s in j.read(info.run_id)
    ]


def _event_kinds() -> set[str]:
    found: set[str] = set()
    todo = list(ev.Event.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        tag = cls.__struct_config__.tag
        if isinstance(tag, str):
            found.add(tag)
    return found


def test_every_event_kind_has_the_migrations_code() -> None:
    """Each event kind the engine can write has a code, and the codes are exactly the ones
    revision 0005 wrote into `kinds` (a kind without a code could not be appended)."""
    spec = importlib.util.spec_from_file_location(
        "rev0005", ROOT / "migrations" / "versions" / "0005_integer_rows.py"
    )
    assert spec is not None and spec.loader is not None
    rev = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rev)
    assert dict((name, code) for code, name in rev.KINDS) == KIND_CODES
    assert _event_kinds() == set(KIND_CODES)
    assert {KIND_CODES[n]: n for n in KIND_CODES} == KIND_NAMES


def test_new_journal_stores_integer_keyed_rows(tmp_path: Path) -> None:
    """A new journal's events are one B-tree (the rowid is run_key * 2**32 + seq) with no other
    index; the cells are integers and 32-byte digests, read back as the "b2:<hex>" chain hash
    that chain_hash gives; a second row at the same (run, seq) is refused by the database, and
    so is a row whose key disagrees with its run_key and seq."""
    path = tmp_path / "j.db"
    with Journal(path) as j:
        run = j.create_run("s")
        j.append(run, [ev.Control(action="pause", reason="x")], 0)
        stored = next(j.read(run))
        key = j.run_key(run)
    db = sqlite3.connect(path)
    (sql,) = db.execute("SELECT sql FROM sqlite_master WHERE name = 'events'").fetchone()
    assert "id INTEGER NOT NULL PRIMARY KEY" in sql and "WITHOUT ROWID" not in sql
    assert (
        db.execute(
            "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'events'"
        ).fetchall()
        == []
    )
    row = db.execute(
        "SELECT typeof(run_key), typeof(kind), kind, typeof(hash), length(hash), hash, id"
        " FROM events"
    ).fetchone()
    assert row[6] == key * SPAN
    assert row[:5] == ("integer", "integer", KIND_CODES["control"], "blob", 32)
    want = chain_hash("", 0, "control", stored.version, stored.payload)
    assert stored.hash == want == "b2:" + bytes(row[5]).hex()
    assert db.execute("SELECT name FROM kinds WHERE code = ?", (row[2],)).fetchone() == ("control",)
    with pytest.raises(sqlite3.DatabaseError, match="refused"):
        db.execute(
            "INSERT INTO events (run_key, seq, step, kind, version, payload, hash)"
            " VALUES (?, 0, NULL, 1, 4, x'00', x'00')",
            (key,),
        )
    with pytest.raises(sqlite3.IntegrityError, match="CHECK"):
        db.execute(
            "INSERT INTO events (id, run_key, seq, step, kind, version, payload, hash)"
            " VALUES (?, ?, 1, NULL, 1, 4, x'00', x'00')",
            (key * SPAN + 7, key),
        )
    db.close()
    with Journal(path) as j, pytest.raises(ConcurrencyError):
        j.append(run, [ev.Control(action="stop", reason="x")], 0)


@pytest.mark.parametrize("name", sorted(OLD_FIXTURES))
def test_old_fixture_upgrades_with_every_answer_unchanged(tmp_path: Path, name: str) -> None:
    """A v2, v3 and v4 journal read as it is and after the upgrade to revision 0005: the same
    rows (kind, step, version, chain hash), payloads and `car verify --json` output; the
    upgraded file holds only the new layout and keeps refusing rewrites."""
    file, revision = OLD_FIXTURES[name]
    path = tmp_path / file
    shutil.copy(FIXTURES / file, path)
    with Journal(path, readonly=True) as j:
        assert j.revision == revision and not j.keyed
        rows, summary = _every_row(j), _summary(j)
    before = _car("--journal", str(path), "verify", "--json")
    assert before.returncode == 0, before.stderr
    with Journal(path) as j:
        assert j.revision == HEAD_REVISION and j.keyed
        assert _every_row(j) == rows and _summary(j) == summary
        assert verify_journal(j).ok
    after = _car("--journal", str(path), "verify", "--json")
    assert after.returncode == 0, after.stderr
    old, new = json.loads(before.stdout), json.loads(after.stdout)
    # the one note a revision-0001 journal gets (REPLACE not refused) goes with the upgrade
    assert new.pop("notes") == [] and {**old, "notes": []} == {**new, "notes": []}
    db = sqlite3.connect(path)
    assert {r[0] for r in db.execute("SELECT DISTINCT typeof(hash) FROM events")} == {"blob"}
    with pytest.raises(sqlite3.DatabaseError, match="refused"):
        db.execute("DELETE FROM events")
    with pytest.raises(sqlite3.DatabaseError, match="refused"):
        db.execute("UPDATE runs SET label = 'x'")
    db.close()


def test_damaged_old_journal_is_refused_whole(tmp_path: Path) -> None:
    """A v3 journal holding an event whose run has no row cannot be copied into the keyed
    layout: opening it for writing is refused with one line naming the event, and it stays
    at its revision, readable as before (read-only commands still work); `car db upgrade`
    says so on one line without a traceback."""
    path = tmp_path / "v3.db"
    shutil.copy(FIXTURES / "journal_v3.db", path)
    db = sqlite3.connect(path, isolation_level=None)
    for (trig,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'").fetchall():
        db.execute(f"DROP TRIGGER {trig}")
    db.execute(
        "INSERT INTO events SELECT 'ghost', seq, step, kind, version, payload, hash FROM events"
        " WHERE seq = 0 LIMIT 1"
    )
    db.close()
    with pytest.raises(TamperedJournal, match=r"cannot upgrade.*'ghost', which has no row"):
        Journal(path)
    with Journal(path, readonly=True) as j:
        assert j.revision == "0003_texts"
        assert len(j.runs()) == 3
    assert _car("--journal", str(path), "runs").returncode == 0
    res = _car("--journal", str(path), "db", "upgrade")
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "cannot upgrade" in res.stderr


# fixture -> (revision it was written at, run 0's last chain hash, literally)
KEYED_FIXTURES = {
    "v5": (
        "0005_integer_rows",
        "b2:3e8c006363b08475fdf77bbeabe0df18658861aac9f92abd154111fb385bd782",
    ),
    "v6": (
        "0006_positional_events",
        "b2:00c2f42405246a585e2e73a02e30905446bede4c21a16d40e259debc55a967da",
    ),
    "v7": (
        "0007_packed_rows",
        "b2:8fcf585d50cc4d049b1449968fe192e291efaa12970bb25112268746e37fa844",
    ),
}
# fixture -> the event schema its rows were written with
KEYED_SCHEMAS = {"v5": 4, "v6": 5, "v7": 6}


@pytest.mark.parametrize("readonly", [True, False], ids=["read-only", "opened-for-writing"])
@pytest.mark.parametrize("name", sorted(KEYED_FIXTURES))
def test_keyed_fixture_known_answers(tmp_path: Path, name: str, readonly: bool) -> None:
    """tests/fixtures/journal_v5.db (the keyed layout, event schema 4), journal_v6.db
    (revision 0006, schema 5: positional payloads) and journal_v7.db (revision 0007, schema 6:
    packed rows and texts), written by make_fixture_v5.py, read back
    to their pinned chain heads and payload digests, and `car verify` and `car state` print
    what they printed when they were made."""
    revision, last_hash = KEYED_FIXTURES[name]
    expected = json.loads((FIXTURES / f"journal_{name}.expected.json").read_text())
    path = tmp_path / f"{name}.db"
    shutil.copy(FIXTURES / f"journal_{name}.db", path)
    with Journal(path, readonly=readonly) as j:
        # opened for writing it is upgraded to the head (no table change since 0005)
        assert j.revision == (revision if readonly else HEAD_REVISION)
        assert _summary(j) == expected["runs"]
        assert verify_journal(j).ok
    # the literal, so a change of both the fixture and the expected file shows in review
    assert expected["runs"][f"{name}run0000000"]["last_hash"] == last_hash
    schema = KEYED_SCHEMAS[name]
    assert all(r["versions"] == [schema] for r in expected["runs"].values())
    res = _car("--journal", str(path), "verify", "--json")
    assert res.returncode == 0 and json.loads(res.stdout) == expected["verify"]
    res = _car(
        "--journal", str(path), "state", f"{name}run0000000", "--at", "3", "--json", "--reveal"
    )
    assert res.returncode == 0 and json.loads(res.stdout) == expected["state_at3"]


def _plain(url: Any) -> str:
    return str(url.set(drivername="postgresql").render_as_string(hide_password=False))


def test_postgres_upgrade_from_0004_keeps_answers(pg_url: str) -> None:
    """A PostgreSQL journal at revision 0004 holding the v4 fixture's rows upgrades to 0005:
    the same chain heads and payloads, verify clean, the hash stored as 32 bytes, and the
    append-only triggers (TRUNCATE included) refusing on the new events table."""
    from alembic import command
    from alembic.config import Config
    from sqlalchemy import create_engine

    url = make_url(pg_url)
    name = "rows_" + uuid.uuid4().hex[:12]
    admin = _plain(url.set(database="postgres"))
    with psycopg.connect(admin, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')  # type: ignore[arg-type]
    target = url.set(database=name).render_as_string(hide_password=False)
    dsn = _plain(make_url(target))
    try:
        eng = create_engine(target)
        with eng.begin() as conn:
            cfg = Config()
            cfg.set_main_option("script_location", str(ROOT / "migrations"))
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "0004_event_refs")
        eng.dispose()
        src = sqlite3.connect(FIXTURES / "journal_v4.db")
        with psycopg.connect(dsn) as c:
            for table in ("runs", "events", "texts"):
                rows = src.execute(f"SELECT * FROM {table}").fetchall()
                if rows:
                    marks = ", ".join(["%s"] * len(rows[0]))
                    with c.cursor() as cur:
                        cur.executemany(
                            f"INSERT INTO {table} VALUES ({marks})",  # type: ignore[arg-type]
                            rows,
                        )
        src.close()
        expected = json.loads((FIXTURES / "journal_v4.expected.json").read_text())
        with Journal(target, readonly=True) as j:
            assert j.revision == "0004_event_refs" and _summary(j) == expected
        with Journal(target) as j:
            assert j.revision == HEAD_REVISION and j.keyed
            assert _summary(j) == expected
            assert verify_journal(j).ok
        with psycopg.connect(dsn, autocommit=True) as c:
            lengths = c.execute("SELECT DISTINCT octet_length(hash) FROM events").fetchall()
            assert lengths == [(32,)]
            for sql in ("DELETE FROM events", "TRUNCATE events CASCADE", "DELETE FROM kinds"):
                with pytest.raises(psycopg.Error, match="refused"):
                    c.execute(sql)  # type: ignore[arg-type]
    finally:
        with psycopg.connect(admin, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')  # type: ignore[arg-type]


def test_payload_cells_are_what_the_reader_resolves(tmp_path: Path) -> None:
    """The rows hold the stored (compacted) payload and the reader rebuilds the canonical
    bytes the chain covers: the stored form decodes as msgpack, the read one as the event."""
    path = tmp_path / "j.db"
    shutil.copy(FIXTURES / "journal_v5.db", path)
    with Journal(path, readonly=True) as j:
        read = {s.seq: s for s in j.read("v5run0000000")}
        key = j.run_key("v5run0000000")
    db = sqlite3.connect(path)
    for seq, kind, stored in db.execute(
        "SELECT seq, kind, payload FROM events WHERE id >= ? AND id < ? ORDER BY id",
        (key * SPAN, (key + 1) * SPAN),
    ):
        msgspec.msgpack.decode(stored, type=Any)
        assert KIND_NAMES[kind] == read[seq].kind == ev.kind_of(read[seq].event)
    db.close()
