"""`car verify` against a corpus of tampering by someone with write access to the file: every
edit is a finding with its run and seq (or the whole file), never a traceback, and verify never
changes the file. With an anchor it also finds re-chained runs, cut tails, deleted runs and
altered run rows, which a chain alone cannot show."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from test_journal_contract import record, step_events

from engine import events as ev
from engine import packing
from engine.anchor import AnchorError, make_anchor, read_anchor
from engine.journal import KIND_CODES, KIND_NAMES, Journal, chain_hash, hash_cell, hash_text
from engine.state import FOLD_VERSION, build_snapshots, decode_state, encode_state
from engine.verify import VerifyReport, verify_journal

ROOT = Path(__file__).resolve().parent.parent
KEY = b"k" * 32


# the events rows of a run by its public id (they carry its run_key, docs/decisions.md 38)
KEY_OF = "(SELECT run_key FROM runs WHERE run_id = ?)"
KEY_OF_PG = "(SELECT run_key FROM runs WHERE run_id = %s)"


def build_template(path: Path) -> tuple[str, str]:
    """A journal at `path` with a 200-step run (601 events, one snapshot at 512) and a branch
    of it at seq 100 that goes on with a step of its own: (run, branch)."""
    with Journal(path) as j:
        run = record(j, 200)
        build_snapshots(j, run)
        child = j.fork(run, 100)
        j.append(child, [ev.Intervention(step=33, op="resample", at=33), *step_events(33)], 100)
        j.append(child, [ev.RunEnded(status="completed")])
        j.checkpoint()
    return run, child


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """The journal of `build_template`."""
    path = tmp_path_factory.mktemp("template") / "j.db"
    return (path, *build_template(path))


@pytest.fixture
def journal(template: tuple[Path, str, str], tmp_path: Path) -> tuple[Path, str, str]:
    path, run, child = template
    shutil.copy(path, tmp_path / "j.db")
    return tmp_path / "j.db", run, child


def raw(path: Path) -> sqlite3.Connection:
    """A plain client with the triggers dropped: the attacker's tool."""
    db = sqlite3.connect(path, isolation_level=None)
    for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'").fetchall():
        db.execute(f"DROP TRIGGER {name}")
    return db


def check(path: Path, anchor: dict[str, object] | None = None) -> VerifyReport:
    with Journal(path, readonly=True) as j:
        return verify_journal(j, anchor=anchor)


def findings(report: VerifyReport) -> set[tuple[str | None, int | None, str]]:
    """Findings other than the dropped triggers (which every tampering here causes)."""
    return {(p.run_id, p.seq, p.code) for p in report.problems if p.code != "trigger"}


def anchor_of(path: Path) -> dict[str, object]:
    with Journal(path, readonly=True) as j:
        return make_anchor(j, KEY, "2026-12-01T00:00:00")


def forge(db: sqlite3.Connection, run: str, seq: int, payload: bytes) -> None:
    """Store `payload` as event `seq`, as a careful attacker would: the later events of its
    block, packed against it (v6, engine/packing.py), packed again against the forgery."""
    start = seq - seq % packing.BLOCK
    rows = db.execute(
        f"SELECT seq, version, payload FROM events WHERE run_key = {KEY_OF}"
        " AND seq >= ? AND seq < ? ORDER BY seq",
        (run, start, start + packing.BLOCK),
    ).fetchall()
    plains, tail = {}, b""
    for s, version, stored in rows:
        plains[s] = packing.unpack(stored, tail) if version >= 6 else stored
        tail = (tail + plains[s])[-packing.WINDOW :]
    plains[seq], tail = payload, b""
    for s, version, _stored in rows:
        if s >= seq:
            new = packing.pack(plains[s], tail) if version >= 6 and s > seq else plains[s]
            db.execute(
                f"UPDATE events SET payload = ? WHERE run_key = {KEY_OF} AND seq = ?",
                (new, run, s),
            )
        tail = (tail + plains[s])[-packing.WINDOW :]


