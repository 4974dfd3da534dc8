"""Mark the journal as one that may hold event schema v6 rows and packed texts (no table change).

Why a revision without DDL: a v6 payload is its v5 stored form deflated against the run's
own earlier events of its block, and a text may be deflated against another text
(docs/decisions.md, entry 43). An engine that only knows v5 would take such a row or text for
a broken one and call the journal tampered; with this revision stored, it refuses the whole
journal at open with "schema revision ... newer than this engine knows; upgrade", before
reading anything.

Revision ID: 0007_packed_rows
Revises: 0006_positional_events
Create Date: 2026-12-02
"""

revision = "0007_packed_rows"
down_revision = "0006_positional_events"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    # History is append-only; a downgrade would destroy it, so there is none.
    raise RuntimeError("the journal schema cannot be downgraded")
