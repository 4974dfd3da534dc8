"""Where it is kept: the append-only, hash-chained event journal (SQLite or PostgreSQL).

The public methods open the transaction; private `_` helpers do the work inside it, so appends
compose. The hot path (append, read) speaks DB-API directly: SQLAlchemy owns the schema (through
Alembic) and the connection, not every row.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import hashlib
import os
import re
import sqlite3
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from engine import events as ev
from engine import packing

if TYPE_CHECKING:
    from engine.verify import VerifyReport
from engine.errors import (
    ConcurrencyError,
    InterventionError,
    JournalBusy,
    JournalError,
    NotAJournal,
    RunClosed,
    SchemaTooNew,
    TamperedJournal,
    UnknownRun,
)

HASH_PREFIX = "b2:"
DEFAULT_JOURNAL = Path("recordings") / "journal.db"
MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
# The Alembic revisions in migrations/versions, oldest first (a test checks they agree with
# Alembic's own view). Known statically so that opening a journal at the head revision needs
# neither Alembic nor SQLAlchemy: one SELECT of alembic_version.
KNOWN_REVISIONS = (
    "0001_journal_tables",
    "0002_refuse_rewrites",
    "0003_texts",
    "0004_event_refs",
    "0005_integer_rows",
    "0006_positional_events",
    "0007_packed_rows",
)
HEAD_REVISION = KNOWN_REVISIONS[-1]
# From this revision on events are keyed by (run_key, seq) with kind as a code and the hash as
# its 32 raw bytes (docs/decisions.md, entry 41); journals at older revisions, opened read-only,
# are read in their own layout.
KEYED_REVISION = "0005_integer_rows"
# The `kinds` table's rows (engine/events.py, which also writes them into v5 payloads).
KIND_CODES = ev.KIND_CODES
KIND_NAMES = ev.KIND_NAMES
# A branch's writer learns the strings of this many of its parent's events past the fork point
# (v5): a branch forked early and re-running its parent refers to them instead of repeating.
FAR_EVENTS = 512

#: Fork points whose seeded compactor a journal keeps (attribution forks at a few steps,
#: many branches each).
SEEDED_FORKS = 8
# An event's primary key is run_key * SPAN + seq: a run's events are one range of the rowid
# B-tree (SQLite), found and appended to without a second index.
SPAN = 2**32
#: The longest run id the runs table holds (tables.RunRow.run_id).
RUN_ID_MAX = 64
#: How long a SQLite writer waits for the write lock before it gives up (seconds).
BUSY_TIMEOUT_S = 30


def default_journal_url() -> str:
    """`CAR_JOURNAL` if set, else recordings/journal.db under the current directory."""
    return os.environ.get("CAR_JOURNAL") or str(DEFAULT_JOURNAL)


def _to_url(target: str | os.PathLike[str]) -> str:
    text = os.fspath(target)
    if "://" in text:
        return text
    return f"sqlite:///{Path(text).expanduser().resolve()}"


def is_sqlite_target(target: str | os.PathLike[str]) -> bool:
    """Whether a journal target (a path or a URL) names a SQLite file, before opening it."""
    return _to_url(target).startswith("sqlite")


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


def hash_text(cell: Any) -> str:
    """The public form ("b2:<hex>") of a stored hash cell: 32 raw bytes in the integer-keyed
    layout, already text in the older one."""
    if isinstance(cell, str):
        return cell
    return HASH_PREFIX + bytes(cell).hex()


def hash_cell(text: str) -> bytes:
    """The stored form of a chain hash: the digest's 32 bytes (the prefix names the algorithm,
    which the schema revision fixes)."""
    return bytes.fromhex(text[len(HASH_PREFIX) :])


EventRow = tuple[str, int, int | None, str, int, bytes, str]


#: A run's end state (`after_end`): going on; ended (only its one accusation may follow its
#: RunEnded: decision 49); ended and accused (nothing may follow).
OPEN, ENDED, ACCUSED = 0, 1, 2


def after_end(run_id: str, events: Sequence[ev.Event], state: int, seq: int) -> int:
    """The run's end state after appending `events` at `seq` in end state `state`; RunClosed
    when an event may not follow the run's end. The journal refuses them, as `car verify`
    names them in a journal written otherwise: a second RunEnded would turn a failed run
    `completed`, a step after the end would change what every reader reports."""
    for i, e in enumerate(events):
        if state == ACCUSED or (state == ENDED and not isinstance(e, ev.SuspicionDeclared)):
            kind = ev.kind_of(e)
            if state == ACCUSED and isinstance(e, ev.SuspicionDeclared):
                raise RunClosed(f"run {run_id!r} was already accused: a second {kind} refused")
            raise RunClosed(
                f"run {run_id!r} has ended: {kind} at seq {seq + i} refused (only its one"
                " accusation may follow the end)"
            )
        if state == ENDED:
            state = ACCUSED
        elif isinstance(e, ev.RunEnded):
            state = ENDED
    return state


def chain_rows(
    run_id: str,
    events: Sequence[ev.Event],
    seq: int,
    prev: str,
    payloads: Sequence[bytes] | None = None,
    version: int = ev.SCHEMA_VERSION,
) -> list[EventRow]:
    """The rows that append writes for `events` at `seq` after hash `prev`: payload bytes and
    the hash chain, in column order (run_id, seq, step, kind, version, payload, hash).

    `payloads`, when given, are the events' bytes already produced by `ev.encode_checked`."""
    rows: list[EventRow] = []
    for i, e in enumerate(events):
        payload = payloads[i] if payloads is not None else ev.encode_checked(e)
        kind = ev.kind_of(e)
        h = chain_hash(prev, seq, kind, version, payload)
        rows.append((run_id, seq, e.step, kind, version, payload, h))
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


class UnreadableRun(msgspec.Struct, frozen=True):
    """A runs row that does not read as a run (a cell retyped by hand): its id as text, the
    column at fault, and the TamperedJournal line that every reader of the run fails with."""

    run_id: str
    column: str
    error: str


@dataclass(frozen=True)
class Segment:
    """A run's own slice of a lineage: events of `run_id` with start <= seq < stop."""

    run_id: str
    start: int
    stop: int | None


# A run whose writer has not refreshed its lease for this long is abandoned in the eyes of a
# reader on another host (one on the same host checks the writer's pid directly).
LEASE_TTL = 120.0
HEARTBEAT_EVERY = 20.0


class Lease(msgspec.Struct, frozen=True):
    """Who writes a run: a process (pid and its start time) on a host since a boot."""

    pid: int
    host: str
    boot_id: str
    proc_start: str
    heartbeat: float


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return ""


def _proc_start(pid: int) -> str:
    """The process's start time in clock ticks since boot (Linux), "" where unknown; with the
    pid it names one process even after the pid is reused."""
    stat = _read_text(f"/proc/{pid}/stat")
    if not stat:
        return ""
    # the command name (field 2) may hold spaces; the fields after its ")" are plain
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else ""


@functools.cache
def _boot_id() -> str:
    return _read_text("/proc/sys/kernel/random/boot_id")


#: (pid, its Lease) of the process that asked last: a forked child has another pid
_me: tuple[int, Lease] | None = None


def _this_process() -> Lease:
    """This process as a lease names it (every lease and heartbeat asks; cached per pid).
    The host is the kernel's node name, which is what gethostname() returns."""
    global _me
    pid = os.getpid()
    if _me is None or _me[0] != pid:
        _me = (pid, Lease(pid, os.uname().nodename, _boot_id(), _proc_start(pid), 0.0))
    return _me[1]


def _process_alive(pid: int, proc_start: str) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    if proc_start:
        now = _proc_start(pid)
        if now and now != proc_start:
            return False  # the pid was reused by another process
        if not now and os.path.isdir("/proc"):
            return False
    return True


def _new_run_id() -> str:
    return os.urandom(6).hex()