def rechain(db: sqlite3.Connection, run: str, start: int) -> None:
    """Recompute the hash chain of `run` from `start` on, as a careful attacker would: over
    the canonical bytes each stored payload is rebuilt into (the engine's own reader does
    that; v5 payloads are stored positional, the chain covers the maps)."""
    prev = hash_text(
        db.execute(
            f"SELECT hash FROM events WHERE run_key = {KEY_OF} AND seq = ?", (run, start - 1)
        ).fetchone()[0]
    )
    rows = db.execute(
        f"SELECT seq, kind, version FROM events WHERE run_key = {KEY_OF} AND seq >= ? ORDER BY seq",
        (run, start),
    ).fetchall()
    path = db.execute("PRAGMA database_list").fetchone()[2]
    with Journal(path, readonly=True) as j:
        canonical = {s.seq: s.payload for s in j.read(run, start)}
    for seq, kind, version in rows:
        prev = chain_hash(prev, seq, KIND_NAMES[kind], version, canonical[seq])
        db.execute(
            f"UPDATE events SET hash = ? WHERE run_key = {KEY_OF} AND seq = ?",
            (hash_cell(prev), run, seq),
        )


def test_intact_journal_verifies(journal: tuple[Path, str, str]) -> None:
    """The untouched journal: no findings, its snapshot re-derived, the anchor matching."""
    path, _run, _child = journal
    report = check(path, anchor_of(path))
    assert report.ok, report.problems
    assert report.snapshots_checked == 1 and report.anchored_runs == 2
    assert report.events_checked == 601 + 5


Tamper = Callable[[sqlite3.Connection, str, str], None]


def _forge_payload(db: sqlite3.Connection, run: str, _c: str) -> None:
    forged = ev.encode(ev.ChatMessage(step=1, agent="b", text="forged"))
    db.execute(f"UPDATE events SET payload = ? WHERE run_key = {KEY_OF} AND seq = 6", (forged, run))


def _step_column(db: sqlite3.Connection, run: str, _c: str) -> None:
    db.execute(f"UPDATE events SET step = 100 WHERE run_key = {KEY_OF} AND seq = 5", (run,))


def _kind_column(db: sqlite3.Connection, run: str, _c: str) -> None:
    code = KIND_CODES["tool_call"]
    db.execute(f"UPDATE events SET kind = ? WHERE run_key = {KEY_OF} AND seq = 5", (code, run))


def _orphan_events(db: sqlite3.Connection, run: str, _c: str) -> None:
    db.execute("PRAGMA foreign_keys = OFF")
    db.execute(
        "INSERT INTO events SELECT 999 * 4294967296 + seq, 999, seq, step, kind, version,"
        f" payload, hash FROM events WHERE run_key = {KEY_OF} AND seq < 4",
        (run,),
    )


def _unknown_kind(db: sqlite3.Connection, run: str, _c: str) -> None:
    db.execute(f"UPDATE events SET kind = 77 WHERE run_key = {KEY_OF} AND seq = 7", (run,))


def _kind_as_text(db: sqlite3.Connection, run: str, _c: str) -> None:
    db.execute(
        f"UPDATE events SET kind = 'chat_message' WHERE run_key = {KEY_OF} AND seq = 7", (run,)
    )


def _hash_cut(db: sqlite3.Connection, run: str, _c: str) -> None:
    db.execute(
        f"UPDATE events SET hash = substr(hash, 1, 16) WHERE run_key = {KEY_OF} AND seq = 7",
        (run,),
    )


def _hash_as_text(db: sqlite3.Connection, run: str, _c: str) -> None:
    db.execute(
        f"UPDATE events SET hash = 'b2:' || lower(hex(hash)) WHERE run_key = {KEY_OF} AND seq = 4",
        (run,),
    )


def _run_key_moved(db: sqlite3.Connection, run: str, _c: str) -> None:
    db.execute("PRAGMA foreign_keys = OFF")
    db.execute("UPDATE runs SET run_key = 500 WHERE run_id = ?", (run,))


def _key_disagrees(db: sqlite3.Connection, run: str, _c: str) -> None:
    db.execute("PRAGMA ignore_check_constraints = ON")
    db.execute(f"UPDATE events SET seq = 70 WHERE run_key = {KEY_OF} AND seq = 7", (run,))


def _kind_renamed(db: sqlite3.Connection, _r: str, _c: str) -> None:
    db.execute("UPDATE kinds SET name = 'forged' WHERE code = 6")


