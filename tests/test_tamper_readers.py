"""An attacker's pass over a recorded heist: edits that `car verify` used to call OK while the
readers saw something else, and edits that made a reader end in a traceback instead of one
`error:` line. Each test makes the edit on a real journal file (the triggers dropped and made
again, as a careful attacker would) and runs `car` as a user does."""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
import zlib
from pathlib import Path

import pytest
from journal_helpers import KEY_OF, car

from engine import packing
from engine.anchor import make_anchor
from engine.journal import Journal
from engine.state import FOLD_VERSION, State, encode_state

KEY = b"k" * 32


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, list[str]]:
    """A two-round heist (its crew's system prompts in `texts`) and two branches of it."""
    path = tmp_path_factory.mktemp("tamper") / "j.db"
    res = car(path, "heist", "--seed", "7", "--rounds", "2")
    assert res.returncode == 0, res.stderr
    with Journal(path, readonly=True) as j:
        (run,) = [r.run_id for r in j.runs()]
    res = car(path, "fork", run, "--at", "2", "--do", "resample", "-n", "2", "--seed", "1")
    assert res.returncode == 0, res.stderr
    branches = re.findall(r"\b[0-9a-f]{12}\b", res.stdout.splitlines()[-1])
    assert len(branches) == 2, res.stdout
    db = sqlite3.connect(path)
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    return path, run, branches


@pytest.fixture
def journal(template: tuple[Path, str, list[str]], tmp_path: Path) -> tuple[Path, str, list[str]]:
    path, run, branches = template
    shutil.copy(path, tmp_path / "j.db")
    return tmp_path / "j.db", run, branches


class Attacker:
    """A plain sqlite3 client that drops the append-only triggers, edits, and makes the
    triggers again as they were (so that verify's trigger check says nothing)."""

    def __init__(self, path: Path) -> None:
        self.db = sqlite3.connect(path, isolation_level=None)
        self.triggers = self.db.execute(
            "SELECT name, sql FROM sqlite_master WHERE type = 'trigger'"
        ).fetchall()
        for name, _sql in self.triggers:
            self.db.execute(f"DROP TRIGGER {name}")

    def __enter__(self) -> sqlite3.Connection:
        return self.db

    def __exit__(self, *exc: object) -> None:
        for _name, sql in self.triggers:
            self.db.execute(sql)
        self.db.close()


def verify(path: Path, *args: str) -> tuple[int, dict[str, object], str]:
    res = car(path, "verify", "--json", *args)
    assert "Traceback" not in res.stderr, res.stderr
    return res.returncode, json.loads(res.stdout), res.stderr


def problems(report: dict[str, object]) -> list[tuple[object, object, object, str]]:
    found = report["problems"]
    assert isinstance(found, list)
    return [(p["run_id"], p["seq"], p["code"], p["problem"]) for p in found]


def one_error_line(res: object) -> str:
    """The reader failed with exactly one `error:` line naming the tampering, no traceback."""
    assert hasattr(res, "stderr") and hasattr(res, "returncode")
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "see `car verify`" in lines[0], lines[0]
    return lines[0]


# ---------------------------------------------------------------- verify said OK


@pytest.mark.parametrize(
    "second_key",
    [
        lambda key: key.encode(),  # the same key as bytes: a different value to the primary key
        lambda key: "b2:" + key[3:].upper(),  # the same digest in capitals
        lambda key: "b2: " + key[3:],  # bytes.fromhex() skips the space
    ],
    ids=["as bytes", "in capitals", "with a space"],
)
def test_a_text_forged_behind_a_second_key_is_found(
    journal: tuple[Path, str, list[str]], second_key: object
) -> None:
    """A system prompt in `texts` rewritten, its original bytes kept under a second spelling
    of its key, which readers never look up: readers resolve the forgery, so verify must not
    take the second row's bytes for the text (it used to, and said OK)."""
    path, run, _branches = journal
    assert callable(second_key)
    with Attacker(path) as db:
        key, body = db.execute(
            "SELECT hash, body FROM texts ORDER BY rowid LIMIT 1 OFFSET 1"
        ).fetchone()
        with Journal(path, readonly=True) as j:
            plain = j._text(bytes.fromhex(key[3:]))
        forged = b"You are the mole. " + plain
        db.execute(
            "UPDATE texts SET body = ? WHERE hash = ?", (packing.pack_text(forged, None), key)
        )
        db.execute("INSERT INTO texts (hash, body) VALUES (?, ?)", (second_key(key), body))
    with Journal(path, readonly=True) as j:
        assert any(b"You are the mole. " in s.payload for s in j.read(run))  # what readers see
    code, report, _err = verify(path)
    assert code == 1
    found = problems(report)
    assert any(c == "text" and "readers never read it" in p for _r, _s, c, p in found), found
    assert any(c == "text" and key in p and "altered" in p for _r, _s, c, p in found), found
    assert any(r == run and c == "hash" for r, _s, c, _p in found), found