class Journal:
    """An open journal. Thread-safe for appends (one writer connection guarded by a lock).

    `readonly=True` opens without ever writing: a SQLite file is opened `mode=ro`, nothing is
    migrated, no pragma that changes the file is set, and lazily built snapshots are not stored.
    A file that is not already a journal is refused untouched in either mode."""

    def __init__(
        self,
        target: str | os.PathLike[str] | None = None,
        *,
        upgrade: bool = True,
        create: bool = True,
        readonly: bool = False,
        ids: Callable[[], str] = _new_run_id,
        clock: Callable[[], str] | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.url = _to_url(target if target is not None else default_journal_url())
        self.is_sqlite = self.url.startswith("sqlite")
        self.readonly = readonly
        self._ids = ids
        self._clock = clock or _utc_now
        self._wall = wall
        self._lock = threading.RLock()
        #: a write transaction begun by `_write` for the `_tx` it is about to enter
        self._begun = False
        self._lineage_cache: dict[str, list[Segment]] = {}
        # snapshots (run id, seq, fold version) read and found to decode to their seq's state
        self._sound_snapshots: set[tuple[str, int, int]] = set()
        self._run_keys: dict[str, int] = {}
        # runs rows and events rows never change once committed, so what this journal read of
        # them (outside a write transaction) or committed itself is not read again: a branch
        # looks up its own and its parent's row and the hash at its fork point (bounded;
        # forgetting costs a read)
        self._run_rows: dict[str, RunInfo] = {}
        self._hashes: dict[tuple[str, int], str] = {}
        # fork -> its parent's head when this journal created it (read under the write lock)
        self._fork_heads: dict[str, int] = {}
        # run -> (seq of its last event this writer wrote, that event's chain hash, the
        # run's end state after it: OPEN, ENDED or ACCUSED)
        self._head_hash: dict[str, tuple[int, str, int]] = {}
        self._known_texts: set[bytes] = set()
        self._pending_texts: dict[bytes, bytes] = {}
        self._digests: dict[str, bytes] = {}  # text -> digest, memo of externalize
        self._text_cache: dict[bytes, bytes] = {}
        # the event schema this journal writes: 6, or 5, 4, 3 for tests of older journals
        self.write_version = ev.SCHEMA_VERSION
        self._compactors: dict[str, ev.Compactor] = {}
        # what a branch's writer learns at a fork point, by _fork_key, cloned for each branch
        self._seeded: dict[tuple[Any, ...], ev.Compactor] = {}
        self._recent_rows: dict[tuple[str, int], tuple[int, bytes]] = {}
        self._recent_src: list[Any] | None = None
        self._in_tx = False
        self._snapshot = False  # inside read_snapshot
        # other processes write this SQLite file at the same time (a pool's workers; only
        # ever set on a SQLite journal)
        self.parallel_writers = False
        # v6: the plain (v5) bytes of packed rows, by block (engine/packing.py)
        self._unpacker = packing.Unpacker(self._fetch_own, lock=self._lock)
        # run -> (first seq, plain bytes) of the rows of the append in progress
        self._plains: dict[str, tuple[int, list[bytes]]] = {}
        # (digest, plain text) of the first text this writer stored alone and committed:
        # what its later texts are packed against
        self._text_base: tuple[bytes, bytes] | None = None
        self._text_base_pending: tuple[bytes, bytes] | None = None
        self._resolver = ev.Resolver(self._owner, self._load, self._text, self._parent)
        self._engine: Any = None
        self.revision: str | None = None
        # what the driver raises: turned into JournalError (or TamperedJournal) by _tx/_read
        self._db_errors: tuple[type[Exception], ...] = (sqlite3.Error,)
        if self.is_sqlite:
            self.path: Path | None = Path(self.url.removeprefix("sqlite:///"))
            self._conn: Any = self._open_sqlite(create and not readonly, upgrade)
        else:
            self.path = None
            self._conn = self._open_server(create and not readonly, upgrade and not readonly)
            self._db_errors = (sqlite3.Error, *self._driver_errors())
        # the row layout: integer-keyed from KEYED_REVISION on (the only one written), else
        # the text-keyed one of older journals opened read-only
        self.keyed = self.revision is not None and KNOWN_REVISIONS.index(
            self.revision
        ) >= KNOWN_REVISIONS.index(KEYED_REVISION)
        # the events column that names a row's run, and what it holds (see run_key)
        self.run_col = "run_key" if self.keyed else "run_id"
        # the column whose order is a run's seq order within one run's rows
        self._ord = "id" if self.keyed else "seq"

    # ------------------------------------------------------------------ setup

    def _where(self) -> str:
        return repr(str(self.path)) if self.path is not None else repr(redacted_url(self.url))

    def _open_sqlite(self, create: bool, upgrade: bool) -> sqlite3.Connection:
        path = self.path
        assert path is not None
        try:
            exists = path.exists()
        except OSError as e:  # a name too long, a loop of links ...
            raise JournalError(f"cannot open journal {str(path)!r}: {e.strerror or e}") from None
        if not exists:
            if not create:
                raise JournalError(f"no journal at {str(path)!r}")
            _create_sqlite_journal(path)
        elif path.is_dir():
            raise NotAJournal(f"{str(path)!r} is a directory, not a journal file")
        elif not path.is_file():
            raise NotAJournal(f"{str(path)!r} is not a regular file (a device?), not a journal")
        elif path.stat().st_size == 0:
            raise NotAJournal(
                f"{str(path)!r} is an empty file, not a journal (remove it to create one there)"
            )
        try:
            if self.readonly:
                conn = sqlite3.connect(
                    f"{path.as_uri()}?mode=ro",
                    uri=True,
                    isolation_level=None,
                    timeout=BUSY_TIMEOUT_S,
                    check_same_thread=False,
                )
                conn.execute("PRAGMA query_only=ON")
            else:
                conn = sqlite3.connect(
                    path, isolation_level=None, timeout=BUSY_TIMEOUT_S, check_same_thread=False
                )
            conn.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
            current = self._sqlite_revision(conn)
        except sqlite3.DatabaseError as e:
            with contextlib.suppress(Exception):
                conn.close()
            if _is_busy(e):
                raise JournalBusy(f"cannot open journal {self._where()}: {_first_line(e)}") from e
            if isinstance(e, sqlite3.OperationalError) and (
                "readonly database" in str(e) or "unable to open" in str(e)
            ):
                # a journal whose directory it cannot write in: not a bad file
                raise JournalError(
                    f"cannot open journal {self._where()}: {_first_line(e)} (SQLite keeps its "
                    "-wal and -shm files beside it: make its directory writable, or copy the "
                    "journal to one that is)"
                ) from e
            raise NotAJournal(f"{self._where()} is not a journal: {_first_line(e)}") from e
        try:
            if current is None:
                if not create:
                    raise NotAJournal(f"{self._where()} is an empty database, not a journal")
                # an empty SQLite database (no tables at all): becomes a journal in one
                # transaction; WAL is switched on only once it is one
                _migrate_sqlite(conn, self._where())
            elif current != HEAD_REVISION and upgrade and not self.readonly:
                _migrate_sqlite(conn, self._where())
            if not self.readonly:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=NORMAL")
                conn.execute("PRAGMA foreign_keys=ON")
            self.revision = self._sqlite_revision(conn)
        except sqlite3.Error as e:
            conn.close()
            if _is_busy(e):  # an upgrade waited for the write lock in vain
                raise JournalBusy(f"cannot open journal {self._where()}: {_first_line(e)}") from e
            raise
        except BaseException:
            conn.close()
            raise
        return conn

    def _sqlite_revision(self, conn: sqlite3.Connection) -> str | None:
        """The stored schema revision, read directly (no Alembic on the way in)."""
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        return _revision_of(names, conn.execute, self._where())

    def _open_server(self, create: bool, upgrade: bool) -> Any:
        from sqlalchemy import create_engine
        from sqlalchemy.exc import DatabaseError as SADatabaseError

        try:
            self._engine = create_engine(self.url, pool_pre_ping=True)
        except Exception as e:  # bad URL or missing driver
            raise JournalError(f"cannot use journal URL {redacted_url(self.url)!r}: {e}") from e
        if _holds_nul(self._engine.url):
            # libpq reads its connection string up to a NUL: the user, port and options after
            # it would be dropped and their defaults used - another server, another user
            self._engine.dispose()
            raise JournalError(
                f"cannot use journal URL {redacted_url(self.url)!r}: it holds a NUL character (%00)"
            )
        _quiet_driver_logs()
        refused: tuple[type[BaseException], ...] = (
            SADatabaseError,
            OSError,
            *self._driver_errors(),
        )
        try:
            raw = self._engine.raw_connection()
        except refused as e:
            # the driver's own connection errors reach here unwrapped (psycopg.OperationalError
            # for a refused connection), SQLAlchemy's wrapped ones as DatabaseError
            self._engine.dispose()
            raise JournalError(f"cannot open journal {self._where()}: {_first_line(e)}") from e
        try:
            current = self._server_revision(raw)
            if (current is None and create) or (
                current is not None and current != HEAD_REVISION and upgrade
            ):
                raw.rollback()
                self._migrate_server()
            elif current is None:
                raise NotAJournal(f"{self._where()} holds no journal schema")
            raw.rollback()
            self.revision = self._server_revision(raw)
            raw.rollback()
        except BaseException as e:
            with contextlib.suppress(Exception):
                raw.invalidate()
            self._engine.dispose()
            if isinstance(e, refused) and not isinstance(e, JournalError):
                # connected, but the server refused reading or creating the schema (no CREATE
                # on the schema, a read-only session, a statement timeout...)
                raise JournalError(f"cannot open journal {self._where()}: {_first_line(e)}") from e
            raise
        return raw

    def _driver_errors(self) -> tuple[type[Exception], ...]:
        """The DB-API error base class of the engine's driver (psycopg's for PostgreSQL)."""
        dbapi = getattr(self._engine.dialect, "dbapi", None)
        error = getattr(dbapi, "Error", None)
        return (error,) if isinstance(error, type) and issubclass(error, Exception) else ()

    def _server_revision(self, raw: Any) -> str | None:
        cur = raw.cursor()
        try:
            # pg_tables lists every table; information_schema only those this role may use, so
            # a role without SELECT on a journal's tables was told it "holds no journal schema"
            cur.execute(
                "SELECT tablename FROM pg_catalog.pg_tables WHERE schemaname = current_schema()"
            )
            names = {r[0] for r in cur.fetchall()}

            def run(sql: str) -> Any:
                cur.execute(sql)
                return cur

            return _revision_of(names, run, self._where())
        finally:
            cur.close()

    def _migrate_server(self) -> None:
        """Create or upgrade the schema in one transaction, under an advisory lock so that
        concurrent first opens wait for each other instead of racing on CREATE TABLE."""
        from sqlalchemy import text

        with self._engine.connect() as conn:
            conn.execute(text("SELECT pg_advisory_xact_lock(7203518841)"))
            names = set(conn.dialect.get_table_names(conn))
            current = _revision_of(names, lambda sql: conn.exec_driver_sql(sql), self._where())
            if current != HEAD_REVISION:
                _alembic_upgrade(conn)
            conn.commit()

    def schema_revision(self) -> str | None:
        return self.revision

    def close(self) -> None:
        """Close the connection once no thread uses it: the lease heartbeat's thread may be
        inside a transaction on it, and closing a sqlite3 connection under a statement that
        another thread runs crashes the process (a segfault, not an exception). Afterwards
        that thread gets an error, which ends its beating for this journal."""
        with self._lock, contextlib.suppress(Exception):
            if self.is_sqlite:
                self._conn.close()
            else:
                # closed outright, not returned to the pool: the pool's reset (a ROLLBACK)
                # fails on a connection the server dropped or one an interrupt left
                # mid-command, and is logged with a traceback; the server rolls back whatever
                # was left open when the connection closes
                self._conn.invalidate()
        if self._engine is not None:
            self._engine.dispose()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --------------------------------------------------------- low-level SQL

    def _q(self, sql: str) -> str:
        return sql if self.is_sqlite else sql.replace("?", "%s")

    @contextlib.contextmanager
    def _tx(self) -> Iterator[Any]:
        """One write transaction on the writer connection (BEGIN IMMEDIATE on SQLite, begun
        by `_hold_for_write` or here)."""
        begun = self._hold_for_write()
        try:
            try:
                cur = self._conn.cursor()
            except self._db_errors as e:  # the connection is gone
                raise self._driver_failure(e, "write to") from e
            self._in_tx = True
            try:
                if self.is_sqlite and not begun:
                    if self.parallel_writers:
                        self._poll_begin(let_go=False)
                    else:
                        cur.execute("BEGIN IMMEDIATE")
                yield cur
                if self.is_sqlite:
                    cur.execute("COMMIT")
                else:
                    self._conn.commit()
            except BaseException as e:
                with contextlib.suppress(Exception):
                    if self.is_sqlite:
                        cur.execute("ROLLBACK")
                    else:
                        self._conn.rollback()
                # the specific mappings (ConcurrencyError, UnknownRun, ...) were made inside;
                # any other driver error (a read-only file, a full disk) is one JournalError
                if isinstance(e, self._db_errors) and not isinstance(e, JournalError):
                    raise self._driver_failure(e, "write to") from e
                raise
            finally:
                self._in_tx = False
                cur.close()
        finally:
            self._lock.release()

    def _hold_for_write(self) -> bool:
        """Take this journal's thread lock for a write transaction; whether the transaction
        was begun too (by an enclosing `_write`, or here).

        On SQLite the wait for the database's write lock, which another process may hold up
        to the busy timeout, is made with the thread lock let go between tries (every 50 us
        to 1 ms): this journal's readers in other threads (the server's requests) read on
        meanwhile instead of waiting for the other process as well. A thread that holds the
        thread lock already cannot let it go: it begins under it, as before (`_tx`)."""
        if self._begun:
            # `_write` began the transaction, holding the lock it now takes once more
            self._lock.acquire()
            self._begun = False
            return True
        owned = self._lock._is_owned()  # type: ignore[attr-defined]
        self._lock.acquire()
        if not self.is_sqlite or owned:
            return False
        try:
            self._poll_begin(let_go=True)
        except BaseException as e:
            self._lock.release()
            if isinstance(e, self._db_errors):
                raise self._driver_failure(e, "write to") from e
            raise
        return True

    def _poll_begin(self, *, let_go: bool) -> None:
        """BEGIN IMMEDIATE on SQLite, polling for the write lock every 50 us to 1 ms (SQLite's
        own busy handler first waits 1 ms, then 2, 5, 10..., where a branch's transaction holds
        the lock for a tenth of that) until BUSY_TIMEOUT_S, then its SQLITE_BUSY error. With
        `let_go`, the thread lock, held once by the caller, is let go while it waits."""
        delay = 0.00005
        deadline = time.monotonic() + BUSY_TIMEOUT_S
        while True:
            busy = self._try_begin()
            if busy is None:
                return
            if time.monotonic() >= deadline:
                raise busy
            if let_go:
                self._lock.release()
            try:
                time.sleep(delay)
            finally:
                if let_go:
                    self._lock.acquire()
            delay = min(delay * 2, 0.001)

    def _try_begin(self) -> sqlite3.OperationalError | None:
        """BEGIN IMMEDIATE without waiting; the SQLITE_BUSY error when another connection
        holds the write lock (any other error is raised), None once begun."""
        cur = self._conn.cursor()
        try:
            cur.execute("PRAGMA busy_timeout=0")
            try:
                cur.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as e:
                # SQLITE_BUSY, or one of its extended codes (BUSY_RECOVERY, ...)
                if e.sqlite_errorcode & 0xFF != sqlite3.SQLITE_BUSY:
                    raise
                return e
            finally:
                cur.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
            return None
        finally:
            cur.close()

    @contextlib.contextmanager
    def _read(self) -> Iterator[Any]:
        with self._lock:
            try:
                cur = self._conn.cursor()
            except self._db_errors as e:  # the connection is gone
                raise self._driver_failure(e, "read") from e
            # inside a PostgreSQL snapshot a failed read must not abort the snapshot's
            # transaction (the reads after it would all fail): each read is a savepoint
            guard = self._snapshot and not self.is_sqlite and not self._in_tx
            failed = False
            try:
                if guard:
                    cur.execute("SAVEPOINT car_read")
                yield cur
            except self._db_errors as e:
                failed = True
                if guard:
                    with contextlib.suppress(*self._db_errors):
                        cur.execute("ROLLBACK TO SAVEPOINT car_read")
                raise self._driver_failure(e, "read") from e
            except BaseException:
                failed = True
                raise
            finally:
                with contextlib.suppress(*self._db_errors):
                    cur.close()
                # a read inside the writer's transaction (a window, a seeding) or a snapshot
                # must not end it
                if not self.is_sqlite and not self._in_tx and not self._snapshot:
                    try:
                        self._conn.rollback()
                    except self._db_errors as e:
                        # the error already on its way (a JournalError, a Ctrl-C) wins
                        if not failed:
                            raise self._driver_failure(e, "read") from e

    @contextlib.contextmanager
    def read_snapshot(self) -> Iterator[None]:
        """Every read inside sees the journal as one moment left it (decision 51): a check
        of the whole journal while other processes append to it must not meet a run's events
        without its runs row, or a text without the rows that use it. One read transaction
        on this journal's connection (SQLite: BEGIN and a first read; PostgreSQL: REPEATABLE
        READ), held with its lock: this journal's other threads wait, other processes go on
        writing. Nested, or inside a write transaction: the outer one."""
        with self._lock:
            if self._snapshot or self._in_tx:
                yield
                return
            cur = self._conn.cursor()
            try:
                if self.is_sqlite:
                    cur.execute("BEGIN")
                    # a deferred transaction takes its snapshot at its first read
                    cur.execute("SELECT count(*) FROM sqlite_master").fetchall()
                else:
                    self._conn.rollback()
                    cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                    cur.execute("SELECT 1").fetchall()
            except self._db_errors as e:
                with contextlib.suppress(*self._db_errors):
                    if self.is_sqlite:
                        cur.execute("ROLLBACK")
                    else:
                        self._conn.rollback()
                raise self._driver_failure(e, "read") from e
            finally:
                cur.close()
            self._snapshot = True
            try:
                yield
            finally:
                self._snapshot = False
                with contextlib.suppress(*self._db_errors):
                    if self.is_sqlite:
                        self._conn.execute("ROLLBACK")
                    else:
                        self._conn.rollback()

    def _driver_failure(self, e: Exception, action: str) -> JournalError:
        """The one-line error for a driver error: TamperedJournal where the stored bytes are
        bad (a damaged file, a bytes cell retyped as text that is not UTF-8), JournalBusy
        where another writer held the lock too long (worth trying again), else JournalError
        naming the journal and the driver's first line."""
        first = _first_line(e)
        if _is_busy(e):
            return JournalBusy(f"cannot {action} journal {self._where()}: {first}")
        retyped = _UNDECODABLE.search(first)
        if retyped is not None:
            return self._retyped(retyped.group(1))
        code = getattr(e, "sqlite_errorcode", None)
        if isinstance(code, int) and code & 0xFF in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB):
            return TamperedJournal(
                f"journal {self._where()} is damaged: {first} (see `car verify`)"
            )
        return JournalError(f"cannot {action} journal {self._where()}: {first}")

    def _retyped(self, column: str) -> TamperedJournal:
        """TamperedJournal for a bytes column that a reader found holding text that is not
        UTF-8, naming the first such cell (SQLite keeps whatever type an UPDATE gives); for a
        text column of `runs`, the run whose cell holds bytes that are not UTF-8 text."""
        if column in _RUN_TEXT_COLUMNS:
            rid = None
            with contextlib.suppress(Exception):
                rid = self._first_undecodable_run(column)
            which = f"the {column} cell of run {rid}" if rid else f"a {column!r} cell of runs"
            return TamperedJournal(
                f"{which} in {self._where()} holds bytes that are not UTF-8 text (see `car verify`)"
            )
        cell = None
        with contextlib.suppress(Exception):
            cell = self._first_retyped(column)
        if cell is None:
            return TamperedJournal(
                f"journal {self._where()} holds text that is not UTF-8 in a {column!r} cell,"
                " where bytes belong (see `car verify`)"
            )
        return TamperedJournal(
            f"{cell} in {self._where()} is stored as text, not as bytes (see `car verify`)"
        )

    def _first_undecodable_run(self, column: str) -> str | None:
        """The id (shown) of the first run whose text cell `column` is not UTF-8."""
        cur = self._conn.cursor()
        saved = self._conn.text_factory
        self._conn.text_factory = bytes
        try:
            for rid, cell in cur.execute(f"SELECT run_id, {column} FROM runs ORDER BY run_id"):
                try:
                    if isinstance(cell, bytes):
                        cell.decode("utf-8")
                except UnicodeDecodeError:
                    return repr(_as_text(rid))
            return None
        finally:
            self._conn.text_factory = saved
            cur.close()

    def _first_retyped(self, column: str) -> str | None:
        """The first cell of `column` that is not stored as bytes, named (None if none)."""
        cur = self._conn.cursor()
        try:
            if column in ("payload", "hash") and (column == "payload" or self.keyed):
                if self.keyed:
                    sql = (
                        f"SELECT r.run_id, e.seq FROM events e LEFT JOIN runs r"
                        f" ON r.run_key = e.run_key WHERE typeof(e.{column}) != 'blob'"
                        " ORDER BY e.id LIMIT 1"
                    )
                else:
                    sql = (
                        f"SELECT run_id, seq FROM events WHERE typeof({column}) != 'blob'"
                        " ORDER BY run_id, seq LIMIT 1"
                    )
                row = cur.execute(sql).fetchone()
                if row is not None:
                    return f"the {column} cell of event {row[1]} of run {row[0]!r}"
            elif column in _RETYPED_CELLS:
                sql, name = _RETYPED_CELLS[column]
                row = cur.execute(sql).fetchone()
                if row is not None:
                    return name.format(*row)
            return None
        finally:
            cur.close()

    def _bytes_cell(self, cell: Any, column: str, run_id: str, seq: Any) -> bytes:
        """A payload cell's bytes; TamperedJournal for a cell retyped (to valid UTF-8 text)."""
        if isinstance(cell, bytes):
            return cell
        if isinstance(cell, bytearray | memoryview):
            return bytes(cell)
        raise TamperedJournal(
            f"the {column} cell of event {seq} of run {run_id!r} in {self._where()} is stored"
            f" as {_sql_type(cell)}, not as bytes (see `car verify`)"
        )

    def _hash_cell(self, cell: Any, run_id: str, seq: Any) -> str:
        """The public form of a row's hash cell (see `hash_text`); TamperedJournal for a cell
        that is not this layout's: 32 bytes (keyed), text (older)."""
        if self.keyed:
            if isinstance(cell, bytes | bytearray | memoryview) and len(cell) == 32:
                return HASH_PREFIX + bytes(cell).hex()
            what = _sql_type(cell)
            if isinstance(cell, bytes | bytearray | memoryview):
                what = f"{len(cell)} bytes"
            raise TamperedJournal(
                f"the hash cell of event {seq} of run {run_id!r} in {self._where()} is {what},"
                " not a 32-byte digest (see `car verify`)"
            )
        if isinstance(cell, str):
            return cell
        raise TamperedJournal(
            f"the hash cell of event {seq} of run {run_id!r} in {self._where()} is stored as"
            f" {_sql_type(cell)}, not as text (see `car verify`)"
        )

    def _step_cell(self, cell: Any, run_id: str, seq: Any) -> int | None:
        if cell is None or type(cell) is int:
            return cell  # type: ignore[no-any-return]
        raise TamperedJournal(
            f"the step cell of event {seq} of run {run_id!r} in {self._where()} holds"
            f" {cell!r}, not an integer (see `car verify`)"
        )

    def _int_cell(self, cell: Any, column: str, run_id: Any, seq: Any) -> int:
        """A seq or version cell as the integer it must be; TamperedJournal for one retyped by
        hand (text, a real) or out of the 32 bits the chain packs it in."""
        if type(cell) is int and 0 <= cell < SPAN:
            return cell
        raise TamperedJournal(
            f"the {column} cell of event {seq} of run {_as_text(run_id)!r} in {self._where()}"
            f" holds {cell!r}, not an integer (see `car verify`)"
        )

    def _run_info(self, row: Sequence[Any]) -> RunInfo:
        """A runs row as RunInfo; TamperedJournal for a cell of the wrong type or a
        created_at that is no ISO 8601 time (what export and the views read it as)."""
        problem = _run_problem(row)
        if problem is not None:
            raise self._tampered_run(row[0], problem)
        return RunInfo(*row)

    def _tampered_run(self, rid: Any, problem: tuple[str, Any, str]) -> TamperedJournal:
        col, value, expected = problem
        return TamperedJournal(
            f"run {rid!r} in {self._where()} has a {col} cell {value!r}, not {expected}"
            " (see `car verify`)"
        )

    def _select_runs(
        self, where: str = "", args: Sequence[Any] = (), *, lenient: bool = False
    ) -> tuple[list[RunInfo], list[UnreadableRun]]:
        """The runs rows matching `where`, oldest first. A row that does not read as a run
        (also one holding text that is not UTF-8) is TamperedJournal, or with `lenient` left
        out and named in the second list."""
        with self._read() as cur:
            saved = self._conn.text_factory if lenient and self.is_sqlite else None
            if saved is not None:
                # a cell of text that is not UTF-8 comes back as its bytes (a bad cell of its
                # row) instead of failing the whole query
                self._conn.text_factory = _text_or_bytes
            try:
                cur.execute(
                    self._q(
                        "SELECT run_id, parent_run_id, fork_seq, root_run_id, scenario,"
                        f" created_at, label FROM runs{where} ORDER BY created_at, run_id"
                    ),
                    tuple(args),
                )
                rows = cur.fetchall()
            finally:
                if saved is not None:
                    self._conn.text_factory = saved
        if not lenient:
            return [self._run_info(r) for r in rows], []
        infos: list[RunInfo] = []
        bad: list[UnreadableRun] = []
        for r in rows:
            problem = _run_problem(r)
            if problem is None:
                infos.append(RunInfo(*r))
            else:
                error = str(self._tampered_run(r[0], problem))
                bad.append(UnreadableRun(_as_text(r[0]), problem[0], error))
        return infos, bad

    # ------------------------------------------------------------------ runs

    def new_run_id(self) -> str:
        """A fresh run id, for a caller that must know it before `create_run` returns (to
        close the run if an interrupt comes out of the creating transaction's commit)."""
        return self._ids()

    def create_run(
        self,
        scenario: str,
        *,
        parent_run_id: str | None = None,
        fork_seq: int | None = None,
        label: str = "",
        run_id: str | None = None,
        events: Sequence[ev.Event] = (),
        payloads: Sequence[bytes] | None = None,
    ) -> str:
        """Insert a runs row. A fork is a run with a parent pointer: O(1), nothing copied.

        With `events`, the run's first events are written in the same transaction: a run
        written whole (an imported trace, a detection's record) exists with its events or not
        at all, never as an empty run that an interrupt or a busy journal left between two
        transactions. Every event is encoded and checked before anything is written
        (`payloads`: that done already, by `ev.encode_checked`)."""
        rid = run_id or self._ids()
        self._writable()
        made: dict[str, Any] = {}

        def insert(cur: Any) -> None:
            made.update(self._insert_run(cur, rid, scenario, parent_run_id, fork_seq, label))

        if events:
            if payloads is None:
                payloads = [ev.encode_checked(e) for e in events]
            self._write(rid, events, None, payloads, None, opening=insert)
        else:
            with self._tx() as cur:
                insert(cur)
        info, key, head = made["info"], made["key"], made["head"]
        if type(info.created_at) is str:  # what reading the row back gives
            self._remember_run(info)
            if key:
                self._run_keys[rid] = int(key)
        if head is not None:
            if len(self._fork_heads) >= 50_000:
                self._fork_heads.clear()
            self._fork_heads[rid] = head
        return rid

    def _insert_run(
        self,
        cur: Any,
        rid: str,
        scenario: str,
        parent_run_id: str | None,
        fork_seq: int | None,
        label: str,
    ) -> dict[str, Any]:
        """The runs row and its writer lease, in the transaction of `cur`; what the caller
        remembers once it commits: the row, its run_key (SQLite), the parent's head (a fork)."""
        head: int | None = None
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
        created = self._clock()
        cur.execute(
            self._q(
                "INSERT INTO runs (run_id, parent_run_id, fork_seq, root_run_id, scenario,"
                " created_at, label) VALUES (?, ?, ?, ?, ?, ?, ?)"
            ),
            (rid, parent_run_id, fork_seq, root, scenario, created, label),
        )
        # SQLite's run_key is the rowid (a trigger's inserts do not change it); the next
        # insert does
        key = cur.lastrowid if self.is_sqlite and self.keyed else None
        # the creating process is the run's writer until a recorder takes over or it ends
        self._put_lease(cur, rid)
        info = RunInfo(rid, parent_run_id, fork_seq, root, scenario, created, label)
        return {"info": info, "key": key, "head": head}

    def _remember_run(self, info: RunInfo) -> None:
        if len(self._run_rows) >= 50_000:
            self._run_rows.clear()
        self._run_rows[info.run_id] = info

    def fork(self, parent_run_id: str, fork_seq: int, *, label: str = "") -> str:
        """A child run that shares the parent's events with seq < fork_seq."""
        info = self.run(parent_run_id)
        return self.create_run(
            info.scenario, parent_run_id=info.run_id, fork_seq=fork_seq, label=label
        )

    def _run_row(self, cur: Any, run_id: str) -> RunInfo:
        known = self._run_rows.get(run_id)
        if known is not None:
            return known
        if "\x00" in run_id:
            # no run id holds NUL, and PostgreSQL refuses it in a text parameter (a
            # DataError, not "no such run"): whatever holds it names no run
            raise UnknownRun(f"unknown run id {_clipped(run_id)!r} (see `car runs`)")
        key = ", run_key" if self.keyed else ""
        cur.execute(
            self._q(
                "SELECT run_id, parent_run_id, fork_seq, root_run_id, scenario, created_at, label"
                f"{key} FROM runs WHERE run_id = ?"
            ),
            (run_id,),
        )
        row = cur.fetchone()
        if row is not None and self.keyed:
            self._run_keys[row[0]] = int(row[7])
            row = row[:7]
        if row is None:
            found: list[str] = []
            # no run id is longer (runs.run_id holds 64): nothing to look up as a prefix
            if run_id and len(run_id) <= RUN_ID_MAX:
                # a prefix is taken as written: LIKE's wildcards in it match only themselves
                literal = run_id.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
                cur.execute(
                    self._q(
                        "SELECT run_id FROM runs WHERE run_id LIKE ? ESCAPE '\\'"
                        " ORDER BY run_id LIMIT 3"
                    ),
                    (literal + "%",),
                )
                found = [r[0] for r in cur.fetchall()]
            if len(found) == 1:
                return self._run_row(cur, found[0])
            if len(found) > 1:
                raise UnknownRun(f"run id prefix {run_id!r} is ambiguous: {found!r}")
            raise UnknownRun(f"unknown run id {_clipped(run_id)!r} (see `car runs`)")
        info = self._run_info(row)
        if not self._in_tx:  # committed: only create_run inserts runs rows
            self._remember_run(info)
        return info

    def _key(self, cur: Any, run_id: str) -> Any:
        """What the events rows of run `run_id` hold in `run_col`: its integer run_key
        (looked up once: runs rows are immutable), or the run id itself in the older layout.
        UnknownRun when the run has no row."""
        if not self.keyed:
            return run_id
        key = self._run_keys.get(run_id)
        if key is None:
            cur.execute(self._q("SELECT run_key FROM runs WHERE run_id = ?"), (run_id,))
            row = cur.fetchone()
            if row is None:
                raise UnknownRun(f"unknown run id {run_id!r} (see `car runs`)")
            key = self._run_keys[run_id] = int(row[0])
        return key

    def _span(self, cur: Any, run_id: str, lo: int, hi: int | None) -> tuple[str, list[Any]]:
        """A WHERE clause (and its arguments) for the events of run `run_id` (its own rows)
        with lo <= seq < hi: a range of the primary key in the keyed layout."""
        key = self._key(cur, run_id)
        if self.keyed:
            base = key * SPAN
            top = SPAN if hi is None else max(lo, min(hi, SPAN))
            return "id >= ? AND id < ?", [base + lo, base + top]
        if hi is None:
            return "run_id = ? AND seq >= ?", [key, lo]
        return "run_id = ? AND seq >= ? AND seq < ?", [key, lo, hi]

    def own_hashes(self, run_id: str, start: int = 0) -> list[tuple[int, str]]:
        """(seq, chain hash) of the run's own events from `start` on, in seq order."""
        with self._read() as cur:
            where, args = self._span(cur, run_id, start, None)
            cur.execute(
                self._q(f"SELECT seq, hash FROM events WHERE {where} ORDER BY {self._ord}"), args
            )
            return [
                (self._int_cell(r[0], "seq", run_id, r[0]), self._hash_cell(r[1], run_id, r[0]))
                for r in cur.fetchall()
            ]

    def run_key(self, run_id: str) -> Any:
        """The value of `run_col` in the events rows of this exact run id (for tools that
        query the store itself, like `engine.anchor`)."""
        with self._read() as cur:
            return self._key(cur, run_id)

    def _kind(self, cell: Any, run_id: str, seq: int) -> str:
        """An event kind by its stored cell (a code, or text in the older layout)."""
        if isinstance(cell, str):
            return cell
        name = KIND_NAMES.get(cell)
        if name is None:
            raise TamperedJournal(
                f"event {seq} of run {run_id!r} in {self._where()} has an unknown kind code"
                f" {cell!r} (see `car verify`)"
            )
        return name

    def kind_cell(self, kind: str) -> Any:
        """What the events table holds for an event kind in this journal's layout."""
        return KIND_CODES[kind] if self.keyed else kind

    def run(self, run_id: str) -> RunInfo:
        """The run with this id or unique id prefix; UnknownRun otherwise."""
        with self._read() as cur:
            return self._run_row(cur, run_id)

    def runs(self) -> list[RunInfo]:
        """Every run, oldest first; TamperedJournal for a row that does not read (a listing
        that must show the others reads `listing`)."""
        return self._select_runs()[0]

    def children(self, run_id: str) -> list[RunInfo]:
        """The runs forked from this one, oldest first."""
        return self._select_runs(" WHERE parent_run_id = ?", (run_id,))[0]

    def listing(self) -> tuple[list[RunInfo], list[UnreadableRun]]:
        """For a listing of runs: every run that reads, oldest first, and every runs row that
        does not (a cell retyped by hand), in the same order; one bad row does not hide the
        others. Any reader that addresses such a run still fails with TamperedJournal."""
        return self._select_runs(lenient=True)

    def lineage(self, run_id: str) -> list[Segment]:
        """Root-first segments whose events make up this run's history."""
        cached = self._lineage_cache.get(run_id)
        if cached is not None:
            return cached
        with self._read() as cur:
            chain: list[RunInfo] = [self._run_row(cur, run_id)]
            seen = {chain[0].run_id}
            while chain[-1].parent_run_id is not None:
                parent = chain[-1].parent_run_id
                if parent in seen:
                    # runs rows are written once and a parent before its branch: only an
                    # altered journal loops (it walked forever, its memory growing)
                    raise TamperedJournal(
                        f"run {chain[0].run_id!r} has a parent cycle through run {parent!r}: "
                        "the journal was altered (see `car verify`)"
                    )
                seen.add(parent)
                chain.append(self._run_row(cur, parent))
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
        where, args = self._span(cur, run_id, 0, None)
        cur.execute(
            self._q(f"SELECT seq FROM events WHERE {where} ORDER BY {self._ord} DESC LIMIT 1"),
            args,
        )
        row = cur.fetchone()
        if row is not None and row[0] is not None:
            return self._int_cell(row[0], "seq", run_id, row[0]) + 1
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

    def hash_at(self, run_id: str, seq: int) -> str:
        """The chain hash of event `seq` of the run's history ("" before the first event)."""
        with self._read() as cur:
            return self._hash_at(cur, run_id, seq)

    def _hash_at(self, cur: Any, run_id: str, seq: int) -> str:
        if seq < 0:
            return ""
        owner = self._owner(run_id, seq)
        known = self._hashes.get((owner, seq))
        if known is not None:
            return known
        where, args = self._span(cur, owner, seq, seq + 1)
        cur.execute(self._q(f"SELECT hash FROM events WHERE {where}"), args)
        row = cur.fetchone()
        if row is None:
            raise JournalError(f"run {run_id!r} has no event at seq {seq}")
        found = self._hash_cell(row[0], owner, seq)
        if not self._in_tx:  # a committed row
            if len(self._hashes) >= 4096:
                self._hashes.clear()
            self._hashes[(owner, seq)] = found
        return found

    def _parent(self, run_id: str) -> str | None:
        """The run `run_id` forked from (None for a root)."""
        segments = self.lineage(run_id)
        return segments[-2].run_id if len(segments) > 1 else None

    def _owner(self, run_id: str, seq: int) -> str:
        for seg in reversed(self.lineage(run_id)):
            if seq >= seg.start:
                return seg.run_id
        return self.lineage(run_id)[0].run_id

    def append(
        self,
        run_id: str,
        events: Sequence[ev.Event],
        expected_seq: int | None = None,
        *,
        payloads: Sequence[bytes] | None = None,
    ) -> int:
        """Append one step's events atomically; returns the new head.

        `expected_seq` is the seq the caller believes is next (optimistic concurrency): a writer
        that lost the race gets ConcurrencyError and nothing of its step is written. Every event
        must read back as stored (`ev.encode_checked`), else JournalError and nothing is written.
        A `RunEnded` releases the run's writer lease in the same transaction."""
        if not events:
            return expected_seq if expected_seq is not None else self.head(run_id)
        self._writable()
        if payloads is None:
            payloads = [ev.encode_checked(e) for e in events]
        try:
            if self.write_version >= 4 and expected_seq and run_id not in self._compactors:
                self._warm_compactor(run_id, expected_seq)
            ready = self._prepare(run_id, events, expected_seq, payloads)
            return self._write(run_id, events, expected_seq, payloads, ready)
        except BaseException:
            # whatever ended the append (a lost race, Ctrl-C in the middle of compacting or
            # of the commit): what this writer noted of the step may name rows that are not
            # there, and a retry (the recorder's closing flush) would refer to them
            self._forget(run_id)
            raise

    def _forget(self, run_id: str) -> None:
        """Drop what this writer remembers of a run's rows after an append that may not have
        committed: its compactor, packing plains and cached head hash. A cold writer costs
        bytes (it writes inline and reads the head back), never correctness."""
        self._compactors.pop(run_id, None)
        self._plains.pop(run_id, None)
        self._head_hash.pop(run_id, None)

    def _write(
        self,
        run_id: str,
        events: Sequence[ev.Event],
        expected_seq: int | None,
        payloads: Sequence[bytes],
        ready: tuple[list[EventRow], dict[bytes, bytes], int] | None,
        opening: Callable[[Any], None] | None = None,
    ) -> int:
        """The append's transaction (`opening(cur)` first in it: a new run's row), and what
        this writer learns from it once it commits; the new head."""
        # the transaction and what this writer learns from it, one thread at a time: what a
        # transaction leaves pending (texts, the texts' base) is another thread's otherwise.
        # The lock is taken with the transaction begun (`_hold_for_write`: waiting for another
        # process's write lock, it lets this journal's readers in)

        try:
            self._begun = self._hold_for_write()
        except BaseException:
            self._forget(run_id)  # the writer's memory may name events of this step
            raise
        try:
            self._pending_texts = {}
            try:
                with self._tx() as cur:
                    if opening is not None:
                        opening(cur)
                    if ready is None:
                        head = self._append(cur, run_id, events, expected_seq, payloads)
                    else:
                        head = self._insert(cur, run_id, *ready)
                    if any(isinstance(e, ev.RunEnded) for e in events):
                        self._release_lease(cur, run_id)
            except BaseException:
                self._forget(run_id)
                self._text_base_pending = None  # under the lock: its transaction's alone
                raise
            finally:
                pending, self._pending_texts = self._pending_texts, {}
            # only texts that are committed may be skipped next time, or be packed against
            self._known_texts.update(pending)
            if self._text_base is None:
                self._text_base = self._text_base_pending
            self._text_base_pending = None
            first, plains = self._plains.pop(run_id, (0, []))
            for i, plain in enumerate(plains):
                self._unpacker.remember(run_id, first + i, plain)
        finally:
            if self._begun:  # begun, but never reached its `_tx`
                self._begun = False
                with contextlib.suppress(Exception):
                    self._conn.execute("ROLLBACK")
            self._lock.release()
        return head

    def _append(
        self,
        cur: Any,
        run_id: str,
        events: Sequence[ev.Event],
        expected_seq: int | None,
        payloads: Sequence[bytes] | None = None,
    ) -> int:
        """Append one step inside the transaction (`cur`), at `expected_seq` or, without it,
        at the head read under the write lock."""
        seq = expected_seq if expected_seq is not None else self._head(cur, run_id)
        return self._insert(cur, run_id, *self._rows(run_id, events, seq, payloads, cur))

    def _prepare(
        self,
        run_id: str,
        events: Sequence[ev.Event],
        expected_seq: int | None,
        payloads: Sequence[bytes] | None,
    ) -> tuple[list[EventRow], dict[bytes, bytes], int] | None:
        """A step's rows hashed and compacted before its write transaction, so that the
        write lock (one per SQLite file, shared by parallel branches) is held for the inserts
        alone; None when the writer does not name the seq (then the head is read under the
        lock, in `_append`).

        Nothing read here can change under the writer: rows are never rewritten, and a writer
        that lost the race for `expected_seq` fails its insert (ConcurrencyError) as before."""
        if expected_seq is None:
            return None
        return self._rows(run_id, events, expected_seq, payloads)

    def _rows(
        self,
        run_id: str,
        events: Sequence[ev.Event],
        seq: int,
        payloads: Sequence[bytes] | None,
        cur: Any = None,
    ) -> tuple[list[EventRow], dict[bytes, bytes], int]:
        """The step's rows at `seq`, chained to the hash before it (this writer's cached head
        hash, else the row, read with `cur` or a read cursor of its own), in their stored
        form; the long texts they name; and the run's end state after them. RunClosed when
        the run has ended and the step is not its one accusation."""
        cached = self._head_hash.get(run_id)
        if cached is not None and cached[0] == seq - 1:
            prev, state = cached[1], cached[2]
        elif seq <= 0:
            prev, state = "", OPEN
        else:
            if not self.lineage(run_id):
                raise UnknownRun(f"unknown run id {run_id!r}")
            if cur is None:
                with self._read() as c:
                    prev = self._hash_at(c, run_id, seq - 1)
                    state = self._end_state(c, run_id, seq)
            else:
                prev = self._hash_at(cur, run_id, seq - 1)
                state = self._end_state(cur, run_id, seq)
        state = after_end(run_id, events, state, seq)
        rows = chain_rows(run_id, events, seq, prev, payloads, self.write_version)
        if self.write_version >= 4:
            return (*self._compact(run_id, rows), state)
        return (*self._store_texts(rows), state)

    def _end_state(self, cur: Any, run_id: str, seq: int) -> int:
        """The run's end state before its event `seq` (read from its last two events): the
        history before a branch's fork point is its parent's, which had not ended there."""
        if self._owner(run_id, seq - 1) != run_id:
            return OPEN
        where, args = self._span(cur, run_id, max(0, seq - 2), seq)
        cur.execute(self._q(f"SELECT seq, kind FROM events WHERE {where}"), args)
        kinds = {
            self._int_cell(r[0], "seq", run_id, r[0]): self._kind(r[1], run_id, r[0])
            for r in cur.fetchall()
        }
        last = kinds.get(seq - 1)
        if last == "run_ended":
            return ENDED
        if last == "suspicion_declared" and kinds.get(seq - 2) == "run_ended":
            return ACCUSED
        return OPEN

    def _insert(
        self, cur: Any, run_id: str, rows: list[EventRow], texts: dict[bytes, bytes], state: int
    ) -> int:
        """Write a step's stored rows and the new texts they refer to (in the append's
        transaction); the new head. `state`: the run's end state after them."""
        self._insert_texts(cur, {d: b for d, b in texts.items() if d not in self._known_texts})
        seq = rows[-1][1] + 1
        prev = rows[-1][6]
        key = self._key(cur, run_id)
        try:
            codes = KIND_CODES
            base = key * SPAN
            cells = [
                (base + r[1], key, r[1], r[2], codes[r[3]], r[4], r[5], hash_cell(r[6]))
                for r in rows
            ]
        except KeyError as e:
            raise JournalError(f"event kind {e.args[0]!r} has no code in this journal") from e
        try:
            cur.executemany(
                self._q(
                    "INSERT INTO events (id, run_key, seq, step, kind, version, payload, hash)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
                ),
                cells,
            )
        except Exception as e:
            # (`_write` forgets what this writer noted of the step)
            if _is_unique_violation(e):
                raise ConcurrencyError(
                    f"run {run_id!r}: seq {rows[0][1]} was already written by another writer"
                ) from e
            if _is_fk_violation(e):
                raise UnknownRun(f"unknown run id {run_id!r} (see `car runs`)") from e
            failed = JournalBusy if _is_busy(e) else JournalError
            raise failed(
                f"append to run {run_id!r} in {self._where()} failed: {_first_line(e)}"
            ) from e
        self._head_hash[run_id] = (seq - 1, prev, state)
        return seq

    def _compact(
        self, run_id: str, rows: list[EventRow]
    ) -> tuple[list[EventRow], dict[bytes, bytes]]:
        """Rows in their stored v4/v5 form (entries 37, 42): strings seen before in the run's
        history as back-references, requests as deltas of the agent's previous request; and
        the long texts they name, for `texts`. The hashes stay those of the full payloads."""
        comp = self._compactors.get(run_id)
        if comp is None:
            if len(self._compactors) > 64:
                self._compactors.clear()
            comp = self._compactors[run_id] = ev.Compactor(positional=self.write_version >= 5)
            if rows[0][1] > 0:
                self._seed(comp, run_id, rows[0][1])
        # (a failure from here on: `append` forgets the compactor, which may have noted rows)
        out = [(r[0], r[1], r[2], r[3], r[4], comp.compact(r[1], r[5]), r[6]) for r in rows]
        texts, comp.texts = comp.texts, {}
        if self.write_version >= 6:
            plains = [r[5] for r in out]
            packed = self._unpacker.pack_rows(run_id, rows[0][1], plains)
            self._plains[run_id] = (rows[0][1], plains)
            out = [(*r[:5], p, r[6]) for r, p in zip(out, packed, strict=True)]
        return out, texts

    def _warm_compactor(self, run_id: str, seq: int) -> None:
        """Learn a run's history before its first append at `seq` (a branch's first step
        reads and decodes up to 256 earlier events): outside the write transaction, so that
        writers in other processes do not wait for it. The events before `seq` never change;
        an append that then fails drops what was learnt, as _compact does."""
        if len(self._compactors) > 64:
            self._compactors.clear()
        key = self._fork_key(run_id, seq)
        base = self._seeded.get(key) if key is not None else None
        if base is None:
            base = ev.Compactor(positional=self.write_version >= 5)
            self._seed(base, run_id, seq)
            if key is None:
                self._compactors[run_id] = base
                return
            if len(self._seeded) >= SEEDED_FORKS:
                del self._seeded[next(iter(self._seeded))]
            self._seeded[key] = base
        self._compactors[run_id] = base.clone()

    def _fork_key(self, run_id: str, seq: int) -> tuple[Any, ...] | None:
        """What the seeding of a branch's first append at `seq` depends on, when it is its
        fork point: the lineage before it and the parent's head (its own events past the fork
        are learnt too). Every branch forked there learns the same; None otherwise."""
        segments = self.lineage(run_id)
        if len(segments) < 2 or segments[-1].start != seq:
            return None
        parent = segments[-2].run_id
        # as it was when this journal forked the run, else as it is now: either is a state of
        # the parent whose events the seeding may name
        head = self._fork_heads.get(run_id)
        if head is None:
            with self._read() as cur:
                head = self._head(cur, parent)
        return (
            tuple((g.run_id, g.start, g.stop) for g in segments[:-1]),
            seq,
            head,
            self.write_version,
        )

    def _seed(
        self,
        comp: ev.Compactor,
        run_id: str,
        seq: int,
        calls: int = 16,
        recent: int = 256,
        far: int = FAR_EVENTS,
    ) -> None:
        """Load the latest LLM requests before `seq` of the run's history (a branch's first
        step, a resumed run): each agent's next request is a delta of its last one; and the
        strings inline in its latest `recent` events, to refer to rather than repeat. For a
        branch written as v5, also the strings of the parent's first `far` own events past
        the fork point, which a branch that re-runs its parent mostly repeats."""
        segments = self.lineage(run_id)
        far_rows: list[tuple[Any, ...]] = []
        parent = run_id
        with self._read() as cur:
            # rows are (owner, seq, *columns)
            recent_rows = self._latest_before(
                cur, run_id, seq, "version, payload", "version >= 4", recent
            )
            call_rows = self._latest_before(
                cur, run_id, seq, "version, payload", "kind = ?", calls, self.kind_cell("llm_call")
            )
            if comp.positional and len(segments) > 1 and far > 0:
                parent, fork = segments[-2].run_id, segments[-1].start
                span, args = self._span(cur, parent, fork, None)
                cur.execute(
                    self._q(
                        f"SELECT seq, version, payload FROM events WHERE {span} AND version >= 4"
                        f" ORDER BY {self._ord} LIMIT ?"
                    ),
                    (*args, far),
                )
                far_rows = cur.fetchall()
        plain = self._unpacker.plain
        cell = self._bytes_cell
        num = self._int_cell
        learnt = [
            (
                num(r[1], "seq", r[0], r[1]),
                plain(
                    str(r[0]),
                    num(r[1], "seq", r[0], r[1]),
                    num(r[2], "version", r[0], r[1]),
                    cell(r[3], "payload", r[0], r[1]),
                ),
            )
            for r in recent_rows
        ]
        found = [
            (
                str(r[0]),
                num(r[1], "seq", r[0], r[1]),
                num(r[2], "version", r[0], r[1]),
                cell(r[3], "payload", r[0], r[1]),
            )
            for r in call_rows
        ]
        for s, stored in reversed(learnt):
            comp.learn(s, stored)
        for s, version, stored in far_rows:
            raw = cell(stored, "payload", parent, s)
            at = num(s, "seq", parent, s)
            comp.learn_far(at, plain(parent, at, num(version, "version", parent, s), raw))
        for owner, s, version, stored in reversed(found):
            full = self._full(owner, s, version, plain(owner, s, version, stored))
            raw = msgspec.msgpack.decode(full)
            request = raw.get("request")
            if type(request) is not list:
                continue
            depth = self._resolver.requests.get((owner, s), (None, 0))[1]
            comp.note_request(str(raw.get("agent", "")), s, request, depth)

    def _latest_before(
        self,
        cur: Any,
        run_id: str,
        seq: int,
        columns: str,
        where: str,
        limit: int,
        *where_args: Any,
    ) -> list[tuple[Any, ...]]:
        """(owner run, seq, *columns) of the latest `limit` events before `seq` in the run's
        history that match `where`, newest first, through the lineage's segments."""
        rows: list[tuple[Any, ...]] = []
        for seg in reversed(self.lineage(run_id)):
            if seg.start >= seq and seg.start > 0:
                continue
            hi = seq if seg.stop is None else min(seq, seg.stop)
            span, args = self._span(cur, seg.run_id, seg.start, hi)
            cur.execute(
                self._q(
                    f"SELECT seq, {columns} FROM events WHERE {span} AND {where}"
                    f" ORDER BY {self._ord} DESC LIMIT ?"
                ),
                (*args, *where_args, limit - len(rows)),
            )
            rows += [(seg.run_id, *r) for r in cur.fetchall()]
            if len(rows) >= limit:
                break
        return rows

    def _full(self, owner: str, seq: int, version: int, stored: bytes) -> bytes:
        """The canonical bytes of a stored payload of any schema version."""
        if version >= 4:
            try:
                return self._resolver.resolve(owner, seq, stored)
            except TamperedJournal:
                raise
            except (ValueError, TypeError, KeyError, IndexError, RecursionError) as e:
                raise TamperedJournal(
                    f"event {seq} of run {owner!r} in {self._where()} does not resolve: {e}"
                    " (see `car verify`)"
                ) from e
        if version >= 3:
            return ev.resolve(stored, self._text)
        return stored

    def _load(self, owner: str, seq: int) -> tuple[int, bytes]:
        """(version, stored payload) of one row, for resolving references to it."""
        if self._recent_src is not None and not self._recent_rows:
            self._recent_rows = {
                (r[0], self._int_cell(r[1], "seq", r[0], r[1])): (
                    self._int_cell(r[2], "version", r[0], r[1]),
                    self._bytes_cell(r[3], "payload", r[0], r[1]),
                )
                for r in self._recent_src
            }
        got = self._recent_rows.get((owner, seq))
        if got is None:
            with self._read() as cur:
                where, args = self._span(cur, owner, seq, seq + 1)
                cur.execute(self._q(f"SELECT version, payload FROM events WHERE {where}"), args)
                row = cur.fetchone()
            if row is None:
                raise TamperedJournal(
                    f"journal {self._where()} lacks event {seq} of run {owner!r}, which a later"
                    " event refers to (see `car verify`)"
                )
            got = (
                self._int_cell(row[0], "version", owner, seq),
                self._bytes_cell(row[1], "payload", owner, seq),
            )
        return got[0], self._plain(owner, seq, *got)

    def _plain(self, owner: str, seq: int, version: int, stored: bytes) -> bytes:
        """The v5 stored bytes of a row of any version (v6 rows are unpacked)."""
        try:
            return self._unpacker.plain(owner, seq, version, stored)
        except ValueError as e:
            raise TamperedJournal(
                f"event {seq} of run {owner!r} in {self._where()} does not unpack: {e}"
                " (see `car verify`)"
            ) from e

    def _fetch_own(self, run_id: str, lo: int, hi: int) -> list[tuple[int, int, bytes]]:
        """(seq, version, stored payload) of the run's own rows with lo <= seq < hi."""
        lo = max(lo, self.lineage(run_id)[-1].start)  # a branch has no own rows before its fork
        if lo >= hi:
            return []
        with self._read() as cur:
            where, args = self._span(cur, run_id, lo, hi)
            cur.execute(
                self._q(
                    f"SELECT seq, version, payload FROM events WHERE {where} ORDER BY {self._ord}"
                ),
                args,
            )
            return [
                (
                    self._int_cell(s, "seq", run_id, s),
                    self._int_cell(v, "version", run_id, s),
                    self._bytes_cell(p, "payload", run_id, s),
                )
                for s, v, p in cur.fetchall()
            ]

    def _store_texts(self, rows: list[EventRow]) -> tuple[list[EventRow], dict[bytes, bytes]]:
        """Rows in their stored v3 form: long texts moved to `texts` (once per distinct text),
        payloads holding references; and those texts. The hashes stay those of the full
        payloads."""
        out: list[EventRow] = []
        new: dict[bytes, bytes] = {}
        known = self._known_texts
        if len(self._digests) > 50_000:
            self._digests.clear()
        for r in rows:
            compact, texts = ev.externalize(r[5], self._digests)
            for d, body in texts.items():
                if d not in known and d not in new:
                    new[d] = body.encode()
            out.append((r[0], r[1], r[2], r[3], r[4], compact, r[6]))
        return out, new

    def _insert_texts(self, cur: Any, new: dict[bytes, bytes]) -> None:
        """Store texts not known to be in `texts` yet (inside the append's transaction); from
        v6 on packed (engine/packing.py), against this writer's first text."""
        if new:
            self._pending_texts.update(new)
            if self.write_version >= 6:
                # the base is this writer's first text, committed or in this transaction
                base = self._text_base
                packed: dict[bytes, bytes] = {}
                for d, b in new.items():
                    if base is None:
                        packed[d] = packing.pack_text(b, None)
                        base = self._text_base_pending = (d, b)
                    else:
                        packed[d] = packing.pack_text(b, base)
                new = packed
            if self.is_sqlite:
                # the no-rewrite trigger refuses a second insert of a key even with OR IGNORE
                sql = (
                    "INSERT INTO texts (hash, body) SELECT ?, ?"
                    " WHERE NOT EXISTS (SELECT 1 FROM texts WHERE hash = ?)"
                )
                args: list[tuple[Any, ...]] = [
                    (ev.text_key(d), b, ev.text_key(d)) for d, b in new.items()
                ]
            else:
                sql = "INSERT INTO texts (hash, body) VALUES (%s, %s) ON CONFLICT DO NOTHING"
                args = [(ev.text_key(d), b) for d, b in new.items()]
            cur.executemany(sql, args)

    def _text(self, digest: bytes, depth: int = 0) -> bytes:
        """A stored text by digest (cached: the same texts come back in every request)."""
        body = self._text_cache.get(digest)
        if body is not None:
            return body
        with self._read() as cur:
            cur.execute(self._q("SELECT body FROM texts WHERE hash = ?"), (ev.text_key(digest),))
            row = cur.fetchone()
        if row is None:
            raise TamperedJournal(
                f"journal {self._where()} lacks text {ev.text_key(digest)} (see `car verify`)"
            )
        if not isinstance(row[0], bytes | bytearray | memoryview):
            raise TamperedJournal(
                f"the body cell of text {ev.text_key(digest)} in {self._where()} is stored as"
                f" {_sql_type(row[0])}, not as bytes (see `car verify`)"
            )
        body = bytes(row[0])
        if packing.is_packed(body):
            try:
                body = packing.plain_text(body, self._text, depth)
            except ValueError as e:
                raise TamperedJournal(
                    f"text {ev.text_key(digest)} in {self._where()} does not unpack: {e}"
                    " (see `car verify`)"
                ) from e
        if len(self._text_cache) > 50_000:
            self._text_cache.clear()
        self._text_cache[digest] = body
        return body

    def _writable(self) -> None:
        if self.readonly:
            raise JournalError(f"journal {self._where()} is open read-only")
        if not self.keyed:
            raise JournalError(
                f"journal {self._where()} is at schema revision {self.revision!r}; open it for"
                " writing with upgrades allowed (`car db upgrade`) before writing to it"
            )

    # ---------------------------------------------------------------- leases

    def acquire_lease(self, run_id: str) -> None:
        """Record this process as the run's writer (replacing a previous writer's lease)."""
        self._writable()
        with self._tx() as cur:
            self._put_lease(cur, run_id)

    def _put_lease(self, cur: Any, run_id: str) -> None:
        me = _this_process()
        cur.execute(self._q("DELETE FROM leases WHERE run_id = ?"), (run_id,))
        cur.execute(
            self._q(
                "INSERT INTO leases (run_id, pid, host, boot_id, proc_start, heartbeat)"
                " VALUES (?, ?, ?, ?, ?, ?)"
            ),
            (run_id, me.pid, me.host, me.boot_id, me.proc_start, self._wall()),
        )

    def heartbeat(self, run_id: str) -> None:
        """Refresh this process's lease on the run (what a reader on another host goes by)."""
        me = _this_process()
        with self._tx() as cur:
            cur.execute(
                self._q(
                    "UPDATE leases SET heartbeat = ? WHERE run_id = ? AND pid = ? AND host = ?"
                ),
                (self._wall(), run_id, me.pid, me.host),
            )

    def _release_lease(self, cur: Any, run_id: str) -> None:
        cur.execute(self._q("DELETE FROM leases WHERE run_id = ?"), (run_id,))

    def lease(self, run_id: str) -> Lease | None:
        """The run's writer lease, None if it has none (ended, or recorded before leases)."""
        if self.revision == "0001_journal_tables":
            return None
        with self._read() as cur:
            cur.execute(
                self._q(
                    "SELECT pid, host, boot_id, proc_start, heartbeat FROM leases WHERE run_id = ?"
                ),
                (run_id,),
            )
            row = cur.fetchone()
        if row is None:
            return None
        return Lease(int(row[0]), str(row[1]), str(row[2]), str(row[3]), float(row[4]))

    def writer_gone(self, lease: Lease) -> bool:
        """True when the lease's process is certainly dead: same host and boot, and no process
        with that pid and start time; a rebooted host; or, seen from another host, a heartbeat
        older than LEASE_TTL seconds."""
        me = _this_process()
        if lease.host == me.host:
            if lease.boot_id and me.boot_id and lease.boot_id != me.boot_id:
                return True
            return not _process_alive(lease.pid, lease.proc_start)
        return self._wall() - lease.heartbeat > LEASE_TTL

    def close_abandoned(self, run_id: str) -> str:
        """Close a run whose writer is gone: append Control(stop) and RunEnded(stopped), the
        reason naming the writer. Returns the error text recorded."""
        info = self.run(run_id)
        if self.status(info.run_id) != "abandoned":
            raise JournalError(f"run {info.run_id!r} is {self.status(info.run_id)}, not abandoned")
        lease = self.lease(info.run_id)
        assert lease is not None
        why = f"abandoned: writer pid {lease.pid} on {lease.host} gone"
        head = self.head(info.run_id)
        self.append(
            info.run_id,
            [ev.Control(action="stop", reason=why), ev.RunEnded(status="stopped", error=why)],
            head,
        )
        return why

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
        with self._read() as cur:
            where, args = self._span(cur, run_id, lo, hi)
            cur.execute(
                self._q(
                    "SELECT seq, step, kind, version, payload, hash FROM events"
                    f" WHERE {where} ORDER BY {self._ord}"
                ),
                args,
            )
            rows = cur.fetchall()
        for seq_cell, step, kind, version_cell, stored, hash_ in rows:
            seq = self._int_cell(seq_cell, "seq", run_id, seq_cell)
            version = self._int_cell(version_cell, "version", run_id, seq)
            # v3 and later store references (to texts, to earlier events): resolve them
            raw = self._bytes_cell(stored, "payload", run_id, seq)
            plain = self._plain(run_id, seq, version, raw)
            payload = self._full(run_id, seq, version, plain)
            yield StoredEvent(
                run_id,
                seq,
                self._step_cell(step, run_id, seq),
                self._kind(kind, run_id, seq),
                version,
                payload,
                self._hash_cell(hash_, run_id, seq),
            )

    def read_for_fold(
        self, run_id: str, start: int = 0, stop: int | None = None
    ) -> Iterator[ev.Event]:
        """The events of `read`, decoded as the state fold reads them (`ev.decode_for_fold`):
        a v4 payload whose folded fields hold no reference is decoded as stored, so what the
        fold skips (an LLM call's request and response) is never rebuilt."""
        for seg in self.lineage(run_id):
            lo = max(start, seg.start)
            hi = _min_opt(stop, seg.stop)
            if hi is not None and lo >= hi:
                continue
            with self._read() as cur:
                where, args = self._span(cur, seg.run_id, lo, hi)
                cur.execute(
                    self._q(
                        f"SELECT seq, version, payload FROM events WHERE {where}"
                        f" ORDER BY {self._ord}"
                    ),
                    args,
                )
                rows = [(seg.run_id, *r) for r in cur.fetchall()]
            self._recent_src = rows  # what _load looks in first (built on its first use)
            try:
                for r in rows:
                    owner = r[0]
                    seq = self._int_cell(r[1], "seq", owner, r[1])
                    version = self._int_cell(r[2], "version", owner, seq)
                    raw = self._bytes_cell(r[3], "payload", owner, seq)
                    stored = self._plain(owner, seq, version, raw)
                    e = ev.decode_stored_for_fold(stored) if version >= 4 else None
                    if e is None:
                        full = self._full(owner, seq, version, stored)
                        e = ev.decode_for_fold(full, version)
                    yield e
            finally:
                self._recent_src = None
                self._recent_rows = {}

    def events(self, run_id: str, stop: int | None = None) -> list[ev.AnyEvent]:
        return [s.event for s in self.read(run_id, 0, stop)]

    def step_start(self, run_id: str, step: int) -> int | None:
        """Seq of the first event of step >= `step` in the run's history, None if none."""
        # steps grow with seq along a lineage, so the first segment (root first) that holds
        # such an event holds the earliest one, and within it the first row in seq order (a
        # walk of the primary key that stops there: no step index, docs/decisions.md entry 38)
        lineage = self.lineage(run_id)
        with self._read() as cur:
            for seg in lineage:
                where, args = self._span(cur, seg.run_id, seg.start, seg.stop)
                cur.execute(
                    self._q(
                        f"SELECT seq FROM events WHERE {where} AND step >= ?"
                        f" ORDER BY {self._ord} LIMIT 1"
                    ),
                    [*args, step],
                )
                row = cur.fetchone()
                if row and row[0] is not None:
                    return self._int_cell(row[0], "seq", seg.run_id, row[0])
        return None

    def last_stepped(self, run_id: str, skip_kinds: Sequence[str] = ()) -> tuple[int, int] | None:
        """(step, seq) of the last event that belongs to a step (and is of none of
        `skip_kinds`), None if there is none."""
        skip = [self.kind_cell(k) for k in skip_kinds]
        unless = f" AND kind NOT IN ({', '.join('?' * len(skip))})" if skip else ""
        for seg in reversed(self.lineage(run_id)):
            with self._read() as cur:
                where, args = self._span(cur, seg.run_id, seg.start, seg.stop)
                cur.execute(
                    self._q(
                        f"SELECT step, seq FROM events WHERE {where} AND step IS NOT NULL"
                        f"{unless} ORDER BY {self._ord} DESC LIMIT 1"
                    ),
                    [*args, *skip],
                )
                row = cur.fetchone()
            if row is not None:
                step = self._step_cell(row[0], seg.run_id, row[1])
                assert step is not None  # the query asks for a step
                return step, self._int_cell(row[1], "seq", seg.run_id, row[1])
        return None

    def steps(self, run_id: str, skip_kinds: Sequence[str] = ()) -> int:
        """Number of agent steps in the run's history (counting only events of none of
        `skip_kinds`)."""
        last = self.last_stepped(run_id, skip_kinds)
        return 0 if last is None else last[0] + 1

    def last_event(self, run_id: str) -> StoredEvent | None:
        head = self.head(run_id)
        if head == 0:
            return None
        return next(self.read(run_id, head - 1, head), None)

    def status(self, run_id: str) -> str:
        """recording | paused | completed | stopped | failed, derived from the last events;
        abandoned for a run still open whose writer process is gone (see `writer_gone`)."""
        info = self.run(run_id)
        head = self.head(info.run_id)
        found = "recording"
        # an accusation may follow RunEnded; look past it
        for stored in reversed(list(self.read(info.run_id, max(0, head - 3), head))):
            e = stored.event
            if isinstance(e, ev.SuspicionDeclared):
                continue
            if isinstance(e, ev.RunEnded):
                return e.status
            if isinstance(e, ev.Control) and e.action == "pause":
                found = "paused"
            break
        lease = self.lease(info.run_id)
        if lease is not None and self.writer_gone(lease):
            return "abandoned"
        return found

    # ------------------------------------------------------------- snapshots

    def put_snapshot(self, run_id: str, seq: int, fold_version: int, state: bytes) -> None:
        """Store a folded state once (a no-op when it exists, or when the journal is read-only:
        snapshots are a cache that readers must not write)."""
        if self.readonly:
            return
        owner = self._owner(run_id, seq - 1)
        if self.is_sqlite:
            # the no-rewrite trigger refuses even INSERT .. ON CONFLICT DO NOTHING of an
            # existing key, so look first (inside the write lock, so nobody can come between)
            sql = (
                "INSERT INTO snapshots (run_id, seq, fold_version, state) SELECT ?, ?, ?, ?"
                " WHERE NOT EXISTS (SELECT 1 FROM snapshots WHERE run_id = ? AND seq = ?"
                " AND fold_version = ?)"
            )
            args: tuple[Any, ...] = (owner, seq, fold_version, state, owner, seq, fold_version)
        else:
            sql = (
                "INSERT INTO snapshots (run_id, seq, fold_version, state) VALUES (?, ?, ?, ?)"
                " ON CONFLICT DO NOTHING"
            )
            args = (owner, seq, fold_version, state)
        with self._tx() as cur:
            cur.execute(self._q(sql), args)

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
                    if not isinstance(row[1], bytes | bytearray | memoryview):
                        raise TamperedJournal(
                            f"the state cell of run {seg.run_id!r}'s snapshot at seq {row[0]} in"
                            f" {self._where()} is stored as {_sql_type(row[1])}, not as bytes"
                            " (see `car verify`)"
                        )
                    found = (seg.run_id, row[0], fold_version)
                    if found not in self._sound_snapshots:
                        self._check_snapshot(seg.run_id, row[0], fold_version, bytes(row[1]))
                        if len(self._sound_snapshots) >= 4096:
                            self._sound_snapshots.clear()
                        self._sound_snapshots.add(found)
                    return int(row[0]), bytes(row[1])
        return None

    def _check_snapshot(self, run_id: str, seq: Any, fold_version: int, blob: bytes) -> None:
        """TamperedJournal for a snapshot that does not decode to a state of this fold version
        folded over exactly `seq` events (whether it is the fold's state is verify's to say)."""
        from engine.state import FOLD_VERSION, decode_state

        if fold_version != FOLD_VERSION:
            return
        try:
            held = decode_state(blob).seq
        except Exception as e:  # zlib, msgspec: whatever bytes the cell holds
            raise TamperedJournal(
                f"run {run_id!r}'s snapshot at seq {seq!r} in {self._where()} does not decode:"
                f" {_first_line(e)} (see `car verify`)"
            ) from e
        if type(seq) is not int or held != seq:
            raise TamperedJournal(
                f"run {run_id!r}'s snapshot at seq {seq!r} in {self._where()} holds the state"
                f" after {held} events (see `car verify`)"
            )

    # ---------------------------------------------------------------- verify

    def verify(self, run_id: str | None = None) -> VerifyReport:
        """Re-derive every hash and check every row (engine.verify); never writes."""
        from engine.verify import verify_journal

        return verify_journal(self, run_id)

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """A raw read (with `?` placeholders) for verifiers and tools that check the store
        itself; never writes (the journal's own connection, no transaction left open)."""
        with self._read() as cur:
            cur.execute(self._q(sql), tuple(args))
            return [tuple(r) for r in cur.fetchall()]

    def checkpoint(self) -> None:
        if self.is_sqlite and not self.readonly:
            with self._read() as cur:
                cur.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def _revision_of(names: set[str], run: Callable[[str], Any], where: str) -> str | None:
    """The journal revision of a database whose tables are `names`; None for an empty one.

    Raises NotAJournal for a database that holds something else, SchemaTooNew for a journal
    written by a newer engine."""
    if "alembic_version" not in names:
        if names:
            raise NotAJournal(
                f"{where} is not a journal: it holds tables {sorted(names)!r} but no journal schema"
            )
        return None
    rows = run("SELECT version_num FROM alembic_version").fetchall()
    current = str(rows[0][0]) if rows else None
    if current is None:
        if names - {"alembic_version"}:
            raise NotAJournal(f"{where} is not a journal: it holds tables {sorted(names)!r}")
        return None
    if current not in KNOWN_REVISIONS:
        if not {"events", "runs"} <= names:
            raise NotAJournal(f"{where} is not a journal: schema revision {current!r} is not ours")
        raise SchemaTooNew(
            f"journal {where} has schema revision {_clipped(current)!r}, which this engine does "
            f"not know (its latest is {HEAD_REVISION!r}): written by a newer "
            "causal-agent-replay (upgrade it), or altered (see `car verify`)"
        )
    return current