def _kind_dropped(db: sqlite3.Connection, _r: str, _c: str) -> None:
    db.execute("DELETE FROM kinds WHERE code = 3")


def _not_utf8_label(db: sqlite3.Connection, run: str, _c: str) -> None:
    db.execute("UPDATE runs SET label = CAST(x'c328' AS TEXT) WHERE run_id = ?", (run,))


def _payload_as_text(db: sqlite3.Connection, run: str, _c: str) -> None:
    db.execute(
        f"UPDATE events SET payload = CAST(payload AS TEXT) WHERE run_key = {KEY_OF} AND seq = 3",
        (run,),
    )


def _seq_as_text(db: sqlite3.Connection, run: str, _c: str) -> None:
    db.execute(f"UPDATE events SET step = 'two' WHERE run_key = {KEY_OF} AND seq = 8", (run,))


def _removed_event(db: sqlite3.Connection, run: str, _c: str) -> None:
    db.execute(f"DELETE FROM events WHERE run_key = {KEY_OF} AND seq = 9", (run,))


def _fork_point_moved(db: sqlite3.Connection, _r: str, child: str) -> None:
    db.execute("UPDATE runs SET fork_seq = 90 WHERE run_id = ?", (child,))


def _parent_deleted(db: sqlite3.Connection, run: str, _c: str) -> None:
    db.execute("PRAGMA foreign_keys = OFF")
    db.execute("DELETE FROM snapshots")
    db.execute("DELETE FROM runs WHERE run_id = ?", (run,))


def _forged_snapshot(db: sqlite3.Connection, run: str, _c: str) -> None:
    (blob,) = db.execute("SELECT state FROM snapshots WHERE run_id = ?", (run,)).fetchone()
    s = decode_state(blob)
    forged = encode_state(s.__class__(**{**_fields(s), "n_messages": s.n_messages + 5}))
    db.execute("UPDATE snapshots SET state = ?", (forged,))


def _garbage_snapshot(db: sqlite3.Connection, run: str, _c: str) -> None:
    db.execute("UPDATE snapshots SET state = x'00ff'")


def _fields(s: object) -> dict[str, object]:
    import msgspec

    return msgspec.structs.asdict(s)  # type: ignore[arg-type]


# tamper, then the findings verify must report: (run or None, seq or None, code); "R"/"C" stand
# for the run and the branch
CORPUS: list[tuple[str, Tamper, set[tuple[str | None, int | None, str]]]] = [
    ("forged payload", _forge_payload, {("R", 6, "hash")}),
    ("step column edited", _step_column, {("R", 5, "step")}),
    ("kind column edited", _kind_column, {("R", 5, "hash"), ("R", 5, "kind")}),
    ("events without a run", _orphan_events, {(None, 0, "orphan")}),
    ("kind code unknown", _unknown_kind, {("R", 7, "kind"), ("R", 7, "hash")}),
    ("kind cell is text", _kind_as_text, {("R", 7, "kind"), ("R", 7, "hash")}),
    ("hash cell cut short", _hash_cut, {("R", 7, "type"), ("R", 7, "hash")}),
    ("hash cell is text", _hash_as_text, {("R", 4, "type")}),
    # the run row now names key 500; its events still carry the old key
    ("run key points nowhere", _run_key_moved, {(None, 0, "orphan"), ("C", 100, "fork_point")}),
    ("row key disagrees with run_key and seq", _key_disagrees, {("R", 70, "key")}),
    ("kind renamed", _kind_renamed, {(None, None, "kinds")}),
    ("kind code dropped", _kind_dropped, {(None, None, "kinds")}),
    ("label not UTF-8", _not_utf8_label, {("R", None, "encoding")}),
    ("payload stored as TEXT", _payload_as_text, {("R", 3, "type")}),
    ("step cell is text", _seq_as_text, {("R", 8, "type"), ("R", 8, "step")}),
    ("event deleted", _removed_event, {("R", 9, "removed")}),
    ("fork point moved", _fork_point_moved, {("C", 90, "removed")}),
    (
        "parent run row deleted",
        _parent_deleted,
        {("C", None, "missing_parent"), (None, 0, "orphan")},
    ),
    ("forged snapshot", _forged_snapshot, {("R", 512, "snapshot")}),
    ("garbage snapshot", _garbage_snapshot, {("R", 512, "snapshot")}),
]


