"""Where the journal is kept: the SQLModel tables. Their schema is created only by the Alembic
migrations in `migrations/`; a test checks that models and migrations agree.

Layout (see docs/decisions.md, entries 1-38):
  runs       one immutable row per run; a fork points at its parent and the parent's seq where it
             diverges (copy-on-write: the prefix is read through the pointer, never copied).
             run_id is the public name; run_key the INTEGER that events rows carry.
  events     one immutable row per event: id = run_key * 2**32 + seq is the key and the
             concurrency control (SQLite's rowid: one B-tree, no step index); payload is the msgpack
             encoding of the event; hash chains the run, stored as the digest's 32 raw bytes
             ("b2:<hex>" is made on read); kind is a code from `kinds`.
  kinds      event kind codes -> names, written by the migration that introduced them.
  snapshots  a cache of folded states s_k, keyed by (run_id, seq); derived, rebuildable, and
             re-derived by `car verify` (a forged snapshot is found, not trusted).
  texts      each distinct long text once, keyed by its b2: digest (event schema v3); history,
             append-only like events.
  leases     the one mutable table: which live process writes which run (pid, host, boot id,
             heartbeat). Not history: no chain, no anchor, no triggers.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Column,
    Float,
    ForeignKey,
    Integer,
    LargeBinary,
    MetaData,
)
from sqlmodel import Field, SQLModel

metadata: MetaData = SQLModel.metadata
SPAN = 2**32  # engine.journal.SPAN (not imported: this module is only for the schema tools)


class RunRow(SQLModel, table=True):
    __tablename__ = "runs"
    __table_args__ = {"sqlite_autoincrement": True}

    run_key: int | None = Field(
        default=None, sa_column=Column(Integer, primary_key=True, autoincrement=True)
    )
    run_id: str = Field(max_length=64, unique=True)
    parent_run_id: str | None = Field(default=None, foreign_key="runs.run_id", max_length=64)
    fork_seq: int | None = Field(default=None)
    root_run_id: str = Field(max_length=64, index=True)
    scenario: str = Field(max_length=64)
    created_at: str = Field(max_length=40)
    label: str = Field(default="", max_length=200)


class EventRow(SQLModel, table=True):
    __tablename__ = "events"
    __table_args__ = (
        CheckConstraint(
            f"seq >= 0 AND seq < {SPAN} AND id = run_key * {SPAN} + seq", name="events_key"
        ),
    )

    # run_key * 2**32 + seq: on SQLite the rowid, so the table is one B-tree
    id: int = Field(
        sa_column=Column(
            BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=False
        )
    )
    run_key: int = Field(sa_column=Column(Integer, ForeignKey("runs.run_key"), nullable=False))
    seq: int = Field(sa_column=Column(Integer, nullable=False))
    step: int | None = Field(default=None)
    kind: int = Field(sa_column=Column(Integer, nullable=False))
    version: int
    payload: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    hash: bytes = Field(sa_column=Column(LargeBinary, nullable=False))


class KindRow(SQLModel, table=True):
    __tablename__ = "kinds"

    code: int = Field(sa_column=Column(Integer, primary_key=True, autoincrement=False))
    name: str = Field(max_length=32, unique=True)


class SnapshotRow(SQLModel, table=True):
    __tablename__ = "snapshots"

    run_id: str = Field(primary_key=True, foreign_key="runs.run_id", max_length=64)
    seq: int = Field(primary_key=True)
    fold_version: int = Field(primary_key=True)
    state: bytes = Field(sa_column=Column(LargeBinary, nullable=False))


class LeaseRow(SQLModel, table=True):
    __tablename__ = "leases"

    run_id: str = Field(primary_key=True, max_length=64)
    pid: int
    host: str = Field(max_length=255)
    boot_id: str = Field(max_length=64)
    proc_start: str = Field(max_length=32)
    heartbeat: float = Field(sa_column=Column(Float, nullable=False))


class TextRow(SQLModel, table=True):
    __tablename__ = "texts"

    hash: str = Field(primary_key=True, max_length=80)
    body: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