def test_a_second_texts_row_under_the_same_key_is_found(
    journal: tuple[Path, str, list[str]],
) -> None:
    """A texts table made again without its primary key, a second row under a text's key:
    readers see one of them; verify says there are two."""
    path, _run, _branches = journal
    with Attacker(path) as db:
        db.execute("CREATE TABLE t2 (hash VARCHAR(80) NOT NULL, body BLOB NOT NULL)")
        db.execute("INSERT INTO t2 SELECT hash, body FROM texts")
        db.execute("INSERT INTO t2 SELECT hash, body FROM texts ORDER BY rowid LIMIT 1")
        db.execute("DROP TABLE texts")
        db.execute("ALTER TABLE t2 RENAME TO texts")
    code, report, _err = verify(path)
    assert code == 1
    assert any("a second texts row under b2:" in p for *_x, p in problems(report))


@pytest.mark.parametrize(
    "column", ["run_id", "parent_run_id", "root_run_id", "scenario", "created_at", "label"]
)
def test_a_runs_cell_stored_as_bytes_is_a_finding(
    journal: tuple[Path, str, list[str]], column: str
) -> None:
    """A runs cell retyped to bytes that are valid UTF-8: every reader refuses the run (or,
    for its run_id, no longer finds it), so verify must not say OK (it read the cell's bytes
    as text and did)."""
    path, _run, branches = journal
    with Attacker(path) as db:
        db.execute(
            f"UPDATE runs SET {column} = CAST({column} AS BLOB) WHERE run_id = ?", (branches[0],)
        )
    code, report, _err = verify(path)
    assert code == 1
    assert (branches[0], None, "type", f"run row's {column} is a blob, not text") in problems(
        report
    )
    res = car(path, "show", branches[0])
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr


def test_a_second_runs_row_under_the_same_run_id_is_found(
    journal: tuple[Path, str, list[str]],
) -> None:
    """A branch's row kept under its id as bytes (verify read that one) while a text row of the
    same id — the one readers find — names another fork point."""
    path, run, branches = journal
    with Attacker(path) as db:
        row = db.execute("SELECT * FROM runs WHERE run_id = ?", (branches[0],)).fetchone()
        db.execute("UPDATE runs SET run_id = CAST(run_id AS BLOB) WHERE run_id = ?", (branches[0],))
        db.execute(
            "INSERT INTO runs (run_id, parent_run_id, fork_seq, root_run_id, scenario,"
            " created_at, label) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (branches[0], run, 1, run, *row[5:]),
        )
    code, report, _err = verify(path)
    assert code == 1
    found = problems(report)
    assert (
        branches[0],
        None,
        "run_row",
        "a second runs row with this run id: readers see only one of them",
    ) in found, found


@pytest.mark.parametrize(
    "rewrite",
    [
        lambda sql: (
            sql.replace(" BEGIN ", " WHEN 0 BEGIN ", 1)
            if " WHEN " not in sql
            else sql.replace(" WHEN ", " WHEN 0 AND ", 1)
        ),
        lambda sql: re.sub(r"RAISE\(ABORT, '[^']*'\)", "RAISE(IGNORE)", sql),
        lambda sql: re.sub(r" ON (\w+) ", " ON leases ", sql, count=1),
    ],
    ids=["a WHEN that never holds", "IGNORE for ABORT", "on another table"],
)
def test_an_append_only_trigger_made_to_refuse_nothing_is_found(
    journal: tuple[Path, str, list[str]], rewrite: object
) -> None:
    """Every trigger dropped and made again under its own name so that it refuses nothing:
    the database no longer refuses rewrites, so verify must say so (it checked names only)."""
    path, _run, _branches = journal
    assert callable(rewrite)
    db = sqlite3.connect(path, isolation_level=None)
    for name, sql in db.execute(
        "SELECT name, sql FROM sqlite_master WHERE type = 'trigger'"
    ).fetchall():
        db.execute(f"DROP TRIGGER {name}")
        db.execute(rewrite(sql))
    db.close()
    code, report, _err = verify(path)
    assert code == 1
    altered = [p for *_x, c, p in problems(report) if c == "trigger"]
    assert len(altered) == 15, altered  # every trigger of revision 0007
    assert all("was altered: it no longer refuses what it should" in p for p in altered), altered