@pytest.mark.parametrize(("name", "tamper", "expected"), CORPUS, ids=[c[0] for c in CORPUS])
def test_tampering_found(
    journal: tuple[Path, str, str],
    name: str,
    tamper: Tamper,
    expected: set[tuple[str | None, int | None, str]],
) -> None:
    """Each edit is reported at its run and seq with the right kind of finding."""
    path, run, child = journal
    db = raw(path)
    tamper(db, run, child)
    db.close()
    names = {"R": run, "C": child}
    want = {(names.get(r or "", r), s, c) for r, s, c in expected}
    got = findings(check(path))
    assert want <= got, f"{name}: missing {want - got}, got {got}"


def test_schema_damage_found(journal: tuple[Path, str, str]) -> None:
    """Renamed and dropped tables and columns are findings about the file, not tracebacks."""
    path, _run, _child = journal
    db = raw(path)
    db.execute("ALTER TABLE snapshots RENAME TO snaps")
    db.execute("ALTER TABLE runs RENAME COLUMN label TO lbl")
    db.close()
    problems = [p.problem for p in check(path).problems if p.code == "schema"]
    assert any("'snapshots' is missing" in p for p in problems)
    assert any("runs.label is missing" in p for p in problems)
    db = raw(path)
    db.execute("DROP TABLE events")
    db.close()
    problems = [p.problem for p in check(path).problems if p.code == "schema"]
    assert any("'events' is missing" in p for p in problems)


def test_dropped_trigger_is_a_finding(journal: tuple[Path, str, str]) -> None:
    """A journal whose append-only triggers were dropped says so (it no longer refuses)."""
    path, _run, _child = journal
    raw(path).close()
    codes = {p.code for p in check(path).problems}
    assert codes == {"trigger"}


def _car(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli", *args], capture_output=True, text=True, cwd=ROOT, timeout=120
    )


def test_malformed_page_reported_not_raised(journal: tuple[Path, str, str]) -> None:
    """Bytes overwritten in the middle of the file: `car verify` names the damage on one line
    (exit 1), with no traceback, and the file is left as it was."""
    path, _run, _child = journal
    data = bytearray(path.read_bytes())
    page = 8192
    for i in range(5 * page, 7 * page):
        data[i] = 0xA5
    path.write_bytes(bytes(data))
    before = path.read_bytes()
    res = _car("--journal", str(path), "verify", "--json")
    assert res.returncode == 1
    assert "Traceback" not in res.stderr
    assert res.stderr.splitlines()[-1].startswith("error: journal")
    out = json.loads(res.stdout)
    assert not out["ok"] and out["problems"]
    assert path.read_bytes() == before


def test_verify_and_readers_never_write(journal: tuple[Path, str, str]) -> None:
    """verify, runs, show and state leave every byte of the journal file as it was (a WAL
    reader may leave the -wal/-shm sidecars SQLite needs, empty of history)."""
    path, run, _child = journal
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    mtime = path.stat().st_mtime_ns
    for args in (("verify",), ("runs", "--all"), ("show", run), ("state", run, "--at", "150")):
        res = _car("--journal", str(path), *args)
        assert res.returncode == 0, res.stderr
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest
    assert path.stat().st_mtime_ns == mtime
    assert sorted(os.listdir(path.parent))[0] == "j.db"
    wal = path.parent / "j.db-wal"
    assert not wal.exists() or wal.stat().st_size == 0


# ------------------------------------------------------------------ anchors


def test_rechained_run_found_only_with_anchor(journal: tuple[Path, str, str]) -> None:
    """A payload forged at seq 300 and the chain recomputed from there passes the chain check,
    but not the anchor, which says between which marks the rewrite starts."""
    path, run, _child = journal
    anchor = anchor_of(path)
    db = raw(path)
    forge(db, run, 300, ev.encode(ev.ChatMessage(step=99, agent="b", text="forged")))
    rechain(db, run, 300)
    db.close()
    assert findings(check(path)) == set()  # the chain alone is fooled
    problems = [p for p in check(path, anchor).problems if p.code == "rechained"]
    assert [p.run_id for p in problems] == [run]
    assert problems[0].seq is not None and 256 <= problems[0].seq <= 300
    assert "between seq 256 and 319" in problems[0].problem


