"""Alembic environment: the journal's schema is owned by these migrations.

The engine runs them programmatically when a journal is opened; it passes an open connection in
`config.attributes["connection"]`. `alembic -c migrations/alembic.ini upgrade head` works too.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from engine.tables import metadata

config = context.config
target_metadata = metadata


def _run(connection) -> None:  # type: ignore[no-untyped-def]
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:
    engine = create_engine(
        config.get_main_option("sqlalchemy.url") or "sqlite:///recordings/journal.db"
    )
    with engine.begin() as conn:
        _run(conn)
