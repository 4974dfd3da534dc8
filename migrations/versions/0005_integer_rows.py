"""Integer-keyed event rows: runs get an INTEGER key, an event's key is run_key * 2**32 + seq.

Why (docs/decisions.md, entry 38): with v4 payloads the events row itself had become most of
a recorded step. Each row held the run id as text (again in the primary key's autoindex), the
chain hash as 67 characters of text, the kind as text, and every insert paid three B-trees on
SQLite (the rowid table, the (run_id, seq) autoindex and the step index). Now:

  runs    run_key INTEGER PRIMARY KEY AUTOINCREMENT (SQLite; an identity column on PostgreSQL),
          run_id stays the public, UNIQUE name every command and API speaks;
  events  id INTEGER PRIMARY KEY = run_key * 2**32 + seq (a CHECK ties the three), so on
          SQLite the table is its rowid B-tree and nothing else: a run's events are one range
          of it, appended at its end; run_key and seq stay columns for anyone who queries.
          kind a small integer (its names in `kinds`), hash the 32 raw bytes of the blake2b
          digest (the "b2:<hex>" text is made on read), no step index (a step is found by
          walking the run's range in seq order; steps grow with seq);
  kinds   code -> event kind name, written here once; history like the rest.

The chain hash's input does not change, so every stored hash keeps its value; only its storage
does. `(run_id, seq)` stays unique: run_id is UNIQUE, and id (the primary key) is a function
of (run_key, seq) by the CHECK. The triggers
that refuse UPDATE, DELETE, REPLACE/UPSERT (and TRUNCATE on PostgreSQL) are made again on the
new tables under their old names, and on `kinds`.

A journal that cannot be copied whole (an event whose run has no row, a kind this revision does
not know, a hash that is not "b2:" and 64 hex digits) is refused with one line and left as it
was: the upgrade runs in the opener's one transaction.

Revision ID: 0005_integer_rows
Revises: 0004_event_refs
Create Date: 2026-12-01
"""

from typing import Any

from alembic import op

from engine.errors import TamperedJournal

revision = "0005_integer_rows"
down_revision = "0004_event_refs"
branch_labels = None
depends_on = None

# Written down here, not imported: a revision must keep meaning what it meant when it shipped.
# A new event kind gets its code in a new revision.
KINDS = (
    (1, "run_started"),
    (2, "mole_assigned"),
    (3, "llm_call"),
    (4, "tool_call"),
    (5, "tool_result"),
    (6, "chat_message"),
    (7, "intervention"),
    (8, "control"),
    (9, "suspicion_declared"),
    (10, "run_ended"),
)
_CODE = {name: code for code, name in KINDS}
_PREFIX = "b2:"
SPAN = 4294967296  # 2**32: the seqs of one run's key

_RUN_COLUMNS = "run_id, parent_run_id, fork_seq, root_run_id, scenario, created_at, label"


def _sqlite_guards(table: str, match: str) -> list[str]:
    return [
        f"CREATE TRIGGER {table}_no_update BEFORE UPDATE ON {table} "
        f"BEGIN SELECT RAISE(ABORT, 'journal {table} are append-only: UPDATE refused'); END",
        f"CREATE TRIGGER {table}_no_delete BEFORE DELETE ON {table} "
        f"BEGIN SELECT RAISE(ABORT, 'journal {table} are append-only: DELETE refused'); END",
        f"CREATE TRIGGER {table}_no_rewrite BEFORE INSERT ON {table} "
        f"WHEN EXISTS (SELECT 1 FROM {table} WHERE {match}) "
        f"BEGIN SELECT RAISE(ABORT, 'journal {table} are append-only: row already exists, "
        "rewrite refused'); END",
    ]


def _refuse(what: str) -> TamperedJournal:
    return TamperedJournal(
        f"cannot upgrade the journal to integer-keyed rows: {what} (see `car verify`)"
    )


def _digest(run_id: str, seq: int, text: Any) -> bytes:
    if isinstance(text, str) and text.startswith(_PREFIX) and len(text) == 67:
        try:
            return bytes.fromhex(text[3:])
        except ValueError:
            pass
    raise _refuse(f"event {seq} of run {run_id!r} has a malformed hash {text!r}")


