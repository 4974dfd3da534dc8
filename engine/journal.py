"""Where it is kept: the append-only, hash-chained event journal (SQLite or PostgreSQL).

The public methods open the transaction; private `_` helpers do the work inside it, so appends
compose. The hot path (append, read) speaks DB-API directly: SQLAlchemy owns the schema (through
Alembic) and the connection, not every row.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sqlite3
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DatabaseError as SADatabaseError
from sqlalchemy.exc import OperationalError as SAOperationalError

from engine import events as ev
from engine.errors import (
    ConcurrencyError,
    InterventionError,
    JournalError,
    NotAJournal,
    SchemaTooNew,
    UnknownRun,
)

HASH_PREFIX = "b2:"
DEFAULT_JOURNAL = Path("recordings") / "journal.db"
MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def default_journal_url() -> str:
    """`CAR_JOURNAL` if set, else recordings/journal.db under the current directory."""
    return os.environ.get("CAR_JOURNAL") or str(DEFAULT_JOURNAL)


def _to_url(target: str | os.PathLike[str]) -> str:
    text = os.fspath(target)
    if "://" in text:
        return text
    return f"sqlite:///{Path(text).expanduser().resolve()}"


def chain_hash(prev: str, seq: int, kind: str, version: int, payload: bytes) -> str:
    """Hash of one event: covers the previous hash, its position, kind, version and bytes.

    The run id is deliberately not covered, so the same seed and config give the same hashes."""
    h = hashlib.blake2b(digest_size=32)
    h.update(prev.encode())
    h.update(struct.pack(">qI", seq, version))
    h.update(kind.encode())
    h.update(b"\x00")
    h.update(payload)
    return HASH_PREFIX + h.hexdigest()


EventRow = tuple[str, int, int | None, str, int, bytes, str]


def chain_rows(run_id: str, events: Sequence[ev.Event], seq: int, prev: str) -> list[EventRow]:
    """The rows that append writes for `events` at `seq` after hash `prev`: payload bytes and
    the hash chain, in column order (run_id, seq, step, kind, version, payload, hash)."""
    rows: list[EventRow] = []
    for e in events:
        payload = ev.encode(e)
        kind = ev.kind_of(e)
        h = chain_hash(prev, seq, kind, ev.SCHEMA_VERSION, payload)
        rows.append((run_id, seq, e.step, kind, ev.SCHEMA_VERSION, payload, h))
        prev = h
        seq += 1
    return rows


class StoredEvent(msgspec.Struct, frozen=True):
    """One journal row. `event` decodes (and upcasts) the payload."""

    run_id: str
    seq: int
    step: int | None
    kind: str
    version: int
    payload: bytes
    hash: str

    @property
    def event(self) -> ev.AnyEvent:
        return ev.decode(self.payload, self.version)


class RunInfo(msgspec.Struct, frozen=True):
    run_id: str
    parent_run_id: str | None
    fork_seq: int | None
    root_run_id: str
    scenario: str
    created_at: str
    label: str


@dataclass(frozen=True)
class Segment:
    """A run's own slice of a lineage: events of `run_id` with start <= seq < stop."""

    run_id: str
    start: int
    stop: int | None


class VerifyProblem(msgspec.Struct, frozen=True):
    run_id: str
    seq: int
    problem: str


class VerifyReport(msgspec.Struct, frozen=True):
    runs_checked: int
    events_checked: int
    problems: list[VerifyProblem]

    @property
    def ok(self) -> bool:
        return not self.problems


def _new_run_id() -> str:
    return os.urandom(6).hex()


