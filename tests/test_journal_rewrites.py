"""The database refuses every rewrite of history, statement by statement, on SQLite and
PostgreSQL — whatever client sends it and whatever pragmas that client set."""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import make_url
from test_journal_contract import _plain, record

from engine.journal import Journal
from engine.state import FOLD_VERSION, encode_state, state_at_seq

# Each statement tries to change or remove a row that exists: run R, its events, a snapshot,
# an event kind. `{r}` is the run id, `{k}` its run_key (the events rows' key, entry 38).
SQLITE_REWRITES = [
    "UPDATE events SET payload = x'00' WHERE run_key = {k} AND seq = 1",
    "UPDATE events SET step = 99",
    "DELETE FROM events WHERE run_key = {k} AND seq = 3",
    "DELETE FROM events",
    "REPLACE INTO events (run_key, seq, step, kind, version, payload, hash)"
    " SELECT run_key, seq, 99, kind, version, payload, hash FROM events WHERE seq = 1",
    "INSERT OR REPLACE INTO events (run_key, seq, step, kind, version, payload, hash)"
    " VALUES ({k}, 1, 0, 6, 2, x'00', x'00')",
    "INSERT INTO events (id, run_key, seq, step, kind, version, payload, hash)"
    " VALUES ({k} * 4294967296 + 1, {k}, 1, 0, 6, 2, x'00', x'00')"
    " ON CONFLICT (id) DO UPDATE SET payload = excluded.payload",
    # the key given outright, as the journal writes it
    "INSERT OR REPLACE INTO events (id, run_key, seq, step, kind, version, payload, hash)"
    " VALUES ({k} * 4294967296 + 1, {k}, 1, 0, 6, 2, x'00', x'00')",
    "INSERT OR IGNORE INTO events (run_key, seq, step, kind, version, payload, hash)"
    " VALUES ({k}, 1, 0, 6, 2, x'00', x'00')",
    "UPDATE runs SET label = 'x'",
    "DELETE FROM runs WHERE run_id = '{r}'",
    "REPLACE INTO runs (run_id, parent_run_id, fork_seq, root_run_id, scenario, created_at,"
    " label) VALUES ('{r}', NULL, NULL, '{r}', 'test', 't', 'forged')",
    "INSERT OR REPLACE INTO runs (run_id, parent_run_id, fork_seq, root_run_id, scenario,"
    " created_at, label) VALUES ('{r}', NULL, NULL, '{r}', 'test', 't', 'forged')",
    # a REPLACE that collides on the integer key alone (a new run id taking over R's events)
    "REPLACE INTO runs (run_key, run_id, parent_run_id, fork_seq, root_run_id, scenario,"
    " created_at, label) VALUES ({k}, 'usurper', NULL, NULL, 'usurper', 'test', 't', '')",
    "INSERT INTO runs (run_id, parent_run_id, fork_seq, root_run_id, scenario, created_at, label)"
    " VALUES ('{r}', NULL, NULL, '{r}', 'test', 't', '') ON CONFLICT (run_id)"
    " DO UPDATE SET label = 'forged'",
    "UPDATE kinds SET name = 'forged' WHERE code = 6",
    "DELETE FROM kinds",
    "REPLACE INTO kinds (code, name) VALUES (6, 'forged')",
    "INSERT OR REPLACE INTO kinds (code, name) VALUES (99, 'chat_message')",
    "UPDATE snapshots SET state = x'00'",
    "DELETE FROM snapshots",
    "REPLACE INTO snapshots (run_id, seq, fold_version, state)"
    " SELECT run_id, seq, fold_version, x'00' FROM snapshots",
    "INSERT OR REPLACE INTO snapshots (run_id, seq, fold_version, state)"
    " SELECT run_id, seq, fold_version, x'00' FROM snapshots",
    "INSERT INTO snapshots (run_id, seq, fold_version, state)"
    " SELECT run_id, seq, fold_version, x'00' FROM snapshots WHERE true"
    " ON CONFLICT DO UPDATE SET state = excluded.state",
]

