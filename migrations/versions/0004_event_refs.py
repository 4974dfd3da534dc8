"""Mark the journal as one that may hold event schema v4 rows (no table change).

Why a revision without DDL: a v4 payload refers to strings inline in earlier events and stores
an LLM request as a delta of an earlier one (docs/decisions.md, entry 37). An engine that only
knows v3 would read such a row as a v3 payload and fail on it with a traceback; with this
revision stored, it refuses the whole journal at open with "schema revision ... newer than this
engine knows; upgrade", before reading anything. The tables, triggers and `texts` (still read for
v3 rows) stay as revision 0003 left them.

Revision ID: 0004_event_refs
Revises: 0003_texts
Create Date: 2026-12-01
"""

revision = "0004_event_refs"
down_revision = "0003_texts"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    # History is append-only; a downgrade would destroy it, so there is none.
    raise RuntimeError("the journal schema cannot be downgraded")
