"""Edits that `car verify` used to let through, on real SQLite files and the real PostgreSQL
server: event rows in an id range no run owns, texts no event uses, a lowered or doubled
alembic_version, two runs sharing a run_key, and on PostgreSQL an append-only trigger whose
function was replaced (CREATE OR REPLACE FUNCTION), redefined, switched to replica-only,
joined by a trigger or rule of the attacker's, turned off by session_replication_role, or
hidden behind row-level security. Each finding is pinned whole (run, seq, code, words)."""

from __future__ import annotations

import importlib.util
import shutil
import sqlite3
from pathlib import Path

import pytest
from journal_helpers import fresh_pg_database
from test_journal_contract import step_events
from test_journal_verify import KEY_OF, KEY_OF_PG, build_template, check, raw

from engine import events as ev
from engine.journal import SPAN, Journal
from engine.verify import PG_REFUSE_BODY, VerifyReport, verify_journal

ROOT = Path(__file__).resolve().parent.parent
Finding = tuple[str | None, int | None, str, str]


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    path = tmp_path_factory.mktemp("gaps") / "j.db"
    return (path, *build_template(path))


@pytest.fixture
def journal(template: tuple[Path, str, str], tmp_path: Path) -> tuple[Path, str, str]:
    path, run, child = template
    shutil.copy(path, tmp_path / "j.db")
    return tmp_path / "j.db", run, child


@pytest.fixture
def heist(failed_heist: tuple[Path, str], tmp_path: Path) -> tuple[Path, str]:
    """The seed-7 heist (its system prompts in `texts`) and a branch of it, in a copy."""
    path, run = failed_heist
    shutil.copy(path, tmp_path / "h.db")
    with Journal(tmp_path / "h.db") as j:
        child = j.fork(run, 20)
        j.append(child, [ev.Intervention(step=5, op="resample", at=5), *step_events(5)], 20)
        j.checkpoint()
    return tmp_path / "h.db", run


def found(report: VerifyReport) -> set[Finding]:
    """Every finding but the dropped triggers (which the attacker's tool, `raw`, causes)."""
    return {(p.run_id, p.seq, p.code, p.problem) for p in report.problems if p.code != "trigger"}


# ---------------------------------------------------------------------- SQLite


def test_rows_in_an_id_range_no_run_owns_are_orphans(journal: tuple[Path, str, str]) -> None:
    """Rows with ids of run_key 999 whose run_key column names a real run (the foreign key
    holds, the CHECK tying id to run_key and seq was switched off): no reader sees them (a
    run's events are its id range), so verify names them, saying what their column holds."""
    path, run, _child = journal
    db = raw(path)
    db.execute("PRAGMA ignore_check_constraints = ON")
    db.execute(
        f"INSERT INTO events SELECT 999 * {SPAN} + seq, run_key, seq, step, kind, version,"
        f" payload, hash FROM events WHERE run_key = {KEY_OF} AND seq < 4",
        (run,),
    )
    db.close()
    assert found(check(path)) == {
        (
            None,
            0,
            "orphan",
            f"4 events in the id range of run_key 999, which names no run (their run_key"
            f" column holds run {run!r}) (deleted run or forged events)",
        )
    }


def test_rows_below_every_range_are_orphans(journal: tuple[Path, str, str]) -> None:
    """A copy of an event under a negative id, its run_key column naming its run: named too."""
    path, run, _child = journal
    db = raw(path)
    db.execute("PRAGMA ignore_check_constraints = ON")
    db.execute(
        "INSERT INTO events SELECT -7, run_key, 7, step, kind, version, payload, hash"
        f" FROM events WHERE run_key = {KEY_OF} AND seq = 7",
        (run,),
    )
    db.close()
    assert found(check(path)) == {
        (
            None,
            7,
            "orphan",
            f"1 events in the id range of run_key -1, which names no run (their run_key column"
            f" holds run {run!r}) (deleted run or forged events)",
        )
    }


def test_a_recorded_heist_and_its_branch_use_every_text(heist: tuple[Path, str]) -> None:
    """Texts are shared (a branch refers to its parent's, every run of a crew to the same
    system prompts), and each is written with the append whose rows refer to it: a recorded
    journal has no text that no event uses."""
    path, _run = heist
    with sqlite3.connect(path) as db:
        (n,) = db.execute("SELECT count(*) FROM texts").fetchone()
    assert n > 0
    report = check(path)
    assert report.ok, report.problems
    assert report.notes == []


