"""The verifier: re-derives every hash and checks every row of a journal, reading only.

It trusts nothing the store holds and reports every corruption as a finding (run, seq, what),
never a traceback: a damaged file (SQLite `quick_check`), renamed or dropped tables and columns,
a disabled, dropped or altered append-only trigger (on PostgreSQL also the body of the function
it runs, replica-only firing, session_replication_role, rules and row-level security), cells of
the wrong type (a payload stored as TEXT, bytes that are not UTF-8 in a TEXT column), event rows
outside the id range of every run, texts no event uses, a fork point outside its parent, a hash
chain that does not re-derive, a `kind` or `step` column that disagrees with the event it
indexes, rows newer than the schema revision allows, and snapshots that differ from the fold
they cache (verify re-folds them).

What a chain alone cannot show — a run re-chained from some seq on, a truncated tail, a deleted
run, an altered run row — needs an anchor kept outside the journal (`engine.anchor`); pass it
and those are reported too. See docs/decisions.md for what is out of scope.
"""

from __future__ import annotations

import datetime as dt
import re
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import msgspec

from engine import events as ev
from engine import packing
from engine.journal import HASH_PREFIX, KIND_NAMES, SPAN, Journal, chain_hash

EXPECTED_COLUMNS: dict[str, tuple[str, ...]] = {
    "runs": (
        "run_id",
        "parent_run_id",
        "fork_seq",
        "root_run_id",
        "scenario",
        "created_at",
        "label",
    ),
    "events": ("run_id", "seq", "step", "kind", "version", "payload", "hash"),
    "snapshots": ("run_id", "seq", "fold_version", "state"),
    "texts": ("hash", "body"),
}
# the integer-keyed layout (revision 0005 on, docs/decisions.md entry 41)
KEYED_COLUMNS: dict[str, tuple[str, ...]] = {
    "runs": ("run_key", *EXPECTED_COLUMNS["runs"]),
    "events": ("id", "run_key", "seq", "step", "kind", "version", "payload", "hash"),
    "snapshots": EXPECTED_COLUMNS["snapshots"],
    "texts": EXPECTED_COLUMNS["texts"],
    "kinds": ("code", "name"),
}
DIGEST_BYTES = 32

# the triggers that refuse rewrites, per revision that added them
_SQLITE_TRIGGERS = {
    "0001_journal_tables": (
        "events_no_update",
        "events_no_delete",
        "runs_no_update",
        "runs_no_delete",
        "snapshots_no_update",
    ),
    "0002_refuse_rewrites": (
        "events_no_rewrite",
        "runs_no_rewrite",
        "snapshots_no_rewrite",
        "snapshots_no_delete",
    ),
    "0003_texts": ("texts_no_update", "texts_no_delete", "texts_no_rewrite"),
    "0004_event_refs": (),
    "0005_integer_rows": ("kinds_no_update", "kinds_no_delete", "kinds_no_rewrite"),
    "0006_positional_events": (),
    "0007_packed_rows": (),
}
_PG_TRIGGERS = {
    "0001_journal_tables": (
        "events_append_only",
        "runs_append_only",
        "events_no_truncate",
        "runs_no_truncate",
        "snapshots_write_once",
    ),
    "0002_refuse_rewrites": ("snapshots_no_delete", "snapshots_no_truncate"),
    "0003_texts": ("texts_append_only", "texts_no_truncate"),
    "0004_event_refs": (),
    "0005_integer_rows": ("kinds_append_only", "kinds_no_truncate"),
    "0006_positional_events": (),
    "0007_packed_rows": (),
}
# what each PostgreSQL trigger of the journal is (pg_trigger.tgtype): BEFORE (2), FOR EACH ROW
# (1), on UPDATE (16), DELETE (8) or TRUNCATE (32, per statement); no WHEN, no column list
_PG_TRIGGER_TYPES = {"append_only": 27, "no_truncate": 34, "write_once": 19, "no_delete": 11}
# the body of the function every one of them runs, as revision 0001 creates it (written down
# here, not imported: reading a journal needs no Alembic); compared with its words re-spaced
PG_REFUSE_FUNCTION = "car_refuse_change"
PG_REFUSE_BODY = """
BEGIN
  RAISE EXCEPTION 'journal % are append-only: % refused', TG_TABLE_NAME, TG_OP
    USING ERRCODE = 'integrity_constraint_violation';
END;
"""
# the newest event schema a journal at each revision may hold (a revision marks the journal as
# one that may hold its rows, so that an older engine refuses it whole at open)
_MAX_EVENT_VERSION = {
    "0001_journal_tables": 2,
    "0002_refuse_rewrites": 2,
    "0003_texts": 3,
    "0004_event_refs": 4,
    "0005_integer_rows": 4,
    "0006_positional_events": 5,
    "0007_packed_rows": 6,
}
MAX_FINDINGS_PER_RUN = 50
MAX_FILE_FINDINGS = 10  # of one kind about the whole file (unused texts, ...), then a count
_HISTORY_TABLES = ("events", "runs", "snapshots", "texts", "kinds")
# what each SQLite no_rewrite trigger may test, in any revision that made it (its WHEN EXISTS)
_REWRITE_KEYS = {
    "events": (
        "run_id = NEW.run_id AND seq = NEW.seq",
        "id = NEW.run_key * 4294967296 + NEW.seq",
    ),
    "runs": ("run_id = NEW.run_id", "run_id = NEW.run_id OR run_key = NEW.run_key"),
    "snapshots": ("run_id = NEW.run_id AND seq = NEW.seq AND fold_version = NEW.fold_version",),
    "texts": ("hash = NEW.hash",),
    "kinds": ("code = NEW.code OR name = NEW.name",),
}