def _alembic_upgrade(sa_conn: Any) -> None:
    from alembic import command
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["connection"] = sa_conn
    command.upgrade(cfg, "head")


def _migrate_sqlite(conn: sqlite3.Connection, where: str) -> None:
    """Bring a SQLite journal to the head revision in ONE transaction (SQLite's DDL is
    transactional): a kill leaves the old revision whole, and a concurrent opener waits on the
    write lock, then finds the work done."""
    from sqlalchemy import create_engine
    from sqlalchemy.pool import StaticPool

    eng = create_engine(
        "sqlite://", creator=lambda: conn, poolclass=StaticPool, pool_reset_on_return=None
    )
    # connect first: SQLAlchemy's first connect ends with a ROLLBACK, which would end a
    # transaction begun before it and leave every later statement to autocommit on its own
    with eng.connect() as sa_conn:
        conn.execute("BEGIN IMMEDIATE")
        try:
            names = {
                r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            }
            if _revision_of(names, conn.execute, where) != HEAD_REVISION:
                # one Alembic transaction for all revisions (migrations/env.py): its commit
                # is this transaction's
                _alembic_upgrade(sa_conn)
            if conn.in_transaction:
                conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise


def _create_sqlite_journal(path: Path) -> None:
    """Create a new journal file atomically: built under a private name, then linked into place
    (link fails if the name exists), so a kill never leaves a half-made journal and concurrent
    first opens all end up using the one that won."""
    where = repr(str(path))
    wal = Path(f"{path}-wal")
    if wal.exists():
        # the log of a database that is gone (deleted with its log left behind, or a log
        # copied without it): SQLite would read its pages into the new file under this name
        raise JournalError(
            f"cannot create a journal at {where}: {str(wal)!r}, the write-ahead log of a "
            "database no longer there, lies beside it and would be read into the new one "
            "(move it away, or remove it if its database was meant to go)"
        )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise JournalError(f"cannot create a journal at {where}: {e.strerror or e}") from None
    tmp = path.with_name(f".{path.name}.creating-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        try:
            conn = sqlite3.connect(tmp, isolation_level=None)
            try:
                # 8 KiB pages fit ~1 KB events with less slack; only a new, empty file takes it
                conn.execute("PRAGMA page_size=8192")
                conn.execute("PRAGMA journal_mode=WAL")
                _migrate_sqlite(conn, repr(str(path)))
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            finally:
                conn.close()
        except (OSError, sqlite3.OperationalError) as e:
            # a directory it cannot write, a name too long, a full disk: said in one line
            reason = getattr(e, "strerror", None) or _first_line(e)
            raise JournalError(f"cannot create a journal at {where}: {reason}") from None
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process created it first: use theirs
        except OSError:  # a file system without hard links
            if not path.exists():
                os.replace(tmp, path)
    finally:
        for suffix in ("", "-wal", "-shm", "-journal"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{tmp}{suffix}")


def _clipped(text: str, limit: int = 80) -> str:
    """`text` for a one-line message: at most `limit` characters, the rest said as `...`."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


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


# the first cell of a texts or snapshots bytes column that is not bytes, and how it is named
# the text columns of runs (a cell of bytes that are not UTF-8 fails every read of the row)
_RUN_TEXT_COLUMNS = frozenset(
    {"run_id", "parent_run_id", "root_run_id", "scenario", "created_at", "label"}
)
_RETYPED_CELLS = {
    "body": (
        "SELECT hash, NULL FROM texts WHERE typeof(body) != 'blob' LIMIT 1",
        "the body cell of text {0}",
    ),
    "state": (
        "SELECT run_id, seq FROM snapshots WHERE typeof(state) != 'blob' LIMIT 1",
        "the state cell of run {0!r}'s snapshot at seq {1}",
    ),
}
# Python's sqlite3 when a TEXT cell (where bytes belong) is not UTF-8
_UNDECODABLE = re.compile(r"^Could not decode to UTF-8 column '(\w+)'")


def _sql_type(cell: Any) -> str:
    """SQLite's name for the type of a cell as read."""
    if cell is None:
        return "null"
    if isinstance(cell, str):
        return "text"
    if isinstance(cell, bool | int):
        return "integer"
    if isinstance(cell, float):
        return "real"
    return "blob"


def redacted_url(url: str) -> str:
    """A journal target as it may be shown, its password masked: the one of the authority
    part (up to the first "/" after "scheme://", so a SQLite path holding "@" is left alone)
    and a `password=` or `sslpassword=` of a server URL's query string, which libpq takes as
    well."""
    if "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    if not scheme.startswith("sqlite"):
        rest = _QUERY_PASSWORD.sub(r"\1***", rest)
    slash = rest.find("/")
    at = rest.rfind("@", 0, slash if slash >= 0 else len(rest))
    if at < 0:
        return f"{scheme}://{rest}"
    user = rest[:at].split(":", 1)[0]
    return f"{scheme}://{user}:***@{rest[at + 1 :]}"


#: a password in a server URL's query string (`?password=...`, `&sslpassword=...`)
_QUERY_PASSWORD = re.compile(r"([?&](?:ssl)?password=)[^&#]*", re.IGNORECASE)


def _holds_nul(url: Any) -> bool:
    """Whether a parsed server URL holds a NUL character in any part the driver receives."""
    parts: list[Any] = [url.username, url.password, url.host, url.database]
    for value in url.query.values():
        parts.extend(value if isinstance(value, tuple) else (value,))
    return any(isinstance(p, str) and "\x00" in p for p in parts)


def _quiet_driver_logs() -> None:
    """The driver's and the pool's own warnings (a reset that failed on a lost connection,
    a pipeline given up) would reach stderr through Python's last-resort handler, tracebacks
    and all, around the one line that reports the failure: they go to a NullHandler unless
    the application configured logging for them."""
    import logging

    for name in ("psycopg", "sqlalchemy.pool"):
        logger = logging.getLogger(name)
        if not logger.handlers:
            logger.addHandler(logging.NullHandler())


def _is_unique_violation(e: BaseException) -> bool:
    text = str(e).lower()
    return (
        "unique constraint" in text
        or "duplicate key" in text
        or "row already exists" in text  # the journal's own no-rewrite trigger (SQLite)
        or (getattr(e, "sqlstate", None) == "23505")
    )


# PostgreSQL's SQLSTATEs for "another transaction is in the way": lock_not_available (a
# lock_timeout), serialization_failure, deadlock_detected
_BUSY_SQLSTATES = frozenset({"55P03", "40001", "40P01"})


def _run_problem(row: Sequence[Any]) -> tuple[str, Any, str] | None:
    """(column, cell, what it should be) of a runs row's cell that is not what a run holds,
    None for a row that reads as a run."""
    bad: tuple[str, Any, str] | None = None
    for i, col in ((0, "run_id"), (3, "root_run_id"), (4, "scenario"), (6, "label")):
        if not isinstance(row[i], str):
            bad = (col, row[i], "text")
    if row[1] is not None and not isinstance(row[1], str):
        bad = ("parent_run_id", row[1], "text")
    if row[2] is not None and type(row[2]) is not int:
        bad = ("fork_seq", row[2], "an integer")
    if bad is None:
        try:
            dt.datetime.fromisoformat(row[5])
        except (TypeError, ValueError):
            bad = ("created_at", row[5], "an ISO 8601 time")
    return bad


def _text_or_bytes(raw: bytes) -> str | bytes:
    """A SQLite TEXT cell as str, or its bytes when they are not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw


def _as_text(cell: Any) -> str:
    """A cell as text for naming it: bytes decoded with escapes, anything else as str."""
    if isinstance(cell, bytes | bytearray | memoryview):
        return bytes(cell).decode("utf-8", "backslashreplace")
    return str(cell)


def _is_busy(e: BaseException) -> bool:
    """Whether a driver error says the database was locked by another connection (SQLite's
    SQLITE_BUSY and SQLITE_LOCKED with their extended codes; PostgreSQL's lock timeout,
    serialization failure and deadlock): nothing was done, and trying again may succeed."""
    code = getattr(e, "sqlite_errorcode", None)
    if isinstance(code, int):
        return code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
    state = getattr(e, "sqlstate", None) or getattr(getattr(e, "orig", None), "sqlstate", None)
    return state in _BUSY_SQLSTATES


def _is_fk_violation(e: BaseException) -> bool:
    text = str(e).lower()
    return "foreign key" in text or getattr(e, "sqlstate", None) == "23503"