def test_a_trigger_added_to_a_history_table_is_found(journal: tuple[Path, str, list[str]]) -> None:
    """A trigger that silently drops what the engine appends is not the journal's."""
    path, _run, _branches = journal
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("CREATE TRIGGER quiet BEFORE INSERT ON events BEGIN SELECT RAISE(IGNORE); END")
    db.close()
    code, report, _err = verify(path)
    assert code == 1
    assert problems(report) == [
        (None, None, "trigger", "trigger 'quiet' on history table 'events' is not the journal's")
    ]


def test_the_intact_journal_still_verifies(journal: tuple[Path, str, list[str]]) -> None:
    """None of the checks above is a finding on the journal as recorded."""
    path, _run, _branches = journal
    code, report, err = verify(path)
    assert code == 0 and report["ok"], (report, err)


# ------------------------------------------------------------------- readers crashed


@pytest.mark.parametrize("cell", ["'x'", "6.5", "-1", "4294967296"])
def test_a_version_cell_that_is_no_version_is_one_error_line(
    journal: tuple[Path, str, list[str]], cell: str
) -> None:
    """`car state` ended in a traceback (int() of the cell) for a version cell retyped by hand;
    every reader now names the cell in one line, and verify reports it."""
    path, run, _branches = journal
    with Attacker(path) as db:
        db.execute(
            f"UPDATE events SET version = {cell} WHERE run_key = {KEY_OF} AND seq = 3", (run,)
        )
    for args in (("state", run, "--at", "2"), ("show", run), ("export", run)):
        line = one_error_line(car(path, *args))
        assert "version cell of event" in line or "does not unpack" in line, line
    code, _report, _err = verify(path)
    assert code == 1


@pytest.mark.parametrize(
    "state",
    [
        b"garbage",
        zlib.compress(b"\x93\x01\x02"),
        encode_state(State(seq=3)),
    ],
    ids=["not zlib", "not a state", "the state of another seq"],
)
def test_a_snapshot_that_does_not_decode_to_its_seq_is_one_error_line(
    journal: tuple[Path, str, list[str]], state: bytes
) -> None:
    """A snapshot row forged under a run: `car state` ended in a traceback (zlib, msgspec) or
    folded on from the wrong seq; it is one error line, and verify reports the snapshot."""
    path, run, _branches = journal
    with Attacker(path) as db:
        db.execute(
            "INSERT INTO snapshots (run_id, seq, fold_version, state) VALUES (?, 10, ?, ?)",
            (run, FOLD_VERSION, state),
        )
    line = one_error_line(car(path, "state", run, "--at", "5"))
    assert "snapshot at seq 10" in line, line
    code, report, _err = verify(path)
    assert code == 1
    assert any(r == run and s == 10 and c == "snapshot" for r, s, c, _p in problems(report))


# --------------------------------------------------------------------------- anchor


def test_a_rewritten_branch_is_located_in_its_own_slice(
    journal: tuple[Path, str, list[str]],
) -> None:
    """Two sibling branches (same parent, same fork point) swap their events: each chain is
    whole, so only the anchor sees it, and it says the rewrite starts at the branch's fork
    point, not at seq 0 (the parent's, which nobody touched)."""
    path, _run, branches = journal
    with Journal(path, readonly=True) as j:
        anchor = make_anchor(j, KEY, "2026-12-01T00:00:00")
        fork = j.run(branches[0]).fork_seq
    (path.parent / "a.json").write_text(json.dumps(anchor))
    (path.parent / "key").write_bytes(KEY)
    with Attacker(path) as db:
        a, b = (
            db.execute("SELECT run_key FROM runs WHERE run_id = ?", (r,)).fetchone()[0]
            for r in branches
        )
        db.execute("UPDATE runs SET run_key = -1 WHERE run_key = ?", (a,))
        db.execute("UPDATE runs SET run_key = ? WHERE run_key = ?", (a, b))
        db.execute("UPDATE runs SET run_key = ? WHERE run_key = -1", (b,))
    code, report, _err = verify(path)
    assert code == 0  # documented: the chain does not cover the run id
    code, report, _err = verify(
        path, "--anchor", str(path.parent / "a.json"), "--key-file", str(path.parent / "key")
    )
    assert code == 1
    rewrites = [(r, s) for r, s, c, _p in problems(report) if c in ("rechained", "truncated")]
    assert rewrites and all(s is not None and s >= fork for _r, s in rewrites), rewrites