def _trigger_refuses(name: str, table: str, sql: str) -> bool:
    """Whether `sql` is the journal's trigger `name` (TABLE_no_update/_delete/_rewrite): before
    that statement on that table, unconditionally (or, for a rewrite, whenever the key exists)
    raising ABORT, as the migrations write it."""
    target, _, action = name.partition("_no_")
    statement = {"update": "UPDATE", "delete": "DELETE", "rewrite": "INSERT"}.get(action)
    if statement is None or table != target:
        return False
    flat = " ".join(sql.split())
    head = f"CREATE TRIGGER {name} BEFORE {statement} ON {target} "
    body = r"BEGIN SELECT RAISE\(ABORT, '[^']*'\); END;?"
    if action != "rewrite":
        return re.fullmatch(re.escape(head) + body, flat) is not None
    return any(
        re.fullmatch(
            re.escape(f"{head}WHEN EXISTS (SELECT 1 FROM {target} WHERE {key}) ") + body, flat
        )
        is not None
        for key in _REWRITE_KEYS.get(target, ())
    )


# the runs columns that hold text (read as text by every reader)
_RUN_TEXT_COLUMNS = ("run_id", "parent_run_id", "root_run_id", "scenario", "created_at", "label")


class VerifyProblem(msgspec.Struct, frozen=True):
    """One finding. `run_id`/`seq` are None for findings about the whole file."""

    run_id: str | None
    seq: int | None
    problem: str
    code: str = ""


class VerifyReport(msgspec.Struct, frozen=True):
    runs_checked: int
    events_checked: int
    problems: list[VerifyProblem]
    snapshots_checked: int = 0
    anchored_runs: int = 0
    notes: list[str] = msgspec.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "runs_checked": self.runs_checked,
            "events_checked": self.events_checked,
            "snapshots_checked": self.snapshots_checked,
            "anchored_runs": self.anchored_runs,
            "problems": [msgspec.structs.asdict(p) for p in self.problems],
            "notes": self.notes,
        }


class _RunRow(msgspec.Struct):
    run_id: str
    parent_run_id: str | None
    fork_seq: int | None
    root_run_id: str
    # what this run's events rows hold in journal.run_col (run_key, or the run id)
    key: Any = None


def verify_journal(
    journal: Journal, run_id: str | None = None, anchor: dict[str, Any] | None = None
) -> VerifyReport:
    """Check the whole journal (or one run and its ancestors); see the module docstring.
    Every read sees one moment of the journal: appends of other processes meanwhile are not
    rows without a run, nor texts no event uses."""
    with journal.read_snapshot():
        return _Checker(journal).run(run_id, anchor)


def _text(value: Any) -> tuple[str, bool]:
    """A TEXT cell as str, and whether it was valid UTF-8."""
    if value is None:
        return "", True
    if isinstance(value, str):
        return value, True
    raw = bytes(value)
    try:
        return raw.decode("utf-8"), True
    except UnicodeDecodeError:
        return raw.decode("utf-8", "backslashreplace"), False