def _sqlite_upgrade() -> None:
    bind = op.get_bind()
    op.execute(
        "CREATE TABLE kinds (code INTEGER NOT NULL PRIMARY KEY, name VARCHAR(32) NOT NULL,"
        " UNIQUE (name))"
    )
    for code, name in KINDS:
        op.execute(f"INSERT INTO kinds (code, name) VALUES ({code}, '{name}')")
    # the key follows creation order, so a parent's key is below its branches'
    op.execute(
        "CREATE TABLE runs_new ("
        "run_key INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT,"
        " run_id VARCHAR(64) NOT NULL,"
        " parent_run_id VARCHAR(64) REFERENCES runs (run_id),"
        " fork_seq INTEGER,"
        " root_run_id VARCHAR(64) NOT NULL,"
        " scenario VARCHAR(64) NOT NULL,"
        " created_at VARCHAR(40) NOT NULL,"
        " label VARCHAR(200) NOT NULL,"
        " UNIQUE (run_id))"
    )
    op.execute(
        f"INSERT INTO runs_new ({_RUN_COLUMNS}) SELECT {_RUN_COLUMNS} FROM runs"
        " ORDER BY created_at, run_id"
    )
    op.execute(
        "CREATE TABLE events_new ("
        "id INTEGER NOT NULL PRIMARY KEY,"
        " run_key INTEGER NOT NULL REFERENCES runs (run_key),"
        " seq INTEGER NOT NULL,"
        " step INTEGER,"
        " kind INTEGER NOT NULL,"
        " version INTEGER NOT NULL,"
        " payload BLOB NOT NULL,"
        " hash BLOB NOT NULL,"
        f" CHECK (seq >= 0 AND seq < {SPAN} AND id = run_key * {SPAN} + seq))"
    )
    keys = dict(bind.exec_driver_sql("SELECT run_id, run_key FROM runs_new").fetchall())
    rows = bind.exec_driver_sql(
        "SELECT run_id, seq, step, kind, version, payload, hash FROM events ORDER BY run_id, seq"
    )
    batch: list[tuple[Any, ...]] = []
    for run_id, seq, step, kind, version, payload, hash_ in rows:
        if run_id not in keys:
            raise _refuse(f"event {seq} belongs to run {run_id!r}, which has no row")
        if kind not in _CODE:
            raise _refuse(f"event {seq} of run {run_id!r} has an unknown kind {kind!r}")
        key = keys[run_id]
        digest = _digest(run_id, seq, hash_)
        batch.append((key * SPAN + seq, key, seq, step, _CODE[kind], version, payload, digest))
    if batch:
        bind.exec_driver_sql(
            "INSERT INTO events_new (id, run_key, seq, step, kind, version, payload, hash)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            batch,
        )
    # the old tables' triggers and indexes go with them
    op.execute("DROP TABLE events")
    op.execute("DROP TABLE runs")
    op.execute("ALTER TABLE runs_new RENAME TO runs")
    op.execute("ALTER TABLE events_new RENAME TO events")
    op.execute("CREATE INDEX ix_runs_root_run_id ON runs (root_run_id)")
    for stmt in (
        # looked up by the primary key the CHECK ties to (run_key, seq)
        _sqlite_guards("events", f"id = NEW.run_key * {SPAN} + NEW.seq")
        # a REPLACE may collide on either of the runs' two unique keys
        + _sqlite_guards("runs", "run_id = NEW.run_id OR run_key = NEW.run_key")
        + _sqlite_guards("kinds", "code = NEW.code OR name = NEW.name")
    ):
        op.execute(stmt)


def _pg_upgrade() -> None:
    bind = op.get_bind()
    op.execute(
        "CREATE TABLE kinds (code INTEGER NOT NULL PRIMARY KEY, name VARCHAR(32) NOT NULL,"
        " UNIQUE (name))"
    )
    for code, name in KINDS:
        op.execute(f"INSERT INTO kinds (code, name) VALUES ({code}, '{name}')")
    # adding an identity column numbers the existing rows without an UPDATE (which the
    # append-only trigger would refuse)
    op.execute("ALTER TABLE runs ADD COLUMN run_key INTEGER GENERATED BY DEFAULT AS IDENTITY")
    op.execute("ALTER TABLE runs ADD CONSTRAINT runs_run_key_key UNIQUE (run_key)")
    op.execute(
        "CREATE TABLE events_new ("
        "id BIGINT NOT NULL,"
        " run_key INTEGER NOT NULL REFERENCES runs (run_key),"
        " seq BIGINT NOT NULL,"
        " step INTEGER,"
        " kind INTEGER NOT NULL,"
        " version INTEGER NOT NULL,"
        " payload BYTEA NOT NULL,"
        " hash BYTEA NOT NULL,"
        " CONSTRAINT events_new_pkey PRIMARY KEY (id),"
        f" CONSTRAINT events_key CHECK (seq >= 0 AND seq < {SPAN}"
        f" AND id = run_key::bigint * {SPAN} + seq))"
    )
    bad = bind.exec_driver_sql(
        "SELECT e.run_id, e.seq, e.kind, e.hash FROM events e"
        " LEFT JOIN runs r ON r.run_id = e.run_id LEFT JOIN kinds k ON k.name = e.kind"
        " WHERE r.run_id IS NULL OR k.name IS NULL OR e.hash !~ '^b2:[0-9a-f]{64}$' LIMIT 1"
    ).fetchall()
    if bad:
        run_id, seq, kind, hash_ = bad[0]
        if kind not in _CODE:
            raise _refuse(f"event {seq} of run {run_id!r} has an unknown kind {kind!r}")
        _digest(run_id, seq, hash_)
        raise _refuse(f"event {seq} belongs to run {run_id!r}, which has no row")
    op.execute(
        "INSERT INTO events_new (id, run_key, seq, step, kind, version, payload, hash)"
        f" SELECT r.run_key::bigint * {SPAN} + e.seq, r.run_key, e.seq, e.step, k.code,"
        " e.version, e.payload,"
        " decode(substr(e.hash, 4), 'hex') FROM events e"
        " JOIN runs r ON r.run_id = e.run_id JOIN kinds k ON k.name = e.kind"
    )
    op.execute("DROP TABLE events")
    op.execute("ALTER TABLE events_new RENAME TO events")
    op.execute("ALTER TABLE events RENAME CONSTRAINT events_new_pkey TO events_pkey")
    op.execute(
        "ALTER TABLE events RENAME CONSTRAINT events_new_run_key_fkey TO events_run_key_fkey"
    )
    for table in ("events", "kinds"):
        op.execute(
            f"CREATE TRIGGER {table}_append_only BEFORE UPDATE OR DELETE ON {table} "
            "FOR EACH ROW EXECUTE FUNCTION car_refuse_change()"
        )
        op.execute(
            f"CREATE TRIGGER {table}_no_truncate BEFORE TRUNCATE ON {table} "
            "FOR EACH STATEMENT EXECUTE FUNCTION car_refuse_change()"
        )


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _pg_upgrade()
    else:
        _sqlite_upgrade()


def downgrade() -> None:
    # History is append-only; a downgrade would destroy it, so there is none.
    raise RuntimeError("the journal schema cannot be downgraded")