def test_truncated_tail_found_with_anchor(journal: tuple[Path, str, str]) -> None:
    """Cutting the last events off a run is reported with the anchored and present heads."""
    path, run, _child = journal
    anchor = anchor_of(path)
    db = raw(path)
    db.execute("DELETE FROM snapshots")
    db.execute(f"DELETE FROM events WHERE run_key = {KEY_OF} AND seq >= 590", (run,))
    db.close()
    problems = [p for p in check(path, anchor).problems if p.code == "truncated"]
    assert [(p.run_id, p.seq) for p in problems] == [(run, 590)]
    assert "anchored with 601 events, now 590" in problems[0].problem


def test_deleted_run_found_with_anchor(journal: tuple[Path, str, str]) -> None:
    """A branch deleted whole (row and events) leaves no trace in the chain; the anchor names it."""
    path, _run, child = journal
    anchor = anchor_of(path)
    db = raw(path)
    db.execute(f"DELETE FROM events WHERE run_key = {KEY_OF}", (child,))
    db.execute("DELETE FROM runs WHERE run_id = ?", (child,))
    db.close()
    assert findings(check(path)) == set()
    assert {(p.run_id, p.code) for p in check(path, anchor).problems if p.code != "trigger"} == {
        (child, "deleted")
    }


def test_altered_run_row_found_with_anchor(journal: tuple[Path, str, str]) -> None:
    """A changed label or scenario is not history the chain covers; the anchor's row digest is."""
    path, run, _child = journal
    anchor = anchor_of(path)
    db = raw(path)
    db.execute("UPDATE runs SET label = 'renamed', scenario = 'other' WHERE run_id = ?", (run,))
    db.close()
    assert findings(check(path)) == set()
    assert (run, None, "run_row") in findings(check(path, anchor))


def test_runs_appended_after_the_anchor_are_fine(journal: tuple[Path, str, str]) -> None:
    """Growth is not tampering: more events and new runs after an anchor still verify."""
    path, run, _child = journal
    anchor = anchor_of(path)
    with Journal(path) as j:
        new = record(j, 2)
        j.append(run, [ev.RunEnded(status="completed")])
    report = check(path, anchor)
    assert report.ok, report.problems
    assert any("1 runs newer than the anchor" in n for n in report.notes), (new, report.notes)


def test_anchor_itself_is_authenticated(journal: tuple[Path, str, str], tmp_path: Path) -> None:
    """An edited anchor, or one checked with another key, is refused with a clear error."""
    path, _run, _child = journal
    doc = anchor_of(path)
    f = tmp_path / "a.json"
    f.write_text(json.dumps(doc))
    assert read_anchor(f, KEY)["runs"]
    doc["runs"][0]["head"] = 3  # type: ignore[index]
    f.write_text(json.dumps(doc))
    with pytest.raises(AnchorError, match="altered"):
        read_anchor(f, KEY)
    with pytest.raises(AnchorError, match="another key"):
        read_anchor(f, b"z" * 32)


def test_anchor_cli_round_trip(journal: tuple[Path, str, str], tmp_path: Path) -> None:
    """`car anchor -o` then `car verify --anchor` from the command line: OK, then after a
    re-chain one error line naming the run, exit 1; a missing key is a one-line error."""
    path, run, _child = journal
    key = tmp_path / "key"
    key.write_bytes(os.urandom(32))
    a = tmp_path / "anchor.json"
    res = _car("--journal", str(path), "anchor", "-o", str(a), "--key-file", str(key))
    assert res.returncode == 0, res.stderr
    res = _car("--journal", str(path), "verify", "--anchor", str(a), "--key-file", str(key))
    assert res.returncode == 0 and "2 runs match the anchor" in res.stdout, res.stderr
    db = raw(path)
    forge(db, run, 10, ev.encode(ev.ChatMessage(step=3, agent="a", text="x")))
    rechain(db, run, 10)
    db.close()
    res = _car("--journal", str(path), "verify", "--anchor", str(a), "--key-file", str(key))
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert f"run {run}" in res.stderr and "rewritten" in res.stderr + res.stdout
    env_less = _car("--journal", str(path), "anchor")
    assert env_less.returncode == 1 and env_less.stderr.startswith("error: an anchor needs a key")