PG_REWRITES = [
    "UPDATE events SET payload = '\\x00' WHERE run_key = {k} AND seq = 1",
    "UPDATE events SET step = 99",
    "DELETE FROM events WHERE run_key = {k} AND seq = 3",
    "DELETE FROM events",
    "TRUNCATE events CASCADE",
    "INSERT INTO events (id, run_key, seq, step, kind, version, payload, hash)"
    " VALUES ({k} * 4294967296 + 1, {k}, 1, 0, 6, 2, '\\x00', '\\x00')"
    " ON CONFLICT (id) DO UPDATE SET payload = excluded.payload",
    "MERGE INTO events e USING (SELECT {k} AS run_key, 1 AS seq) s"
    " ON e.run_key = s.run_key AND e.seq = s.seq WHEN MATCHED THEN UPDATE SET step = 99",
    "MERGE INTO events e USING (SELECT {k} AS run_key, 1 AS seq) s"
    " ON e.run_key = s.run_key AND e.seq = s.seq WHEN MATCHED THEN DELETE",
    "UPDATE kinds SET name = 'forged' WHERE code = 6",
    "DELETE FROM kinds",
    "TRUNCATE kinds CASCADE",
    "UPDATE runs SET label = 'x'",
    "DELETE FROM runs WHERE run_id = '{r}'",
    "TRUNCATE runs CASCADE",
    "INSERT INTO runs (run_id, parent_run_id, fork_seq, root_run_id, scenario, created_at, label)"
    " VALUES ('{r}', NULL, NULL, '{r}', 'test', 't', '') ON CONFLICT (run_id)"
    " DO UPDATE SET label = 'forged'",
    "UPDATE snapshots SET state = '\\x00'",
    "DELETE FROM snapshots",
    "TRUNCATE snapshots",
    "INSERT INTO snapshots (run_id, seq, fold_version, state)"
    " SELECT run_id, seq, fold_version, '\\x00' FROM snapshots"
    " ON CONFLICT (run_id, seq, fold_version) DO UPDATE SET state = excluded.state",
]


def put_real_snapshot(j: Journal, run: str, seq: int) -> None:
    j.put_snapshot(run, seq, FOLD_VERSION, encode_state(state_at_seq(j, run, seq, snapshots=False)))


def _history(rows: list[tuple[object, ...]]) -> list[tuple[object, ...]]:
    return sorted(tuple(bytes(v) if isinstance(v, memoryview) else v for v in r) for r in rows)


class TestSqlite:
    @pytest.fixture
    def journal(self, tmp_path: Path) -> Iterator[tuple[Journal, str]]:
        with Journal(tmp_path / "j.db") as j:
            run = record(j, 2)
            put_real_snapshot(j, run, 4)
            yield j, run

    @staticmethod
    def dump(path: Path) -> list[list[tuple[object, ...]]]:
        db = sqlite3.connect(path)
        try:
            return [
                _history(db.execute(f"SELECT * FROM {t}").fetchall())
                for t in ("events", "runs", "snapshots", "kinds")
            ]
        finally:
            db.close()

    @pytest.mark.parametrize("recursive", [False, True], ids=["plain", "recursive_triggers"])
    @pytest.mark.parametrize("sql", SQLITE_REWRITES)
    def test_rewrite_refused(self, journal: tuple[Journal, str], sql: str, recursive: bool) -> None:
        """Every rewriting statement is refused by the database and changes nothing, with
        or without recursive_triggers on the rewriting connection."""
        j, run = journal
        assert j.path is not None
        before = self.dump(j.path)
        db = sqlite3.connect(j.path, isolation_level=None)
        db.execute(f"PRAGMA recursive_triggers = {'ON' if recursive else 'OFF'}")
        with pytest.raises(sqlite3.DatabaseError, match="refused"):
            db.execute(sql.format(r=run, k=j.run_key(run)))
        db.close()
        assert self.dump(j.path) == before

    def test_appends_still_work(self, journal: tuple[Journal, str]) -> None:
        """New rows (events, runs, snapshots) are still accepted next to the refusals; a second
        store of the same snapshot is a no-op, not an error."""
        from test_journal_contract import step_events

        j, run = journal
        head = j.append(run, step_events(2), j.head(run))
        assert head == 10
        put_real_snapshot(j, run, 4)
        put_real_snapshot(j, run, 8)
        child = j.fork(run, 4)
        assert j.run(child).parent_run_id == run
        assert j.verify().ok


class TestPostgres:
    @pytest.fixture
    def journal(self, pg_url: str) -> Iterator[tuple[Journal, str, str]]:
        url = make_url(pg_url)
        name = "rw_" + uuid.uuid4().hex[:12]
        admin = _plain(url.set(database="postgres"))
        with psycopg.connect(admin, autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{name}"')  # type: ignore[arg-type]
        target = url.set(database=name).render_as_string(hide_password=False)
        with Journal(target) as j:
            run = record(j, 2)
            put_real_snapshot(j, run, 4)
            yield j, run, _plain(make_url(target))
        with psycopg.connect(admin, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')  # type: ignore[arg-type]

    @staticmethod
    def dump(dsn: str) -> list[list[tuple[object, ...]]]:
        with psycopg.connect(dsn) as c:
            return [
                _history(c.execute(f"SELECT * FROM {t}").fetchall())  # type: ignore[arg-type]
                for t in ("events", "runs", "snapshots", "kinds")
            ]

    @pytest.mark.parametrize("sql", PG_REWRITES)
    def test_rewrite_refused(self, journal: tuple[Journal, str, str], sql: str) -> None:
        """Every rewriting statement (UPSERT, MERGE and TRUNCATE included) is refused with the
        append-only error and changes nothing."""
        j, run, dsn = journal
        before = self.dump(dsn)
        with (
            psycopg.connect(dsn, autocommit=True) as c,
            pytest.raises(psycopg.Error, match="refused"),
        ):
            c.execute(sql.format(r=run, k=j.run_key(run)))  # type: ignore[arg-type]
        assert self.dump(dsn) == before