def test_a_text_no_event_uses_is_named(heist: tuple[Path, str]) -> None:
    """A well-formed text (its key the digest of its bytes) that no event refers to: bytes
    no reader reads, which no writer leaves."""
    path, _run = heist
    body = b"smuggled " * 20
    key = ev.text_key(ev.text_digest(body))
    db = raw(path)
    db.execute("INSERT INTO texts (hash, body) VALUES (?, ?)", (key, body))
    db.close()
    assert found(check(path)) == {
        (None, None, "text", f"text {key} is used by no event (forged or left by hand)")
    }


def test_unused_texts_are_not_judged_when_events_are_damaged(heist: tuple[Path, str]) -> None:
    """A damaged event may be the one that used a text: then only a note says they were not
    checked, and the findings are the damage's."""
    path, run = heist
    body = b"smuggled " * 20
    db = raw(path)
    db.execute(
        "INSERT INTO texts (hash, body) VALUES (?, ?)",
        (ev.text_key(ev.text_digest(body)), body),
    )
    db.execute(f"DELETE FROM events WHERE run_key = {KEY_OF} AND seq = 3", (run,))
    db.close()
    report = check(path)
    codes = {c for _r, _s, c, _p in found(report)}
    assert "removed" in codes and "text" not in codes
    # (the rows after the removed one are not rebuilt, so the texts they use look unused too)
    (note,) = report.notes
    assert note.endswith(" texts not checked for use: events that may use them are damaged")


def test_a_lowered_alembic_version_is_named(journal: tuple[Path, str, str]) -> None:
    """Revision 0007 is what makes an engine that does not know v6 rows refuse the journal
    at open: lowered, the rows are newer than it allows."""
    path, _run, _child = journal
    db = raw(path)
    db.execute("UPDATE alembic_version SET version_num = '0006_positional_events'")
    db.close()
    assert found(check(path)) == {
        (
            None,
            None,
            "schema",
            "events of schema v6 in a journal at revision 0006_positional_events, which"
            " allows v5 at most (alembic_version lowered?)",
        )
    }


def test_a_second_alembic_version_row_is_named(journal: tuple[Path, str, str]) -> None:
    path, _run, _child = journal
    db = raw(path)
    db.execute("INSERT INTO alembic_version VALUES ('0001_journal_tables')")
    db.close()
    assert found(check(path)) == {
        (
            None,
            None,
            "schema",
            "alembic_version holds 2 rows, not one: the schema revision is ambiguous",
        )
    }


def test_a_lease_of_no_run_is_a_note(journal: tuple[Path, str, str]) -> None:
    """Leases are mutable and not history (docs/decisions.md 23, 25): one of a run that has no
    row is said in a note, and the journal still verifies."""
    path, _run, _child = journal
    with sqlite3.connect(path) as db:  # leases have no triggers: any client may write them
        db.execute(
            "INSERT INTO leases (run_id, pid, host, boot_id, proc_start, heartbeat)"
            " VALUES ('ghost', 1, 'h', 'b', 's', 0)"
        )
    report = check(path)
    assert report.ok, report.problems
    assert report.notes == [
        "writer lease of run 'ghost', which has no row (leases are not history)"
    ]