class _Checker:
    def __init__(self, journal: Journal) -> None:
        self.j = journal
        self.sqlite = journal.is_sqlite
        self.keyed = journal.keyed
        self.problems: list[VerifyProblem] = []
        self.notes: list[str] = []
        self.events_checked = 0
        self.snapshots_checked = 0
        self.anchored = 0
        # seq -> hash of the runs' own events, kept for runs that have children (fork points)
        self.hashes: dict[str, dict[int, str]] = {}
        self.heads: dict[str, int] = {}
        self.broken_runs: set[str] = set()
        # digest -> the text as stored, and the digests whose text no longer matches its key
        self.texts: dict[bytes, bytes] = {}
        self.bad_texts: set[bytes] = set()
        # the digests events refer to (directly or through the rows they are rebuilt from)
        self.used_texts: set[bytes] = set()
        # run -> how many rows its check read (its id range): what the orphan check accounts
        self.span_rows: dict[str, int] = {}
        self.newest_version = -1  # the newest event schema of any row read
        # v4 payloads refer to earlier events: resolved from the rows as stored
        self.runs: dict[str, _RunRow] = {}
        self.resolver = ev.Resolver(self.owner_of, self.load_row, self.stored_text, self.parent_of)
        # v6 rows are packed against their block's earlier rows, as stored
        self.unpacker = packing.Unpacker(self.fetch_own)

    # ---------------------------------------------------------------- helpers

    def add(self, run_id: str | None, seq: int | None, problem: str, code: str) -> None:
        if run_id is not None:
            self.broken_runs.add(run_id)
            if sum(p.run_id == run_id for p in self.problems) >= MAX_FINDINGS_PER_RUN:
                return
        self.problems.append(VerifyProblem(run_id, seq, problem, code))

    def typeof(self, col: str) -> str:
        return f"typeof({col})" if self.sqlite else "NULL"

    def raw(self, col: str) -> str:
        """The column's bytes as stored, whatever their type (TEXT that is not UTF-8 too)."""
        return f"CAST({col} AS BLOB)" if self.sqlite else col

    def query(self, sql: str, args: Iterable[Any] = ()) -> list[tuple[Any, ...]]:
        return self.j.query(sql, list(args))

    def guarded(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            self.add(None, None, f"cannot check {what}: {first}", "unreadable")
            return None

    # ------------------------------------------------------------------- run

    def run(self, run_id: str | None, anchor: dict[str, Any] | None) -> VerifyReport:
        self.guarded("the database file", self.check_file)
        tables = self.guarded("the schema", self.check_schema) or set()
        runs: dict[str, _RunRow] = {}
        if {"runs", "events"} <= tables:
            runs = self.guarded("the runs table", self.read_runs) or {}
        targets = list(runs)
        if run_id is not None:
            info = self.j.run(run_id)  # UnknownRun is a usage error, not a finding
            targets = self.ancestry(runs, info.run_id)
        if "texts" in tables:
            self.guarded("the texts table", self.read_texts)
        if "kinds" in tables:
            self.guarded("the kinds table", self.check_kinds)
        self.runs = runs
        if {"runs", "events"} <= tables:
            for rid in self.topological(runs, targets):
                self.guarded(f"run {rid}", self.check_run, runs, rid)
            if run_id is None:
                self.guarded("events without a run", self.check_orphans, runs)
                if "texts" in tables:
                    self.guarded("the texts' use", self.check_unused_texts)
            self.check_event_versions()
        if "snapshots" in tables and "events" in tables:
            self.guarded("the snapshots", self.check_snapshots, runs, set(targets))
        if run_id is None and self.j.revision not in (None, "0001_journal_tables"):
            self.guarded("the leases", self.check_leases, runs)
        if anchor is not None:
            from engine.anchor import compare_anchor

            found = self.guarded("the anchor", compare_anchor, self.j, anchor, set(targets))
            if found is not None:
                problems, self.anchored, notes = found
                for p in problems:
                    self.add(p.run_id, p.seq, p.problem, p.code)
                self.notes.extend(notes)
        return VerifyReport(
            runs_checked=len(targets),
            events_checked=self.events_checked,
            problems=self.problems,
            snapshots_checked=self.snapshots_checked,
            anchored_runs=self.anchored,
            notes=self.notes,
        )

    # ------------------------------------------------------------ file/schema

    def check_file(self) -> None:
        if not self.sqlite:
            return
        rows = self.query("PRAGMA quick_check")
        # one finding a line of SQLite's report, without its "*** in database main ***" banner
        bad = [
            line.strip()
            for r in rows
            if str(r[0]) != "ok"
            for line in str(r[0]).splitlines()
            if line.strip() and not line.startswith("*** in database ")
        ]
        for line in bad[:10]:
            self.add(None, None, f"database file damaged: {line}", "damaged")
        if len(bad) > 10:
            self.add(None, None, f"database file damaged: {len(bad) - 10} more", "damaged")

    def check_schema(self) -> set[str]:
        usable: set[str] = set()
        for table, cols in (KEYED_COLUMNS if self.keyed else EXPECTED_COLUMNS).items():
            if table == "texts" and self.j.revision in (
                "0001_journal_tables",
                "0002_refuse_rewrites",
            ):
                continue
            if self.sqlite:
                rows = self.query("SELECT name FROM pragma_table_info(?)", [table])
            else:
                rows = self.query(
                    "SELECT column_name FROM information_schema.columns"
                    " WHERE table_schema = current_schema() AND table_name = ?",
                    [table],
                )
            have = {str(r[0]) for r in rows}
            if not have:
                self.add(None, None, f"table {table!r} is missing (renamed or dropped)", "schema")
                continue
            missing = [c for c in cols if c not in have]
            for c in missing:
                self.add(
                    None, None, f"column {table}.{c} is missing (renamed or dropped)", "schema"
                )
            if not missing:
                usable.add(table)
        self.check_triggers()
        self.guarded("alembic_version", self.check_alembic_version)
        return usable

    def check_alembic_version(self) -> None:
        """One row: which of several a reader takes depends on the order it reads them in."""
        if self.j.revision is None:
            return
        (n,) = self.query("SELECT count(*) FROM alembic_version")[0]
        if n != 1:
            self.add(
                None,
                None,
                f"alembic_version holds {n} rows, not one: the schema revision is ambiguous",
                "schema",
            )

    def check_triggers(self) -> None:
        revision = self.j.revision or ""
        wanted: list[str] = []
        table = _SQLITE_TRIGGERS if self.sqlite else _PG_TRIGGERS
        for rev, names in table.items():
            wanted.extend(names)
            if rev == revision:
                break
        if self.sqlite:
            rows = self.query(
                "SELECT name, 'O', tbl_name, sql FROM sqlite_master WHERE type = 'trigger'"
            )
            have = {str(r[0]) for r in rows}
        else:
            have = self.check_pg_triggers(set(wanted))
        for name in wanted:
            if name not in have:
                self.add(
                    None,
                    None,
                    f"append-only trigger {name!r} is missing: the database no longer refuses "
                    "rewrites",
                    "trigger",
                )
        if self.sqlite:
            self.check_trigger_bodies(rows, set(wanted))
        else:
            self.guarded("the triggers' settings", self.check_pg_firing)
        if revision == "0001_journal_tables":
            self.notes.append(
                "journal at schema revision 0001: REPLACE is not refused; open it for writing "
                "once (`car db upgrade`) to add the triggers that refuse it"
            )

    def check_trigger_bodies(self, rows: list[tuple[Any, ...]], wanted: set[str]) -> None:
        """A SQLite trigger is only its SQL: one kept under its name but made to refuse nothing
        (a WHEN that never holds, another table, a body that does not raise) refuses nothing,
        and another trigger on a history table may change what the engine writes."""
        for name, _state, table, sql in rows:
            name, table = str(name), str(table)
            if name in wanted:
                if _trigger_refuses(name, table, str(sql or "")):
                    continue
                self.trigger_altered(name)
            elif table.lower() in _HISTORY_TABLES:
                self.add(
                    None,
                    None,
                    f"trigger {name!r} on history table {table!r} is not the journal's",
                    "trigger",
                )

    def trigger_altered(self, name: str) -> None:
        self.add(
            None,
            None,
            f"append-only trigger {name!r} was altered: it no longer refuses what it should",
            "trigger",
        )

    def check_pg_triggers(self, wanted: set[str]) -> set[str]:
        """The names of the journal's triggers found on their tables (of the current schema,
        the one readers read), after a finding for each that is disabled or fires only in
        replica sessions, is made to fire on something else (another event, a WHEN, a column
        list, AFTER), runs a function whose body is not the journal's (CREATE OR REPLACE
        FUNCTION: a body that returns without raising refuses nothing), or is on a history
        table and is not the journal's at all."""
        rows = self.query(
            "SELECT t.tgname, t.tgenabled, c.relname, t.tgtype,"
            " t.tgqual IS NULL AND t.tgattr::text = '' AND t.tgconstraint = 0,"
            " t.tgfoid::regprocedure::text, l.lanname, p.prosrc"
            " FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid"
            " JOIN pg_proc p ON p.oid = t.tgfoid JOIN pg_language l ON l.oid = p.prolang"
            " WHERE NOT t.tgisinternal AND c.relnamespace = current_schema()::regnamespace"
            " AND c.relname IN ('events', 'runs', 'snapshots', 'texts', 'kinds')"
            " ORDER BY c.relname, t.tgname"
        )
        want_body = " ".join(PG_REFUSE_BODY.split())
        found: set[str] = set()
        altered: dict[str, list[str]] = defaultdict(list)  # function -> the triggers running it
        for name, state, table, tgtype, plain, function, language, source in rows:
            name, table = str(name), str(table)
            target, _, action = name.partition("_")
            if name not in wanted or target != table:
                self.add(
                    None,
                    None,
                    f"trigger {name!r} on history table {table!r} is not the journal's",
                    "trigger",
                )
                continue
            found.add(name)
            if state == "D":
                self.add(None, None, f"append-only trigger {name!r} is disabled", "trigger")
            elif state == "R":
                self.add(
                    None,
                    None,
                    f"append-only trigger {name!r} fires only in replica sessions: it refuses"
                    " nothing otherwise",
                    "trigger",
                )
            if tgtype != _PG_TRIGGER_TYPES.get(action) or not plain:
                self.trigger_altered(name)
            elif language != "plpgsql" or " ".join(str(source or "").split()) != want_body:
                altered[str(function)].append(name)
        for function, names in altered.items():
            self.add(
                None,
                None,
                f"append-only trigger function {function} is not the journal's (replaced?):"
                f" {', '.join(names)} may refuse nothing",
                "trigger",
            )
        return found

    def check_pg_firing(self) -> None:
        """What makes the triggers not fire although they are intact, or readers not see
        every row: session_replication_role set to replica for the database or a role (no
        ORIGIN trigger fires in such a session), a rule on a history table (it rewrites what
        the engine writes or reads), row-level security on one (it hides rows from a role)."""
        (role,) = self.query("SELECT current_setting('session_replication_role')")[0]
        if str(role) != "origin":
            self.add(
                None,
                None,
                f"session_replication_role is {role!r} in this session: the append-only"
                " triggers do not fire in it",
                "trigger",
            )
        rows = self.query(
            "SELECT s.setdatabase <> 0, coalesce(r.rolname, ''), c FROM pg_db_role_setting s"
            " LEFT JOIN pg_roles r ON r.oid = s.setrole, unnest(s.setconfig) AS c"
            " WHERE s.setdatabase IN (0, (SELECT oid FROM pg_database"
            " WHERE datname = current_database()))"
        )
        for this_db, who, setting in rows:
            key, _, value = str(setting).partition("=")
            if key.strip().lower() != "session_replication_role" or value == "origin":
                continue
            where = "this database" if this_db else "every database"
            if who:
                where = f"role {who!r} in {where}"
            self.add(
                None,
                None,
                f"session_replication_role is set to {value!r} for {where}: the append-only"
                " triggers do not fire in its sessions",
                "trigger",
            )
        history = "('events', 'runs', 'snapshots', 'texts', 'kinds')"
        for name, table in self.query(
            "SELECT rulename, tablename FROM pg_rules WHERE schemaname = current_schema()"
            f" AND tablename IN {history} ORDER BY tablename, rulename"
        ):
            self.add(
                None,
                None,
                f"rule {str(name)!r} on history table {str(table)!r} is not the journal's",
                "trigger",
            )
        for (table,) in self.query(
            "SELECT relname FROM pg_class WHERE relnamespace = current_schema()::regnamespace"
            f" AND relname IN {history} AND (relrowsecurity OR relforcerowsecurity)"
            " ORDER BY relname"
        ):
            self.add(
                None,
                None,
                f"row-level security is on for history table {str(table)!r}: readers may not"
                " see all of its rows",
                "trigger",
            )

    # ------------------------------------------------------------------ runs

    def read_runs(self) -> dict[str, _RunRow]:
        key = f", run_key, {self.typeof('run_key')}" if self.keyed else ", NULL, NULL"
        # readers take these cells as text only: one stored as bytes (however valid its UTF-8)
        # is a run they cannot read, or, as a run_id, a second row under the same name
        typed = ", ".join(self.typeof(c) for c in _RUN_TEXT_COLUMNS)
        rows = self.query(
            f"SELECT {self.raw('run_id')}, {self.raw('parent_run_id')}, fork_seq,"
            f" {self.typeof('fork_seq')}, {self.raw('root_run_id')}, {self.raw('scenario')},"
            f" {self.raw('created_at')}, {self.raw('label')}{key}, {typed} FROM runs"
        )
        runs: dict[str, _RunRow] = {}
        for r in rows:
            rid, ok = _text(r[0])
            if rid in runs:
                self.add(
                    rid,
                    None,
                    "a second runs row with this run id: readers see only one of them",
                    "run_row",
                )
            if self.sqlite:
                for col, ctype in zip(_RUN_TEXT_COLUMNS, r[10:], strict=True):
                    nullable = col == "parent_run_id"
                    if ctype != "text" and not (nullable and ctype == "null"):
                        self.add(rid, None, f"run row's {col} is a {ctype}, not text", "type")
            run_key: Any = rid
            if self.keyed:
                run_key = r[8]
                if not isinstance(run_key, int) or (self.sqlite and r[9] != "integer"):
                    self.add(rid, None, f"run row's run_key {run_key!r} is not an integer", "type")
            texts = [_text(v) for v in (r[1], r[4], r[5], r[6], r[7])]
            if not ok or not all(t[1] for t in texts):
                self.add(rid, None, "run row holds bytes that are not UTF-8 text", "encoding")
            if self.sqlite and r[3] not in ("integer", "null"):
                self.add(rid, None, f"run row's fork_seq is a {r[3]}, not an integer", "type")
            if texts[3][1] and not (self.sqlite and r[6] is None):  # a null: said above
                try:
                    dt.datetime.fromisoformat(texts[3][0])
                except ValueError:
                    self.add(
                        rid,
                        None,
                        f"run row's created_at {texts[3][0]!r} is not an ISO 8601 time",
                        "type",
                    )
            parent = texts[0][0] if r[1] is not None else None
            fork_seq = r[2] if isinstance(r[2], int) else None
            runs[rid] = _RunRow(rid, parent, fork_seq, texts[1][0], run_key)
        owner_of_key: dict[Any, str] = {}
        for info in runs.values():
            if not self.keyed or not isinstance(info.key, int):
                continue
            other = owner_of_key.setdefault(info.key, info.run_id)
            if other != info.run_id:
                # (PostgreSQL, its UNIQUE constraint dropped) both read the same event rows
                self.add(
                    info.run_id,
                    None,
                    f"run_key {info.key} is also that of run {other!r}: each reads the other's"
                    " events",
                    "run_row",
                )
        for info in runs.values():
            if info.parent_run_id is None:
                if info.fork_seq is not None:
                    self.add(info.run_id, None, "a root run with a fork point", "run_row")
                if info.root_run_id != info.run_id:
                    self.add(info.run_id, None, "a root run that names another root", "run_row")
                continue
            parent_row = runs.get(info.parent_run_id)
            if parent_row is None:
                self.add(
                    info.run_id,
                    None,
                    f"parent run {info.parent_run_id!r} has no row (deleted?)",
                    "missing_parent",
                )
                continue
            if info.fork_seq is None or info.fork_seq < 0:
                self.add(info.run_id, None, "a branch without a valid fork point", "run_row")
            if info.root_run_id != parent_row.root_run_id:
                self.add(info.run_id, None, "root run differs from its parent's", "run_row")
        return runs

    def ancestry(self, runs: dict[str, _RunRow], rid: str) -> list[str]:
        chain = [rid]
        while (p := runs.get(chain[-1])) is not None and p.parent_run_id in runs:
            chain.append(p.parent_run_id)
            if len(chain) > len(runs):
                break
        return list(reversed(chain))

    def topological(self, runs: dict[str, _RunRow], targets: list[str]) -> list[str]:
        """Parents before children, so a fork's first hash can chain on its parent's."""
        want = set(targets)
        children: dict[str | None, list[str]] = defaultdict(list)
        for info in runs.values():
            parent = info.parent_run_id if info.parent_run_id in runs else None
            children[parent].append(info.run_id)
        order: list[str] = []
        stack = sorted(children[None], reverse=True)
        seen: set[str] = set()
        while stack:
            rid = stack.pop()
            if rid in seen:
                continue
            seen.add(rid)
            if rid in want:
                order.append(rid)
            stack.extend(sorted(children.get(rid, []), reverse=True))
        # a cycle of parent pointers is never reached from a root
        for rid in targets:
            if rid not in seen:
                self.add(rid, None, "run is not reachable from a root (parent cycle)", "run_row")
        return order

    def check_kinds(self) -> None:
        """`kinds` must name each code as the engine does: the events rows hold only codes."""
        rows = self.query(f"SELECT code, {self.typeof('code')}, {self.raw('name')} FROM kinds")
        have: dict[Any, str] = {}
        for code, ctype, raw_name in rows:
            name, _ok = _text(raw_name)
            if not isinstance(code, int) or (self.sqlite and ctype != "integer"):
                self.add(
                    None,
                    None,
                    f"kinds row {name!r} has a code {code!r} that is not an integer",
                    "kinds",
                )
                continue
            have[code] = name
        for code, name in sorted(KIND_NAMES.items()):
            if code not in have:
                self.add(None, None, f"kinds lacks code {code} ({name!r})", "kinds")
            elif have[code] != name:
                self.add(
                    None,
                    None,
                    f"kinds names code {code} {have[code]!r}, not {name!r}: a renamed kind",
                    "kinds",
                )
        for code in sorted(set(have) - set(KIND_NAMES)):
            self.add(None, None, f"kinds holds code {code} ({have[code]!r}), unknown here", "kinds")

    # ----------------------------------------------------------------- texts

    def read_texts(self) -> None:
        """Re-hash every stored text; an altered one is a finding here and at every event
        that uses it."""
        rows = self.query(
            f"SELECT {self.raw('hash')}, {self.raw('body')}, {self.typeof('body')},"
            f" {self.typeof('hash')} FROM texts"
        )
        stored: dict[bytes, bytes] = {}
        for raw_key, body, btype, ktype in rows:
            key, _ok = _text(raw_key)
            body = bytes(body or b"")
            if self.sqlite and btype != "blob":
                # readers read the cell as it is typed: text that is not UTF-8 fails them
                self.add(None, None, f"text {key} stored as {btype}, not as bytes", "type")
            try:
                if not key.startswith(ev.TEXT_PREFIX):
                    raise ValueError(key)
                digest = bytes.fromhex(key.removeprefix(ev.TEXT_PREFIX))
                if len(digest) != DIGEST_BYTES:
                    raise ValueError(key)
            except ValueError:
                self.add(None, None, f"texts row with a malformed key {key!r}", "text")
                continue
            if key != ev.text_key(digest) or (self.sqlite and ktype != "text"):
                # readers look a text up by its key as text, exactly: they never see this row,
                # so its body must not stand in for the one they do see
                what = f"a {ktype}" if self.sqlite and ktype != "text" else "not as written"
                self.add(
                    None, None, f"texts row keyed {key!r} ({what}): readers never read it", "text"
                )
                continue
            if digest in stored:
                self.add(
                    None, None, f"a second texts row under {key}: readers see only one", "text"
                )
                continue
            stored[digest] = body
        for digest, body in stored.items():
            key = ev.text_key(digest)
            try:
                body = self.unpacked_text(stored, digest)
            except ValueError as e:
                self.bad_texts.add(digest)
                self.add(None, None, f"text {key} does not unpack: {e}", "text")
                continue
            self.texts[digest] = body
            if ev.text_digest(body) != digest:
                self.bad_texts.add(digest)
                self.add(None, None, f"text {key} altered: its bytes no longer hash to it", "text")

    def unpacked_text(self, stored: dict[bytes, bytes], digest: bytes, depth: int = 0) -> bytes:
        """A text's plain bytes from the texts as stored (a packed one's base unpacked too)."""
        if digest not in stored:
            raise ValueError(f"it is packed against text {ev.text_key(digest)}, which is missing")

        def base_of(base: bytes, deeper: int) -> bytes:
            return self.unpacked_text(stored, base, deeper)

        return packing.plain_text(stored[digest], base_of, depth)

    def resolved(self, rid: str, seq: int, body: bytes) -> bytes | None:
        """The full bytes of a v3 payload from the texts as stored; None (after a finding) when
        a reference cannot be read or resolved."""
        try:
            refs = ev.refs_of(body)
        except Exception as e:
            self.add(rid, seq, f"stored payload does not parse: {e}", "undecodable")
            return None
        self.used_texts.update(refs)
        for d in refs:
            if d not in self.texts:
                self.add(rid, seq, f"uses text {ev.text_key(d)}, which is missing", "text")
                return None
            if d in self.bad_texts:
                self.add(rid, seq, f"uses altered text {ev.text_key(d)}", "text")
        try:
            return ev.resolve(body, self.texts.__getitem__)
        except Exception as e:
            self.add(rid, seq, f"stored payload does not resolve: {e}", "undecodable")
            return None

    def owner_of(self, rid: str, seq: int) -> str:
        """The run that holds event `seq` of run `rid`'s history, by the runs rows."""
        info = self.runs.get(rid)
        seen = 0
        while info is not None and info.parent_run_id is not None and seq < (info.fork_seq or 0):
            info = self.runs.get(info.parent_run_id)
            seen += 1
            if seen > len(self.runs):
                break
        return info.run_id if info is not None else rid

    def parent_of(self, rid: str) -> str | None:
        info = self.runs.get(rid)
        return info.parent_run_id if info is not None else None

    def span(self, rid: str, lo: int, hi: int) -> tuple[str, list[Any]]:
        """WHERE clause and arguments for run `rid`'s own rows with lo <= seq < hi: a range of
        the primary key when the run row holds an integer key."""
        info = self.runs.get(rid)
        key = info.key if info is not None else rid
        if not self.keyed:
            return "run_id = ? AND seq >= ? AND seq < ?", [rid, lo, hi]
        if isinstance(key, int):
            return "id >= ? AND id < ?", [key * SPAN + lo, key * SPAN + min(hi, SPAN)]
        return "run_key = ? AND seq >= ? AND seq < ?", [key, lo, hi]

    def load_row(self, rid: str, seq: int) -> tuple[int, bytes]:
        where, args = self.span(rid, seq, seq + 1)
        rows = self.query(f"SELECT version, {self.raw('payload')} FROM events WHERE {where}", args)
        if not rows:
            raise ValueError(f"it refers to event {seq} of run {rid}, which is missing")
        version, stored = int(rows[0][0]), bytes(rows[0][1] or b"")
        return version, self.unpacker.plain(rid, seq, version, stored)

    def fetch_own(self, rid: str, lo: int, hi: int) -> list[tuple[int, int, bytes]]:
        """(seq, version, payload as stored) of run `rid`'s own rows with lo <= seq < hi."""
        where, args = self.span(rid, lo, hi)
        rows = self.query(
            f"SELECT seq, version, {self.raw('payload')} FROM events WHERE {where} ORDER BY seq",
            args,
        )
        return [(int(s), int(v), bytes(p or b"")) for s, v, p in rows]

    def stored_text(self, digest: bytes) -> bytes:
        self.used_texts.add(digest)
        if digest not in self.texts:
            raise ValueError(f"it uses text {ev.text_key(digest)}, which is missing")
        return self.texts[digest]

    def resolved_v4(self, rid: str, seq: int, body: bytes) -> bytes | None:
        """The full bytes of a v4 payload, rebuilt from the rows it refers to as they are
        stored; None (after a finding) when a reference does not resolve."""
        try:
            return self.resolver.resolve(rid, seq, body)
        except Exception as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            self.add(rid, seq, f"stored payload does not resolve: {first}", "undecodable")
            return None

    # ---------------------------------------------------------------- events

    def fork_prev(self, runs: dict[str, _RunRow], info: _RunRow) -> str | None:
        """The hash a branch's first event chains on: its parent history's at fork_seq - 1."""
        seq = (info.fork_seq or 0) - 1
        if seq < 0:
            return ""
        owner = runs.get(info.parent_run_id or "")
        while owner is not None:
            start = owner.fork_seq or 0 if owner.parent_run_id is not None else 0
            if seq >= start:
                return self.hashes.get(owner.run_id, {}).get(seq)
            owner = runs.get(owner.parent_run_id or "")
        return None

    def check_run(self, runs: dict[str, _RunRow], rid: str) -> None:
        info = runs[rid]
        has_children = any(r.parent_run_id == rid for r in runs.values())
        keep: dict[int, str] | None = {} if has_children else None
        start = info.fork_seq or 0 if info.parent_run_id is not None else 0
        prev: str | None = ""
        if info.parent_run_id is not None and info.parent_run_id in runs:
            prev = self.fork_prev(runs, info)
            parent_head = self.heads.get(info.parent_run_id)
            if parent_head is not None and start > parent_head:
                self.add(
                    rid,
                    start,
                    f"fork point {start} is beyond the parent's {parent_head} events",
                    "fork_point",
                )
            elif prev is None:
                self.add(rid, start - 1, "fork point missing from the parent", "fork_point")
        where, args = self.span(rid, 0, SPAN)
        rows = self.query(
            f"SELECT seq, {self.typeof('seq')}, step, {self.typeof('step')},"
            f" {'kind' if self.keyed else self.raw('kind')}, version, {self.typeof('payload')},"
            f" {self.raw('payload')}, {self.raw('hash')}, {self.typeof('hash')},"
            f" {'id, run_key' if self.keyed else 'NULL, NULL'}"
            f" FROM events WHERE {where} ORDER BY seq",
            args,
        )
        self.span_rows[rid] = len(rows)
        expected = start
        resync = prev is None  # no known predecessor hash: take the first stored one
        first_finding = len(self.problems)
        packed: set[int] = set()  # seqs of v6 rows stored packed against their block
        ended: int | None = None  # seq of the run's RunEnded: only its accusation may follow
        accused = False
        for (
            seq,
            seq_type,
            step,
            step_type,
            kind_raw,
            version,
            ptype,
            payload,
            hash_raw,
            htype,
            row_id,
            row_key,
        ) in rows:
            self.events_checked += 1
            if not isinstance(seq, int) or (self.sqlite and seq_type != "integer"):
                self.add(rid, None, f"seq cell {seq!r} is not an integer", "type")
                continue
            if seq < start:
                self.add(rid, seq, f"event below the branch's fork point {start}", "out_of_place")
                continue
            if seq != expected:
                self.add(
                    rid,
                    expected,
                    f"events {expected}..{seq - 1} removed (next seq {seq})",
                    "removed",
                )
                expected = seq
                resync = True
            if self.keyed:
                # the CHECK that ties them can be switched off (ignore_check_constraints)
                if not isinstance(row_key, int) or row_id != row_key * SPAN + seq:
                    self.add(
                        rid,
                        seq,
                        f"row key {row_id!r} disagrees with its run_key {row_key!r} and seq",
                        "key",
                    )
                kind, stored_hash = self.keyed_cells(rid, seq, kind_raw, hash_raw, htype)
            else:
                kind, kind_ok = _text(kind_raw)
                stored_hash, hash_ok = _text(hash_raw)
                if not kind_ok or not hash_ok:
                    self.add(
                        rid, seq, "kind or hash holds bytes that are not UTF-8 text", "encoding"
                    )
            if self.sqlite and ptype != "blob":
                self.add(rid, seq, f"payload stored as {ptype}, not as bytes", "type")
            if self.sqlite and step_type not in ("integer", "null"):
                self.add(rid, seq, f"step cell is a {step_type}, not an integer", "type")
            body = bytes(payload) if payload is not None else b""
            if not isinstance(version, int) or not 0 <= version < 1 << 32:
                # nothing to hash the row by (the chain packs it as 32 bits) nor to decode it
                # by: said, and the run read on from the row's stored hash
                what = "is not an integer" if not isinstance(version, int) else "is out of range"
                self.add(rid, seq, f"version cell {version!r} {what}", "type")
                resync, prev, expected = True, stored_hash, seq + 1
                continue
            if version > self.newest_version:
                self.newest_version = version
            if version >= 6:
                if packing.is_packed(body):
                    packed.add(seq)
                try:
                    body = self.unpacker.plain(rid, seq, version, body)
                except (ValueError, TypeError) as e:
                    self.add(rid, seq, f"stored payload does not unpack: {e}", "undecodable")
                    resync, prev, expected = True, stored_hash, seq + 1
                    continue
            if version >= 3:
                full = (
                    self.resolved_v4(rid, seq, body)
                    if version >= 4
                    else self.resolved(rid, seq, body)
                )
                if full is None:
                    resync, prev, expected = True, stored_hash, seq + 1
                    continue
                body = full
            if not resync and chain_hash(prev or "", seq, kind, version, body) != stored_hash:
                self.add(rid, seq, "hash mismatch: event altered or reordered", "hash")
            resync = False
            prev = stored_hash
            if keep is not None:
                keep[seq] = stored_hash
            expected = seq + 1
            try:
                decoded = ev.decode(body, version)
            except Exception as e:
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                self.add(rid, seq, f"undecodable payload: {first}", "undecodable")
                continue
            if ev.kind_of(decoded) != kind:
                self.add(
                    rid,
                    seq,
                    f"kind column {kind!r} disagrees with the event ({ev.kind_of(decoded)!r})",
                    "kind",
                )
            if decoded.step != step:
                self.add(
                    rid,
                    seq,
                    f"step column {step!r} disagrees with the event (step {decoded.step!r})",
                    "step",
                )
            if ended is not None and (kind != "suspicion_declared" or accused):
                # no writer appends to an ended run but its one accusation: a later end (another
                # status, another outcome) or step would change what readers report
                self.add(rid, seq, f"{kind} after the run's end (seq {ended})", "after_end")
            accused = accused or (ended is not None and kind == "suspicion_declared")
            if ended is None and kind == "run_ended":
                ended = seq
        self.heads[rid] = expected
        if keep is not None:
            self.hashes[rid] = keep
        self.problems[first_finding:] = self.blame_packing(
            rid, self.problems[first_finding:], packed
        )

    @staticmethod
    def blame_packing(
        rid: str, found: list[VerifyProblem], packed: set[int]
    ) -> list[VerifyProblem]:
        """A packed row unpacks against its block's earlier rows: when one of those is altered,
        what goes wrong with the later packed rows is said once each, naming it."""
        out: list[VerifyProblem] = []
        first_bad: dict[int, int] = {}
        blamed: set[int] = set()
        for p in found:
            if p.run_id != rid or p.seq is None:
                out.append(p)
                continue
            start = p.seq - p.seq % packing.BLOCK
            bad = first_bad.setdefault(start, p.seq)
            if bad < p.seq and p.seq in packed:
                if p.seq not in blamed:
                    blamed.add(p.seq)
                    out.append(
                        VerifyProblem(
                            rid,
                            p.seq,
                            f"packed against event {bad} of its block, which is altered,"
                            " missing or unreadable",
                            "packed",
                        )
                    )
                continue
            out.append(p)
        return out

    def keyed_cells(
        self, rid: str, seq: int, kind_cell: Any, hash_cell: Any, htype: Any
    ) -> tuple[str, str]:
        """(kind name, public hash) of an integer-keyed row, after a finding for a cell of the
        wrong type: a kind code unknown here, a hash that is not 32 bytes."""
        kind = KIND_NAMES.get(kind_cell) if isinstance(kind_cell, int) else None
        if kind is None:
            self.add(rid, seq, f"kind cell {kind_cell!r} is not a known kind code", "kind")
            kind = "?"
        digest = bytes(hash_cell) if hash_cell is not None else b""
        if (self.sqlite and htype != "blob") or len(digest) != DIGEST_BYTES:
            what = htype if self.sqlite and htype != "blob" else f"{len(digest)} bytes"
            self.add(rid, seq, f"hash cell is {what}, not a {DIGEST_BYTES}-byte digest", "type")
        return kind, HASH_PREFIX + digest.hex()

    def check_orphans(self, runs: dict[str, _RunRow]) -> None:
        if self.keyed:
            self.keyed_orphans(runs)
            return
        rows = self.query(
            f"SELECT {self.raw('run_id')}, min(seq), count(*) FROM events GROUP BY"
            f" {self.raw('run_id')}"
        )
        for raw_id, first, count in rows:
            rid, ok = _text(raw_id)
            if rid in runs and ok:
                continue
            self.add(
                rid,
                first if isinstance(first, int) else None,
                f"{count} events whose run has no row (deleted run or forged events)",
                "orphan",
            )
        if self.sqlite:
            (n,) = self.query("SELECT count(*) FROM events WHERE typeof(run_id) != 'text'")[0]
            if n:
                self.add(None, None, f"{n} events whose run id is not text", "type")

    def keyed_orphans(self, runs: dict[str, _RunRow]) -> None:
        """Event rows outside the id range of every run (id = run_key * 2**32 + seq): those of
        a deleted run, or forged ones, whatever their run_key column says (with the foreign
        key or the CHECK switched off it may name a run). No reader sees them, and no writer
        leaves them. When the runs' ranges hold every row (counted as each run was read), the
        table is not grouped at all."""
        keys = [info.key for info in runs.values()]
        ranges = {k for k in keys if isinstance(k, int)}
        (total,) = self.query("SELECT count(*) FROM events")[0]
        if (
            len(ranges) == len(keys)
            and set(self.span_rows) == set(runs)
            and sum(self.span_rows.values()) == total
        ):
            return
        # a run whose run_key is not an integer reads its rows by run_key (said in read_runs)
        by_column = {k for k in keys if not isinstance(k, int)}
        name = {info.key: info.run_id for info in runs.values()}
        rows = self.query(
            "SELECT id >> 32, run_key, min(seq), count(*) FROM events"
            " GROUP BY id >> 32, run_key ORDER BY 1, 3"
        )
        found: dict[Any, list[Any]] = {}  # range -> [first seq, count, run_key if one differs]
        for span, key, first, count in rows:
            if span in ranges or key in by_column:
                continue
            got = found.setdefault(span, [first, 0, None])
            got[1] += count
            if key != span:
                got[2] = key
        for span, (first, count, key) in found.items():
            seq = first if isinstance(first, int) else None
            if key is None:
                what = f"{count} events of run_key {span!r}, which names no run"
            else:
                what = f"{count} events in the id range of run_key {span!r}, which names no run"
                held = f"run {name[key]!r}" if key in name else f"{key!r}"
                what += f" (their run_key column holds {held})"
            self.add(None, seq, f"{what} (deleted run or forged events)", "orphan")

    def check_unused_texts(self) -> None:
        """Texts no event refers to. Every text is written in the transaction of the append
        whose rows refer to it (a run shares its parent's and other runs' texts by referring
        to them, never by leaving one behind), so one no event uses was put there by hand:
        bytes no reader reads. Said when every run was read whole; with damaged events the
        references of the damaged rows are not known."""
        unused = sorted(set(self.texts) - self.used_texts)
        if not unused:
            return
        if self.broken_runs or any(p.code == "unreadable" for p in self.problems):
            self.notes.append(
                f"{len(unused)} texts not checked for use: events that may use them are damaged"
            )
            return
        for digest in unused[:MAX_FILE_FINDINGS]:
            self.add(
                None,
                None,
                f"text {ev.text_key(digest)} is used by no event (forged or left by hand)",
                "text",
            )
        if len(unused) > MAX_FILE_FINDINGS:
            self.add(
                None,
                None,
                f"{len(unused) - MAX_FILE_FINDINGS} more texts are used by no event",
                "text",
            )

    def check_event_versions(self) -> None:
        """No row newer than the journal's revision allows: the revision is what makes an
        engine too old for the rows refuse the whole journal at open (a lowered
        alembic_version)."""
        newest = _MAX_EVENT_VERSION.get(self.j.revision or "")
        if newest is not None and self.newest_version > newest:
            self.add(
                None,
                None,
                f"events of schema v{self.newest_version} in a journal at revision"
                f" {self.j.revision}, which allows v{newest} at most (alembic_version lowered?)",
                "schema",
            )

    def check_leases(self, runs: dict[str, _RunRow]) -> None:
        """A lease of a run that has no row: a note, not a finding. Leases are the journal's
        one mutable table, not history (docs/decisions.md, entries 23 and 25), and one names a
        run only to tell its writer alive or dead; but `create_run` writes a run's first
        lease with its row, so one without a row was left by a writer that never created it,
        or by hand."""
        rows = self.query(f"SELECT {self.raw('run_id')} FROM leases ORDER BY 1")
        unknown = [rid for rid, _ok in (_text(r[0]) for r in rows) if rid not in runs]
        if unknown:
            more = f" and {len(unknown) - 1} more" if len(unknown) > 1 else ""
            self.notes.append(
                f"writer lease of run {unknown[0]!r}{more}, which has no row (leases are not"
                " history)"
            )

    # ------------------------------------------------------------- snapshots

    def check_snapshots(self, runs: dict[str, _RunRow], targets: set[str]) -> None:
        from engine.state import FOLD_VERSION, State, apply, decode_state, encode_state

        rows = self.query(
            f"SELECT {self.raw('run_id')}, seq, fold_version, {self.typeof('state')},"
            f" {self.raw('state')} FROM snapshots"
        )
        by_run: dict[str, list[tuple[int, bytes]]] = defaultdict(list)
        for raw_id, seq, fold_version, stype, blob in rows:
            rid, _ok = _text(raw_id)
            if rid not in runs:
                self.add(rid, seq, "snapshot of a run that has no row", "snapshot")
                continue
            if rid not in targets or fold_version != FOLD_VERSION:
                continue  # other fold versions are ignored by every reader
            if self.sqlite and stype != "blob":
                self.add(rid, seq, f"snapshot stored as {stype}, not as bytes", "snapshot")
            by_run[rid].append((int(seq), bytes(blob or b"")))
        for rid, snaps in by_run.items():
            if rid in self.broken_runs or (runs[rid].parent_run_id or "") in self.broken_runs:
                self.notes.append(f"snapshots of run {rid} not checked: its events are damaged")
                continue
            snaps.sort()
            s = State()
            for seq, blob in snaps:
                self.snapshots_checked += 1
                for stored in self.j.read(rid, s.seq, seq):
                    s = apply(s, ev.decode_for_fold(stored.payload, stored.version))
                try:
                    held = encode_state(decode_state(blob))
                except Exception as e:
                    self.add(rid, seq, f"snapshot does not decode: {e}", "snapshot")
                    continue
                if s.seq != seq or held != encode_state(s):
                    self.add(
                        rid,
                        seq,
                        "snapshot differs from the fold of the events it caches (forged)",
                        "snapshot",
                    )
