"""Add `texts`: each distinct long text of the journal stored once (event schema v3).

Why: an LLM request repeats the system prompt and the whole context window, so storing each
request whole made 88-98% of a recorded step copies of text already in the journal. From event
schema v3 on, every string of 64 bytes or more in an event is stored here once, keyed by its
`b2:` blake2b-256 digest, and the event's stored payload holds a reference. The hash chain still
covers the resolved bytes, so a changed text breaks the chain of every event that uses it.

`texts` is history like `events`: the same triggers refuse UPDATE, DELETE, REPLACE and UPSERT
(and TRUNCATE on PostgreSQL).

Revision ID: 0003_texts
Revises: 0002_refuse_rewrites
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0003_texts"
down_revision = "0002_refuse_rewrites"
branch_labels = None
depends_on = None

_SQLITE = [
    "CREATE TRIGGER texts_no_update BEFORE UPDATE ON texts "
    "BEGIN SELECT RAISE(ABORT, 'journal texts are append-only: UPDATE refused'); END",
    "CREATE TRIGGER texts_no_delete BEFORE DELETE ON texts "
    "BEGIN SELECT RAISE(ABORT, 'journal texts are append-only: DELETE refused'); END",
    "CREATE TRIGGER texts_no_rewrite BEFORE INSERT ON texts "
    "WHEN EXISTS (SELECT 1 FROM texts WHERE hash = NEW.hash) "
    "BEGIN SELECT RAISE(ABORT, 'journal texts are append-only: row already exists, "
    "rewrite refused'); END",
]

_PG = [
    "CREATE TRIGGER texts_append_only BEFORE UPDATE OR DELETE ON texts "
    "FOR EACH ROW EXECUTE FUNCTION car_refuse_change()",
    "CREATE TRIGGER texts_no_truncate BEFORE TRUNCATE ON texts "
    "FOR EACH STATEMENT EXECUTE FUNCTION car_refuse_change()",
]


def upgrade() -> None:
    op.create_table(
        "texts",
        sa.Column("hash", sa.String(80), primary_key=True),
        sa.Column("body", sa.LargeBinary(), nullable=False),
    )
    stmts = _PG if op.get_bind().dialect.name == "postgresql" else _SQLITE
    for stmt in stmts:
        op.execute(stmt)


def downgrade() -> None:
    # History is append-only; a downgrade would destroy it, so there is none.
    raise RuntimeError("the journal schema cannot be downgraded")
