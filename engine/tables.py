"""Where the journal is kept: the SQLModel tables. Their schema is created only by the Alembic
migrations in `migrations/`; a test checks that models and migrations agree.

Layout (see docs/decisions.md):
  runs       one immutable row per run; a fork points at its parent and the parent's seq where it
             diverges (copy-on-write: the prefix is read through the pointer, never copied).
  events     one immutable row per event: (run_id, seq) is the key and the concurrency control;
             payload is the msgpack encoding of the event; hash chains the run.
  snapshots  a cache of folded states s_k, keyed by (run_id, seq); derived, rebuildable, and
             re-derived by `car verify` (a forged snapshot is found, not trusted).
  texts      each distinct long text once, keyed by its b2: digest (event schema v3); history,
             append-only like events.
  leases     the one mutable table: which live process writes which run (pid, host, boot id,
             heartbeat). Not history: no chain, no anchor, no triggers.
"""

from __future__ import annotations

from sqlalchemy import Column, Float, Index, LargeBinary, MetaData
from sqlmodel import Field, SQLModel

metadata: MetaData = SQLModel.metadata


class RunRow(SQLModel, table=True):
    __tablename__ = "runs"

    run_id: str = Field(primary_key=True, max_length=64)
    parent_run_id: str | None = Field(default=None, foreign_key="runs.run_id", max_length=64)
    fork_seq: int | None = Field(default=None)
    root_run_id: str = Field(max_length=64, index=True)
    scenario: str = Field(max_length=64)
    created_at: str = Field(max_length=40)
    label: str = Field(default="", max_length=200)


class EventRow(SQLModel, table=True):
    __tablename__ = "events"
    __table_args__ = (Index("ix_events_run_step", "run_id", "step"),)

    run_id: str = Field(primary_key=True, foreign_key="runs.run_id", max_length=64)
    seq: int = Field(primary_key=True)
    step: int | None = Field(default=None)
    kind: str = Field(max_length=32)
    version: int
    payload: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    hash: str = Field(max_length=80)


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
