"""Mark the journal as one that may hold event schema v5 rows (no table change).

Why a revision without DDL: a v5 payload is positional (the kind's code, a mask of the fields
present, their values) and its LLM request may be a delta of two earlier requests
(docs/decisions.md, entry 42). An engine that only knows v4 would take such a row for a broken
map and call the journal tampered; with this revision stored, it refuses the whole journal at
open with "schema revision ... newer than this engine knows; upgrade", before reading anything.

Revision ID: 0006_positional_events
Revises: 0005_integer_rows
Create Date: 2026-12-01
"""

revision = "0006_positional_events"
down_revision = "0005_integer_rows"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    # History is append-only; a downgrade would destroy it, so there is none.
    raise RuntimeError("the journal schema cannot be downgraded")
