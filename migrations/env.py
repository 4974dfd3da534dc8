"""Alembic environment: the journal's schema is owned by these migrations.

The engine runs them programmatically when a journal is opened; it passes an open connection in
`config.attributes["connection"]`. `alembic -c migrations/alembic.ini upgrade head` works too.
"""

from __future__ import annotations

from typing import Any

from alembic import context
from sqlalchemy import create_engine

config = context.config


def _target_metadata() -> Any:
    # only autogenerate compares with the models; the engine's own upgrades skip importing
    # SQLModel (and pydantic), which would double the cost of creating a journal
    if config.attributes.get("connection") is not None:
        return None
    from engine.tables import metadata

    return metadata


target_metadata = _target_metadata()


def _run(connection) -> None:  # type: ignore[no-untyped-def]
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        # every revision of an upgrade in ONE transaction on SQLite too (its DDL is
        # transactional; Alembic's SQLite default commits after each revision), so a revision
        # that refuses a journal (0005 on rows it cannot copy) leaves it at its old revision
        transactional_ddl=True,
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
