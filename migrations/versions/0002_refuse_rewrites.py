"""Refuse every rewrite of history, REPLACE and UPSERT included; add the writers' leases.

Why a new revision: 0001 refused UPDATE and DELETE only. On SQLite `REPLACE INTO` / `INSERT OR
REPLACE` delete the conflicting row *without* firing DELETE triggers (unless the connection turned
`recursive_triggers` on), so any client could overwrite an event, a run or a snapshot. A BEFORE
INSERT trigger that raises when the key already exists catches every form of it (REPLACE,
INSERT OR REPLACE/IGNORE, UPSERT) whatever pragmas the rewriting connection set. Snapshots also
become delete-proof (0001 left DELETE open), and PostgreSQL refuses TRUNCATE of snapshots too.
An UPSERT's DO UPDATE and a MERGE fire the UPDATE triggers, which already refuse.

`leases` is new and deliberately *mutable*: one row per run that a live process is writing
(pid, host, boot id, heartbeat). It is not part of the journal's history — no chain, no anchor,
no triggers — only the evidence a reader needs to tell a live writer from a dead one.

Revision ID: 0002_refuse_rewrites
Revises: 0001_journal_tables
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0002_refuse_rewrites"
down_revision = "0001_journal_tables"
branch_labels = None
depends_on = None

# table -> its key columns
_KEYS = {
    "events": ("run_id", "seq"),
    "runs": ("run_id",),
    "snapshots": ("run_id", "seq", "fold_version"),
}


def _sqlite_no_rewrite(table: str, key: tuple[str, ...]) -> str:
    match = " AND ".join(f"{c} = NEW.{c}" for c in key)
    return (
        f"CREATE TRIGGER {table}_no_rewrite BEFORE INSERT ON {table} "
        f"WHEN EXISTS (SELECT 1 FROM {table} WHERE {match}) "
        f"BEGIN SELECT RAISE(ABORT, 'journal {table} are append-only: row already exists, "
        "rewrite refused'); END"
    )


_SQLITE = [_sqlite_no_rewrite(t, k) for t, k in _KEYS.items()] + [
    "CREATE TRIGGER snapshots_no_delete BEFORE DELETE ON snapshots "
    "BEGIN SELECT RAISE(ABORT, 'journal snapshots are append-only: DELETE refused'); END"
]

_PG = [
    "CREATE TRIGGER snapshots_no_delete BEFORE DELETE ON snapshots "
    "FOR EACH ROW EXECUTE FUNCTION car_refuse_change()",
    "CREATE TRIGGER snapshots_no_truncate BEFORE TRUNCATE ON snapshots "
    "FOR EACH STATEMENT EXECUTE FUNCTION car_refuse_change()",
]


def upgrade() -> None:
    op.create_table(
        "leases",
        sa.Column("run_id", sa.String(64), primary_key=True),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("boot_id", sa.String(64), nullable=False),
        sa.Column("proc_start", sa.String(32), nullable=False),
        sa.Column("heartbeat", sa.Float(), nullable=False),
    )
    stmts = _PG if op.get_bind().dialect.name == "postgresql" else _SQLITE
    for stmt in stmts:
        op.execute(stmt)


def downgrade() -> None:
    # History is append-only; a downgrade would reopen it to rewrites, so there is none.
    raise RuntimeError("the journal schema cannot be downgraded")