def test_the_function_body_verify_expects_is_the_migrations() -> None:
    """verify writes the trigger function's body down rather than importing the migration
    (reading needs no Alembic): it must be the body revision 0001 creates."""
    spec = importlib.util.spec_from_file_location(
        "m0001", ROOT / "migrations" / "versions" / "0001_journal_tables.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    created = module._PG_FUNCTION
    assert "FUNCTION car_refuse_change() RETURNS trigger AS $$" in created
    assert created.split("$$")[1] == PG_REFUSE_BODY


# ------------------------------------------------------------------ PostgreSQL

_ORIGINAL_FUNCTION = (
    "CREATE OR REPLACE FUNCTION car_refuse_change() RETURNS trigger AS $$"
    f"{PG_REFUSE_BODY}$$ LANGUAGE plpgsql"
)
_ALL_TRIGGERS = (
    "events_append_only, events_no_truncate, kinds_append_only, kinds_no_truncate,"
    " runs_append_only, runs_no_truncate, snapshots_no_delete, snapshots_no_truncate,"
    " snapshots_write_once, texts_append_only, texts_no_truncate"
)
_QUIET = "CREATE FUNCTION quiet() RETURNS trigger AS $$ BEGIN RETURN NULL; END $$ LANGUAGE plpgsql"

# (what, the attacker's statements, what undoes them, the findings verify must report)
PG_ATTACKS: list[tuple[str, list[str], list[str], set[tuple[str, str]]]] = [
    (
        "function replaced",
        [
            "CREATE OR REPLACE FUNCTION car_refuse_change() RETURNS trigger AS $$"
            " BEGIN RETURN NEW; END; $$ LANGUAGE plpgsql",
            "UPDATE runs SET label = label",  # refused no longer
        ],
        [_ORIGINAL_FUNCTION],
        {
            (
                "trigger",
                "append-only trigger function car_refuse_change() is not the journal's"
                f" (replaced?): {_ALL_TRIGGERS} may refuse nothing",
            )
        },
    ),
    (
        "trigger runs another function",
        [
            _QUIET,
            "DROP TRIGGER kinds_no_truncate ON kinds",
            "CREATE TRIGGER kinds_no_truncate BEFORE TRUNCATE ON kinds"
            " FOR EACH STATEMENT EXECUTE FUNCTION quiet()",
        ],
        [
            "DROP TRIGGER kinds_no_truncate ON kinds",
            "CREATE TRIGGER kinds_no_truncate BEFORE TRUNCATE ON kinds"
            " FOR EACH STATEMENT EXECUTE FUNCTION car_refuse_change()",
            "DROP FUNCTION quiet()",
        ],
        {
            (
                "trigger",
                "append-only trigger function quiet() is not the journal's (replaced?):"
                " kinds_no_truncate may refuse nothing",
            )
        },
    ),
    (
        "trigger fires only in replica sessions",
        ["ALTER TABLE events ENABLE REPLICA TRIGGER events_append_only"],
        ["ALTER TABLE events ENABLE TRIGGER events_append_only"],
        {
            (
                "trigger",
                "append-only trigger 'events_append_only' fires only in replica sessions:"
                " it refuses nothing otherwise",
            )
        },
    ),
    (
        "trigger given a WHEN that never holds",
        [
            "DROP TRIGGER events_append_only ON events",
            "CREATE TRIGGER events_append_only BEFORE UPDATE OR DELETE ON events FOR EACH ROW"
            " WHEN (OLD.seq < 0) EXECUTE FUNCTION car_refuse_change()",
        ],
        [
            "DROP TRIGGER events_append_only ON events",
            "CREATE TRIGGER events_append_only BEFORE UPDATE OR DELETE ON events FOR EACH ROW"
            " EXECUTE FUNCTION car_refuse_change()",
        ],
        {
            (
                "trigger",
                "append-only trigger 'events_append_only' was altered: it no longer refuses"
                " what it should",
            )
        },
    ),
    (
        "a trigger of the attacker's",
        [
            _QUIET,
            "CREATE TRIGGER sneaky BEFORE INSERT ON events FOR EACH ROW EXECUTE FUNCTION quiet()",
        ],
        ["DROP TRIGGER sneaky ON events", "DROP FUNCTION quiet()"],
        {("trigger", "trigger 'sneaky' on history table 'events' is not the journal's")},
    ),
    (
        "session_replication_role replica for the database",
        ["ALTER DATABASE {db} SET session_replication_role = replica"],
        ["ALTER DATABASE {db} RESET session_replication_role"],
        {
            (
                "trigger",
                "session_replication_role is 'replica' in this session: the append-only"
                " triggers do not fire in it",
            ),
            (
                "trigger",
                "session_replication_role is set to 'replica' for this database: the"
                " append-only triggers do not fire in its sessions",
            ),
        },
    ),
    (
        "a rule of the attacker's",
        ["CREATE RULE hide AS ON DELETE TO events DO INSTEAD NOTHING"],
        ["DROP RULE hide ON events"],
        {("trigger", "rule 'hide' on history table 'events' is not the journal's")},
    ),
    (
        "row-level security",
        ["ALTER TABLE events ENABLE ROW LEVEL SECURITY"],
        ["ALTER TABLE events DISABLE ROW LEVEL SECURITY"],
        {
            (
                "trigger",
                "row-level security is on for history table 'events': readers may not see"
                " all of its rows",
            )
        },
    ),
]


@pytest.fixture(scope="module")
def pg_heist(pg_url: str) -> tuple[str, str, str]:
    """(URL, libpq DSN, database name) of a PostgreSQL journal holding a heist and a branch
    of it, which verifies."""
    from sqlalchemy.engine import make_url
    from test_journal_contract import _plain

    from engine.heist.session import record_heist
    from engine.policies.registry import make_policy

    target = fresh_pg_database(pg_url, "vg")
    with Journal(target) as j:
        run = record_heist(j, make_policy({"name": "sim"}), seed=7, rounds=2).run_id
        child = j.fork(run, 20)
        j.append(child, [ev.Intervention(step=5, op="resample", at=5), *step_events(5)], 20)
        assert verify_journal(j).ok
    url = make_url(target)
    return target, _plain(url), str(url.database)


@pytest.mark.parametrize(
    ("what", "attack", "undo", "expected"), PG_ATTACKS, ids=[a[0] for a in PG_ATTACKS]
)
def test_postgres_trigger_attacks_are_named(
    pg_heist: tuple[str, str, str],
    what: str,
    attack: list[str],
    undo: list[str],
    expected: set[tuple[str, str]],
) -> None:
    """The attack alone: exactly its findings, whole and about the whole file; undone, the
    journal verifies again."""
    import psycopg

    target, dsn, name = pg_heist
    try:
        with psycopg.connect(dsn, autocommit=True) as c:
            for sql in attack:
                c.execute(sql.format(db=f'"{name}"'))  # type: ignore[arg-type]
        with Journal(target, readonly=True) as j:
            report = verify_journal(j)
        assert {(p.code, p.problem) for p in report.problems} == expected, what
        assert all(p.run_id is None and p.seq is None for p in report.problems), what
    finally:
        with psycopg.connect(dsn, autocommit=True) as c:
            for sql in undo:
                c.execute(sql.format(db=f'"{name}"'))  # type: ignore[arg-type]
    with Journal(target, readonly=True) as j:
        assert verify_journal(j).ok, what


def _pg_journal(pg_url: str) -> tuple[str, str, str]:
    """(URL, libpq DSN, run) of a new PostgreSQL journal holding a 10-step run."""
    from sqlalchemy.engine import make_url
    from test_journal_contract import _plain, record

    target = fresh_pg_database(pg_url, "vg")
    with Journal(target) as j:
        run = record(j, 10)
        assert verify_journal(j).ok
    return target, _plain(make_url(target)), run


def _pg_found(target: str) -> set[Finding]:
    with Journal(target, readonly=True) as j:
        return {(p.run_id, p.seq, p.code, p.problem) for p in verify_journal(j).problems}


def test_postgres_rows_in_an_id_range_no_run_owns_are_orphans(pg_url: str) -> None:
    """With the CHECK dropped, rows in the id range of a run_key no run holds, their run_key
    column naming a real run (the foreign key holds): orphans."""
    import psycopg

    target, dsn, run = _pg_journal(pg_url)
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("ALTER TABLE events DROP CONSTRAINT events_key")
        c.execute(
            f"INSERT INTO events SELECT 999::bigint * {SPAN} + seq, run_key, seq, step, kind,"
            f" version, payload, hash FROM events WHERE run_key = {KEY_OF_PG} AND seq < 3",
            (run,),
        )
    assert _pg_found(target) == {
        (
            None,
            0,
            "orphan",
            f"3 events in the id range of run_key 999, which names no run (their run_key"
            f" column holds run {run!r}) (deleted run or forged events)",
        )
    }


def test_postgres_runs_sharing_a_run_key_are_named(pg_url: str) -> None:
    """With the UNIQUE constraint dropped, a second run row holding a run's run_key: a clone
    that reads the run's events, chain and all, under another name."""
    import psycopg

    target, dsn, run = _pg_journal(pg_url)
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("ALTER TABLE runs DROP CONSTRAINT runs_run_key_key CASCADE")
        c.execute(
            "INSERT INTO runs (run_key, run_id, parent_run_id, fork_seq, root_run_id, scenario,"
            " created_at, label) SELECT run_key, 'clone', NULL, NULL, 'clone', scenario,"
            " created_at, label FROM runs WHERE run_id = %s",
            (run,),
        )
        (key,) = c.execute("SELECT run_key FROM runs WHERE run_id = %s", (run,)).fetchone()  # type: ignore[misc]
    assert _pg_found(target) == {
        (
            "clone",
            None,
            "run_row",
            f"run_key {key} is also that of run {run!r}: each reads the other's events",
        )
    }
