"""Create the journal: runs, events, snapshots, and the triggers that make history append-only.

Why the triggers live in the database and not in the engine: any client that opens the file
(sqlite3 shell, psql, another tool) must be refused an UPDATE or DELETE of history too.

Revision ID: 0001_journal_tables
Revises:
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "0001_journal_tables"
down_revision = None
branch_labels = None
depends_on = None

_SQLITE_TRIGGERS = [
    f"CREATE TRIGGER {table}_no_{op_.lower()} BEFORE {op_} ON {table} "
    f"BEGIN SELECT RAISE(ABORT, 'journal {table} are append-only: {op_} refused'); END"
    for table in ("events", "runs")
    for op_ in ("UPDATE", "DELETE")
] + [
    "CREATE TRIGGER snapshots_no_update BEFORE UPDATE ON snapshots "
    "BEGIN SELECT RAISE(ABORT, 'journal snapshots are write-once: UPDATE refused'); END"
]

_PG_FUNCTION = """
CREATE OR REPLACE FUNCTION car_refuse_change() RETURNS trigger AS $$
BEGIN
  RAISE EXCEPTION 'journal % are append-only: % refused', TG_TABLE_NAME, TG_OP
    USING ERRCODE = 'integrity_constraint_violation';
END;
$$ LANGUAGE plpgsql
"""

_PG_TRIGGERS = (
    [
        f"CREATE TRIGGER {table}_append_only BEFORE UPDATE OR DELETE ON {table} "
        "FOR EACH ROW EXECUTE FUNCTION car_refuse_change()"
        for table in ("events", "runs")
    ]
    + [
        f"CREATE TRIGGER {table}_no_truncate BEFORE TRUNCATE ON {table} "
        "FOR EACH STATEMENT EXECUTE FUNCTION car_refuse_change()"
        for table in ("events", "runs")
    ]
    + [
        "CREATE TRIGGER snapshots_write_once BEFORE UPDATE ON snapshots "
        "FOR EACH ROW EXECUTE FUNCTION car_refuse_change()"
    ]
)


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("run_id", sa.String(64), primary_key=True),
        sa.Column("parent_run_id", sa.String(64), sa.ForeignKey("runs.run_id"), nullable=True),
        sa.Column("fork_seq", sa.Integer(), nullable=True),
        sa.Column("root_run_id", sa.String(64), nullable=False),
        sa.Column("scenario", sa.String(64), nullable=False),
        sa.Column("created_at", sa.String(40), nullable=False),
        sa.Column("label", sa.String(200), nullable=False),
    )
    op.create_index("ix_runs_root_run_id", "runs", ["root_run_id"])
    op.create_table(
        "events",
        sa.Column("run_id", sa.String(64), sa.ForeignKey("runs.run_id"), primary_key=True),
        sa.Column("seq", sa.Integer(), primary_key=True),
        sa.Column("step", sa.Integer(), nullable=True),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("payload", sa.LargeBinary(), nullable=False),
        sa.Column("hash", sa.String(80), nullable=False),
    )
    op.create_index("ix_events_run_step", "events", ["run_id", "step"])
    op.create_table(
        "snapshots",
        sa.Column("run_id", sa.String(64), sa.ForeignKey("runs.run_id"), primary_key=True),
        sa.Column("seq", sa.Integer(), primary_key=True),
        sa.Column("fold_version", sa.Integer(), primary_key=True),
        sa.Column("state", sa.LargeBinary(), nullable=False),
    )
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        op.execute(_PG_FUNCTION)
        for stmt in _PG_TRIGGERS:
            op.execute(stmt)
    else:
        for stmt in _SQLITE_TRIGGERS:
            op.execute(stmt)


def downgrade() -> None:
    # History is append-only; a downgrade would destroy it, so there is none.
    raise RuntimeError("the journal schema cannot be downgraded")