def test_snapshot_flag_does_not_hide_other_runs(journal: tuple[Path, str, str]) -> None:
    """A snapshot row for a run that does not exist is a finding too."""
    path, run, _child = journal
    db = raw(path)
    db.execute("PRAGMA foreign_keys = OFF")
    db.execute(
        "INSERT INTO snapshots SELECT 'nobody', seq, fold_version, state FROM snapshots"
        " WHERE run_id = ?",
        (run,),
    )
    db.close()
    assert ("nobody", 512, "snapshot") in findings(check(path))
    assert FOLD_VERSION >= 1


# ------------------------------------------------------------------ PostgreSQL


def test_postgres_tampering_and_anchor(pg_url: str) -> None:
    """The same verifier on a PostgreSQL journal: a heist (its texts stored once) verifies;
    a disabled trigger, an edited text, a re-chained run and a deleted branch are found, the
    last two only with the anchor."""
    import uuid

    import psycopg
    from sqlalchemy.engine import make_url
    from test_journal_contract import _plain

    from engine.heist.session import record_heist
    from engine.policies.registry import make_policy

    url = make_url(pg_url)
    name = "vf_" + uuid.uuid4().hex[:12]
    admin = _plain(url.set(database="postgres"))
    with psycopg.connect(admin, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')  # type: ignore[arg-type]
    target = url.set(database=name).render_as_string(hide_password=False)
    dsn = _plain(make_url(target))
    try:
        with Journal(target) as j:
            j.write_version = 3  # texts in `texts`, as v3 stored them (v4: test_journal_refs)
            run = record_heist(j, make_policy({"name": "sim"}), seed=7, rounds=2).run_id
            child = j.fork(run, 20)
            j.append(child, [ev.Intervention(step=5, op="resample", at=5), *step_events(5)], 20)
            anchor = make_anchor(j, KEY, "t")
            assert verify_journal(j, anchor=anchor).ok
        with psycopg.connect(dsn, autocommit=True) as c:
            for t in ("events", "runs", "texts", "kinds"):
                c.execute(f"ALTER TABLE {t} DISABLE TRIGGER USER")  # type: ignore[arg-type]
            (h,) = c.execute("SELECT hash FROM texts ORDER BY hash LIMIT 1").fetchone()  # type: ignore[misc]
            c.execute("UPDATE texts SET body = body || 'x'::bytea WHERE hash = %s", (h,))
            c.execute(f"DELETE FROM events WHERE run_key = {KEY_OF_PG}", (child,))
            c.execute("DELETE FROM runs WHERE run_id = %s", (child,))
            rows = c.execute(
                "SELECT seq, kind, version, hash FROM events"
                f" WHERE run_key = {KEY_OF_PG} AND seq >= 30 ORDER BY seq",
                (run,),
            ).fetchall()
            prev = hash_text(
                c.execute(
                    f"SELECT hash FROM events WHERE run_key = {KEY_OF_PG} AND seq = 29", (run,)
                ).fetchone()[0]  # type: ignore[index]
            )
            forged = ev.encode(ev.ChatMessage(step=6, agent="planner", text="forged"))
            for seq, kind, version, _h in rows:
                with Journal(target, readonly=True) as j:
                    body = forged if seq == 30 else next(j.read(run, seq, seq + 1)).payload
                k = "chat_message" if seq == 30 else KIND_NAMES[kind]
                prev = chain_hash(prev, seq, k, version, body)
                c.execute(
                    "UPDATE events SET payload = %s, kind = %s, hash = %s"
                    f" WHERE run_key = {KEY_OF_PG} AND seq = %s",
                    (body, KIND_CODES[k], hash_cell(prev), run, seq),
                )
        with Journal(target, readonly=True) as j:
            plain = verify_journal(j)
            anchored = verify_journal(j, anchor=anchor)
        codes = {p.code for p in plain.problems}
        assert {"trigger", "text"} <= codes and "deleted" not in codes
        got = {(p.run_id, p.code) for p in anchored.problems}
        assert (child, "deleted") in got and (run, "rechained") in got
    finally:
        with psycopg.connect(admin, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')  # type: ignore[arg-type]