class Journal:
    """An open journal. Thread-safe for appends (one writer connection guarded by a lock)."""

    def __init__(
        self,
        target: str | os.PathLike[str] | None = None,
        *,
        upgrade: bool = True,
        create: bool = True,
        ids: Callable[[], str] = _new_run_id,
        clock: Callable[[], str] | None = None,
    ) -> None:
        self.url = _to_url(target if target is not None else default_journal_url())
        self.is_sqlite = self.url.startswith("sqlite")
        self._ids = ids
        self._clock = clock or _utc_now
        self._lock = threading.RLock()
        self._lineage_cache: dict[str, list[Segment]] = {}
        self._head_hash: dict[str, tuple[int, str]] = {}
        if self.is_sqlite:
            path = Path(self.url.removeprefix("sqlite:///"))
            self.path: Path | None = path
            if not path.exists():
                if not create:
                    raise JournalError(f"no journal at {str(path)!r}")
                path.parent.mkdir(parents=True, exist_ok=True)
            elif path.is_dir():
                raise NotAJournal(f"{str(path)!r} is a directory, not a journal file")
        else:
            self.path = None
        self.engine: Engine = self._make_engine()
        try:
            self._check_and_upgrade(upgrade)
            self._conn = self.engine.raw_connection()
        except (SADatabaseError, sqlite3.DatabaseError) as e:
            self.engine.dispose()
            raise NotAJournal(f"{self._where()} is not a journal: {_first_line(e)}") from e

    # ------------------------------------------------------------------ setup

    def _where(self) -> str:
        return repr(str(self.path)) if self.path is not None else repr(_redact(self.url))

    def _make_engine(self) -> Engine:
        if self.is_sqlite:
            eng = create_engine(self.url, connect_args={"isolation_level": None, "timeout": 30})

            @event.listens_for(eng, "connect")
            def _pragmas(dbapi_conn: Any, _rec: Any) -> None:
                cur = dbapi_conn.cursor()
                # 8 KiB pages fit ~1 KB events with less slack; only a new, empty file takes it
                cur.execute("PRAGMA page_size=8192")
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute("PRAGMA synchronous=NORMAL")
                cur.execute("PRAGMA foreign_keys=ON")
                cur.execute("PRAGMA busy_timeout=30000")
                cur.close()

            return eng
        try:
            return create_engine(self.url, pool_pre_ping=True)
        except Exception as e:  # bad URL or missing driver
            raise JournalError(f"cannot use journal URL {_redact(self.url)!r}: {e}") from e

    def _check_and_upgrade(self, upgrade: bool) -> None:
        from alembic import command
        from alembic.config import Config
        from alembic.runtime.migration import MigrationContext
        from alembic.script import ScriptDirectory

        cfg = Config()
        cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
        script = ScriptDirectory.from_config(cfg)
        known = {rev.revision for rev in script.walk_revisions()}
        head = script.get_current_head()
        try:
            conn_cm = self.engine.connect()
        except SAOperationalError as e:
            raise JournalError(f"cannot open journal {self._where()}: {_first_line(e)}") from e
        with conn_cm as conn:
            current = MigrationContext.configure(conn).get_current_revision()
            if current is None:
                tables = set(conn.dialect.get_table_names(conn))
                if tables - {"alembic_version"}:
                    raise NotAJournal(
                        f"{self._where()} is not a journal: it holds tables "
                        f"{sorted(tables)!r} but no journal schema"
                    )
            elif current not in known:
                raise SchemaTooNew(
                    f"journal {self._where()} has schema revision {current!r}, newer than this "
                    f"engine knows (latest {head!r}); upgrade causal-agent-replay"
                )
            if current != head and upgrade:
                cfg.attributes["connection"] = conn
                command.upgrade(cfg, "head")
                if conn.in_transaction():
                    conn.commit()

    def schema_revision(self) -> str | None:
        from alembic.runtime.migration import MigrationContext

        with self.engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._conn.close()
        self.engine.dispose()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --------------------------------------------------------- low-level SQL

    def _q(self, sql: str) -> str:
        return sql if self.is_sqlite else sql.replace("?", "%s")

    @contextlib.contextmanager
    def _tx(self) -> Iterator[Any]:
        """One write transaction on the writer connection (BEGIN IMMEDIATE on SQLite)."""
        with self._lock:
            cur = self._conn.cursor()
            try:
                if self.is_sqlite:
                    cur.execute("BEGIN IMMEDIATE")
                yield cur
                if self.is_sqlite:
                    cur.execute("COMMIT")
                else:
                    self._conn.commit()
            except BaseException:
                with contextlib.suppress(Exception):
                    if self.is_sqlite:
                        cur.execute("ROLLBACK")
                    else:
                        self._conn.rollback()
                raise
            finally:
                cur.close()

    @contextlib.contextmanager
    def _read(self) -> Iterator[Any]:
        with self._lock:
            cur = self._conn.cursor()
            try:
                yield cur
            finally:
                cur.close()
                if not self.is_sqlite:
                    self._conn.rollback()

    # ------------------------------------------------------------------ runs

    def create_run(
        self,
        scenario: str,
        *,
        parent_run_id: str | None = None,
        fork_seq: int | None = None,
        label: str = "",
        run_id: str | None = None,
    ) -> str:
        """Insert a runs row. A fork is a run with a parent pointer: O(1), nothing copied."""
        rid = run_id or self._ids()
        with self._tx() as cur:
            root = rid
            if parent_run_id is not None:
                parent = self._run_row(cur, parent_run_id)
                if fork_seq is None or fork_seq < 0:
                    raise InterventionError(f"a fork needs a fork_seq >= 0, got {fork_seq!r}")
                head = self._head(cur, parent.run_id)
                if fork_seq > head:
                    raise InterventionError(
                        f"cannot fork run {parent.run_id!r} at seq {fork_seq}: it has only "
                        f"{head} events"
                    )
                root = parent.root_run_id
                parent_run_id = parent.run_id
            cur.execute(
                self._q(
                    "INSERT INTO runs (run_id, parent_run_id, fork_seq, root_run_id, scenario,"
                    " created_at, label) VALUES (?, ?, ?, ?, ?, ?, ?)"
                ),
                (rid, parent_run_id, fork_seq, root, scenario, self._clock(), label),
            )
        return rid

    def fork(self, parent_run_id: str, fork_seq: int, *, label: str = "") -> str:
        """A child run that shares the parent's events with seq < fork_seq."""
        info = self.run(parent_run_id)
        return self.create_run(
            info.scenario, parent_run_id=info.run_id, fork_seq=fork_seq, label=label
        )

    def _run_row(self, cur: Any, run_id: str) -> RunInfo:
        cur.execute(
            self._q(
                "SELECT run_id, parent_run_id, fork_seq, root_run_id, scenario, created_at, label"
                " FROM runs WHERE run_id = ?"
            ),
            (run_id,),
        )
        row = cur.fetchone()
        if row is None:
            cur.execute(
                self._q("SELECT run_id FROM runs WHERE run_id LIKE ? ORDER BY run_id LIMIT 3"),
                (run_id.replace("%", "").replace("_", "") + "%",),
            )
            found = [r[0] for r in cur.fetchall()]
            if len(found) == 1 and run_id:
                return self._run_row(cur, found[0])
            if len(found) > 1:
                raise UnknownRun(f"run id prefix {run_id!r} is ambiguous: {found!r}")
            raise UnknownRun(f"unknown run id {run_id!r} (see `car runs`)")
        return RunInfo(*row)

    def run(self, run_id: str) -> RunInfo:
        """The run with this id or unique id prefix; UnknownRun otherwise."""
        with self._read() as cur:
            return self._run_row(cur, run_id)

    def runs(self) -> list[RunInfo]:
        with self._read() as cur:
            cur.execute(
                "SELECT run_id, parent_run_id, fork_seq, root_run_id, scenario, created_at, label"
                " FROM runs ORDER BY created_at, run_id"
            )
            return [RunInfo(*r) for r in cur.fetchall()]

    def children(self, run_id: str) -> list[RunInfo]:
        with self._read() as cur:
            cur.execute(
                self._q(
                    "SELECT run_id, parent_run_id, fork_seq, root_run_id, scenario, created_at,"
                    " label FROM runs WHERE parent_run_id = ? ORDER BY created_at, run_id"
                ),
                (run_id,),
            )
            return [RunInfo(*r) for r in cur.fetchall()]

    def lineage(self, run_id: str) -> list[Segment]:
        """Root-first segments whose events make up this run's history."""
        cached = self._lineage_cache.get(run_id)
        if cached is not None:
            return cached
        with self._read() as cur:
            chain: list[RunInfo] = [self._run_row(cur, run_id)]
            while chain[-1].parent_run_id is not None:
                chain.append(self._run_row(cur, chain[-1].parent_run_id))
        chain.reverse()
        segments: list[Segment] = []
        for i, info in enumerate(chain):
            start = info.fork_seq or 0
            stop = chain[i + 1].fork_seq if i + 1 < len(chain) else None
            segments.append(Segment(info.run_id, start, stop))
        # runs rows are immutable, so a lineage never changes once read
        self._lineage_cache[chain[-1].run_id] = segments
        return segments

    # ---------------------------------------------------------------- append

    def _head(self, cur: Any, run_id: str) -> int:
        """Next free seq of a run (its own events, else its fork point)."""
        cur.execute(self._q("SELECT max(seq) FROM events WHERE run_id = ?"), (run_id,))
        row = cur.fetchone()
        if row[0] is not None:
            return int(row[0]) + 1
        cur.execute(self._q("SELECT fork_seq FROM runs WHERE run_id = ?"), (run_id,))
        r = cur.fetchone()
        if r is None:
            raise UnknownRun(f"unknown run id {run_id!r} (see `car runs`)")
        return int(r[0] or 0)

    def head(self, run_id: str) -> int:
        """Number of events in the run's history (= next seq to append)."""
        info = self.run(run_id)
        with self._read() as cur:
            return self._head(cur, info.run_id)

    def _hash_at(self, cur: Any, run_id: str, seq: int) -> str:
        if seq < 0:
            return ""
        owner = self._owner(run_id, seq)
        cur.execute(self._q("SELECT hash FROM events WHERE run_id = ? AND seq = ?"), (owner, seq))
        row = cur.fetchone()
        if row is None:
            raise JournalError(f"run {run_id!r} has no event at seq {seq}")
        return str(row[0])

    def _owner(self, run_id: str, seq: int) -> str:
        for seg in reversed(self.lineage(run_id)):
            if seq >= seg.start:
                return seg.run_id
        return self.lineage(run_id)[0].run_id

    def append(
        self, run_id: str, events: Sequence[ev.Event], expected_seq: int | None = None
    ) -> int:
        """Append one step's events atomically; returns the new head.

        `expected_seq` is the seq the caller believes is next (optimistic concurrency): a writer
        that lost the race gets ConcurrencyError and nothing of its step is written."""
        if not events:
            return expected_seq if expected_seq is not None else self.head(run_id)
        with self._tx() as cur:
            return self._append(cur, run_id, events, expected_seq)

    def _append(
        self, cur: Any, run_id: str, events: Sequence[ev.Event], expected_seq: int | None
    ) -> int:
        seq = expected_seq if expected_seq is not None else self._head(cur, run_id)
        cached = self._head_hash.get(run_id)
        prev = cached[1] if cached is not None and cached[0] == seq - 1 else None
        if prev is None:
            if seq > 0 and not self.lineage(run_id):
                raise UnknownRun(f"unknown run id {run_id!r}")
            prev = self._hash_at(cur, run_id, seq - 1) if seq > 0 else ""
        rows = chain_rows(run_id, events, seq, prev)
        seq += len(rows)
        prev = rows[-1][6]
        try:
            cur.executemany(
                self._q(
                    "INSERT INTO events (run_id, seq, step, kind, version, payload, hash)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)"
                ),
                rows,
            )
        except Exception as e:
            self._head_hash.pop(run_id, None)
            if _is_unique_violation(e):
                raise ConcurrencyError(
                    f"run {run_id!r}: seq {rows[0][1]} was already written by another writer"
                ) from e
            if _is_fk_violation(e):
                raise UnknownRun(f"unknown run id {run_id!r} (see `car runs`)") from e
            raise JournalError(f"append to run {run_id!r} failed: {_first_line(e)}") from e
        self._head_hash[run_id] = (seq - 1, prev)
        return seq

    # ------------------------------------------------------------------ read

    def read(self, run_id: str, start: int = 0, stop: int | None = None) -> Iterator[StoredEvent]:
        """Events of the run's history with start <= seq < stop, through its parents."""
        for seg in self.lineage(run_id):
            lo = max(start, seg.start)
            hi = _min_opt(stop, seg.stop)
            if hi is not None and lo >= hi:
                continue
            yield from self._read_segment(seg.run_id, lo, hi)

    def _read_segment(self, run_id: str, lo: int, hi: int | None) -> Iterator[StoredEvent]:
        sql = "SELECT run_id, seq, step, kind, version, payload, hash FROM events WHERE run_id = ?"
        args: list[Any] = [run_id]
        sql += " AND seq >= ?"
        args.append(lo)
        if hi is not None:
            sql += " AND seq < ?"
            args.append(hi)
        sql += " ORDER BY seq"
        with self._read() as cur:
            cur.execute(self._q(sql), args)
            rows = cur.fetchall()
        for r in rows:
            yield StoredEvent(r[0], r[1], r[2], r[3], r[4], bytes(r[5]), r[6])

    def events(self, run_id: str, stop: int | None = None) -> list[ev.AnyEvent]:
        return [s.event for s in self.read(run_id, 0, stop)]

    def step_start(self, run_id: str, step: int) -> int | None:
        """Seq of the first event of step >= `step` in the run's history, None if none."""
        # steps grow with seq along a lineage, so the first segment (root first) that holds
        # such an event holds the earliest one
        with self._read() as cur:
            for seg in self.lineage(run_id):
                sql = "SELECT min(seq) FROM events WHERE run_id = ? AND step >= ? AND seq >= ?"
                args: list[Any] = [seg.run_id, step, seg.start]
                if seg.stop is not None:
                    sql += " AND seq < ?"
                    args.append(seg.stop)
                cur.execute(self._q(sql), args)
                row = cur.fetchone()
                if row and row[0] is not None:
                    return int(row[0])
        return None

    def last_stepped(self, run_id: str) -> tuple[int, int] | None:
        """(step, seq) of the last event that belongs to a step, None if there is none."""
        for seg in reversed(self.lineage(run_id)):
            sql = "SELECT step, seq FROM events WHERE run_id = ? AND seq >= ? AND step IS NOT NULL"
            args: list[Any] = [seg.run_id, seg.start]
            if seg.stop is not None:
                sql += " AND seq < ?"
                args.append(seg.stop)
            with self._read() as cur:
                cur.execute(self._q(sql + " ORDER BY seq DESC LIMIT 1"), args)
                row = cur.fetchone()
            if row is not None:
                return int(row[0]), int(row[1])
        return None

    def steps(self, run_id: str) -> int:
        """Number of agent steps in the run's history."""
        last = self.last_stepped(run_id)
        return 0 if last is None else last[0] + 1

    def last_event(self, run_id: str) -> StoredEvent | None:
        head = self.head(run_id)
        if head == 0:
            return None
        return next(self.read(run_id, head - 1, head), None)

    def status(self, run_id: str) -> str:
        """recording | paused | completed | stopped | failed, derived from the last events."""
        head = self.head(run_id)
        # an accusation may follow RunEnded; look past it
        for stored in reversed(list(self.read(run_id, max(0, head - 3), head))):
            e = stored.event
            if isinstance(e, ev.SuspicionDeclared):
                continue
            if isinstance(e, ev.RunEnded):
                return e.status
            if isinstance(e, ev.Control) and e.action == "pause":
                return "paused"
            return "recording"
        return "recording"

    # ------------------------------------------------------------- snapshots

    def put_snapshot(self, run_id: str, seq: int, fold_version: int, state: bytes) -> None:
        sql = (
            "INSERT INTO snapshots (run_id, seq, fold_version, state) VALUES (?, ?, ?, ?)"
            " ON CONFLICT DO NOTHING"
        )
        with self._tx() as cur:
            cur.execute(self._q(sql), (self._owner(run_id, seq - 1), seq, fold_version, state))

    def nearest_snapshot(
        self, run_id: str, seq: int, fold_version: int
    ) -> tuple[int, bytes] | None:
        """The latest snapshot valid for this run's history at or before `seq`."""
        with self._read() as cur:
            for seg in reversed(self.lineage(run_id)):
                if seq <= seg.start and seg.start > 0:
                    continue
                hi = seq if seg.stop is None else min(seq, seg.stop)
                cur.execute(
                    self._q(
                        "SELECT seq, state FROM snapshots WHERE run_id = ? AND fold_version = ?"
                        " AND seq > ? AND seq <= ? ORDER BY seq DESC LIMIT 1"
                    ),
                    (seg.run_id, fold_version, seg.start, hi),
                )
                row = cur.fetchone()
                if row is not None:
                    return int(row[0]), bytes(row[1])
        return None

    # ---------------------------------------------------------------- verify

    def verify(self, run_id: str | None = None) -> VerifyReport:
        """Re-derive every hash; report the first altered, removed or reordered event per run."""
        targets = [self.run(run_id)] if run_id is not None else self.runs()
        problems: list[VerifyProblem] = []
        n_events = 0
        for info in targets:
            start = info.fork_seq or 0
            try:
                prev = ""
                if info.parent_run_id is not None and start > 0:
                    with self._read() as cur:
                        prev = self._hash_at(cur, info.parent_run_id, start - 1)
            except JournalError:
                problems.append(
                    VerifyProblem(info.run_id, start - 1, "fork point missing from the parent")
                )
                continue
            expected = start
            for se in self._read_segment(info.run_id, 0, None):
                n_events += 1
                if se.seq != expected:
                    what = "removed" if se.seq > expected else "out of place"
                    problems.append(
                        VerifyProblem(info.run_id, expected, f"event {what} (next seq {se.seq})")
                    )
                    break
                h = chain_hash(prev, se.seq, se.kind, se.version, se.payload)
                if h != se.hash:
                    problems.append(
                        VerifyProblem(
                            info.run_id, se.seq, "hash mismatch: event altered or reordered"
                        )
                    )
                    break
                try:
                    decoded = se.event
                    if ev.kind_of(decoded) != se.kind:
                        raise ValueError("kind column disagrees with payload")
                except Exception as e:
                    problems.append(VerifyProblem(info.run_id, se.seq, f"undecodable payload: {e}"))
                    break
                prev = se.hash
                expected += 1
        return VerifyReport(len(targets), n_events, problems)

    def checkpoint(self) -> None:
        if self.is_sqlite:
            with self._read() as cur:
                cur.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def _utc_now() -> str:
    import datetime as dt

    return dt.datetime.now(dt.UTC).isoformat(timespec="microseconds")


def _min_opt(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


def _first_line(e: BaseException) -> str:
    text = str(getattr(e, "orig", None) or e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _redact(url: str) -> str:
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        creds, host = rest.rsplit("@", 1)
        user = creds.split(":", 1)[0]
        return f"{scheme}://{user}:***@{host}"
    return url


def _is_unique_violation(e: BaseException) -> bool:
    text = str(e).lower()
    return (
        "unique constraint" in text
        or "duplicate key" in text
        or (getattr(e, "sqlstate", None) == "23505")
    )


def _is_fk_violation(e: BaseException) -> bool:
    text = str(e).lower()
    return "foreign key" in text or getattr(e, "sqlstate", None) == "23503"
