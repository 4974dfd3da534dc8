"""What `car verify` says of each edit, exactly: the run, the seq, the code and the words of
every finding (tests/test_journal_verify.py checks that each edit is found at its place; these
pin the whole finding, so that a reader, a script reading `--json` and the locating of the
next event can rely on it)."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import msgspec
import pytest
from test_journal_contract import record
from test_journal_verify import KEY_OF, build_template, check, forge, raw

from engine import events as ev
from engine import packing
from engine.journal import Journal
from engine.verify import VerifyReport, verify_journal

Finding = tuple[str | None, int | None, str, str]


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """A 30-step run (91 events, two blocks) and a branch of it at seq 20."""
    path = tmp_path_factory.mktemp("findings") / "j.db"
    with Journal(path) as j:
        run = record(j, 30)
        child = j.fork(run, 20)
        j.append(child, [ev.RunEnded(status="completed")])
        j.checkpoint()
    return path, run, child


@pytest.fixture
def journal(template: tuple[Path, str, str], tmp_path: Path) -> tuple[Path, str, str]:
    path, run, child = template
    shutil.copy(path, tmp_path / "j.db")
    return tmp_path / "j.db", run, child


def found(report: VerifyReport, names: dict[str, str]) -> set[Finding]:
    """(R/C or run, seq, code, problem) of every finding but the dropped triggers."""
    by_id = {v: k for k, v in names.items()}
    return {
        (by_id.get(p.run_id or "", p.run_id), p.seq, p.code, p.problem)
        for p in report.problems
        if p.code != "trigger"
    }


def edit(path: Path, sql: str, args: tuple[object, ...]) -> None:
    db = raw(path)
    db.execute(sql, args)
    db.close()


def test_a_row_that_does_not_unpack_is_named_and_the_next_is_read_on(
    journal: tuple[Path, str, str],
) -> None:
    """Packed bytes that do not inflate: that row is `undecodable` with the reason, the rest
    of its block is blamed on it (`packed`), nothing is reported missing after it, and the
    branch that forks past it says its fork point cannot be read."""
    path, run, child = journal
    edit(
        path,
        f"UPDATE events SET payload = ? WHERE run_key = {KEY_OF} AND seq = 10",
        (packing.PACKED + b"\xff" * 20, run),
    )
    got = found(check(path), {"R": run, "C": child})
    (first,) = [f for f in got if f[1] == 10]
    assert first[:3] == ("R", 10, "undecodable")
    assert first[3].startswith("stored payload does not unpack: packed bytes do not inflate (")
    fork = ("C", 19, "fork_point", "fork point missing from the parent")
    assert fork in got
    rest = got - {first, fork}
    assert rest, "the rows packed against it are blamed on it"
    assert {(r, c, p) for r, _s, c, p in rest} == {
        ("R", "packed", "packed against event 10 of its block, which is altered, missing or"
         " unreadable")
    }  # fmt: skip
    assert all(11 <= s < packing.BLOCK for _r, s, _c, _p in rest)  # type: ignore[operator]


def test_a_payload_that_does_not_resolve_is_undecodable(
    journal: tuple[Path, str, str],
) -> None:
    """A stored payload that is neither a map nor positional (the block packed again around
    it, as a careful attacker would): that one finding, no hash finding, the run read on."""
    path, run, child = journal
    db = raw(path)
    forge(db, run, 10, b"\x01")
    db.close()
    assert found(check(path), {"R": run, "C": child}) == {
        ("R", 10, "undecodable",
         "stored payload does not resolve: a stored event is neither a map nor positional"),
    }  # fmt: skip


def test_a_payload_of_no_event_is_undecodable_after_its_hash(
    journal: tuple[Path, str, str],
) -> None:
    """A map that resolves but names no event kind: its hash does not match, and it does not
    decode (the decoder's first line said)."""
    path, run, child = journal
    db = raw(path)
    forge(db, run, 10, msgspec.msgpack.encode({"kind": "no_such_kind", "step": 3}))
    db.close()
    got = found(check(path), {"R": run, "C": child})
    assert ("R", 10, "hash", "hash mismatch: event altered or reordered") in got
    (bad,) = [f for f in got if f[2] != "hash"]
    assert bad[:3] == ("R", 10, "undecodable")
    assert bad[3].startswith("undecodable payload: Invalid value 'no_such_kind'")


@pytest.mark.parametrize(
    ("sql", "expected"),
    [
        (
            "UPDATE runs SET fork_seq = 5 WHERE run_id = :run",
            {("R", None, "run_row", "a root run with a fork point")},
        ),
        (
            "UPDATE runs SET root_run_id = 'zz' WHERE run_id = :child",
            {("C", None, "run_row", "root run differs from its parent's")},
        ),
        (
            "UPDATE runs SET parent_run_id = :child, fork_seq = 3 WHERE run_id = :run",
            {
                ("R", None, "run_row", "run is not reachable from a root (parent cycle)"),
                ("C", None, "run_row", "run is not reachable from a root (parent cycle)"),
            },
        ),
    ],
    ids=["root with a fork point", "root differs from the parent's", "parent cycle"],
)
def test_run_row_edits_are_findings_about_the_run(
    journal: tuple[Path, str, str], sql: str, expected: set[Finding]
) -> None:
    path, run, child = journal
    db = raw(path)
    db.execute(sql, {"run": run, "child": child})
    db.close()
    got = found(check(path), {"R": run, "C": child})
    assert expected <= got, got


def test_a_deleted_fork_point_is_named_at_its_seq(journal: tuple[Path, str, str]) -> None:
    """The parent's event the branch chains on, deleted: the branch says so at that seq."""
    path, run, child = journal
    edit(path, f"DELETE FROM events WHERE run_key = {KEY_OF} AND seq = 19", (run,))
    got = found(check(path), {"R": run, "C": child})
    assert ("C", 19, "fork_point", "fork point missing from the parent") in got


def test_a_dropped_trigger_says_what_it_no_longer_refuses(
    journal: tuple[Path, str, str],
) -> None:
    path, _run, _child = journal
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("DROP TRIGGER events_no_update")
    db.close()
    report = check(path)
    assert [(p.run_id, p.seq, p.problem) for p in report.problems if p.code == "trigger"] == [
        (
            None,
            None,
            "append-only trigger 'events_no_update' is missing: the database no longer"
            " refuses rewrites",
        )
    ]


def test_report_as_json_names_every_field(journal: tuple[Path, str, str]) -> None:
    path, _run, _child = journal
    d = check(path).to_dict()
    assert list(d) == [
        "ok",
        "runs_checked",
        "events_checked",
        "snapshots_checked",
        "anchored_runs",
        "problems",
        "notes",
    ]
    assert d["ok"] is True and d["anchored_runs"] == 0 and d["runs_checked"] == 2


FIXTURES = Path(__file__).resolve().parent / "fixtures"


def test_a_v3_payload_that_does_not_parse_is_undecodable(tmp_path: Path) -> None:
    """A schema v3 row (texts by reference, the text-keyed layout) whose bytes are no
    msgpack: that row is undecodable, with the parser's reason, and nothing else breaks."""
    path = tmp_path / "v3.db"
    shutil.copy(FIXTURES / "journal_v3.db", path)
    db = raw(path)
    (run,) = db.execute("SELECT run_id FROM events WHERE seq = 1 LIMIT 1").fetchone()
    db.execute("UPDATE events SET payload = ? WHERE run_id = ? AND seq = 1", (b"\xc1", run))
    db.close()
    with Journal(path, readonly=True) as j:
        report = verify_journal(j)
    got = found(report, {"R": run})
    (bad,) = got
    assert bad[:3] == ("R", 1, "undecodable")
    assert bad[3].startswith("stored payload does not parse: ")


@pytest.fixture(scope="module")
def snapshotted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """test_journal_verify's journal: a 200-step run with its snapshot at 512, and a branch
    at seq 100 that goes on with a step of its own (its strings refer to the parent's)."""
    path = tmp_path_factory.mktemp("snapshotted") / "j.db"
    return (path, *build_template(path))


def test_a_snapshot_stored_as_text_is_named(
    snapshotted: tuple[Path, str, str], tmp_path: Path
) -> None:
    path = tmp_path / "j.db"
    shutil.copy(snapshotted[0], path)
    run, child = snapshotted[1], snapshotted[2]
    edit(path, "UPDATE snapshots SET state = CAST(state AS TEXT)", ())
    got = found(check(path), {"R": run, "C": child})
    assert ("R", 512, "snapshot", "snapshot stored as text, not as bytes") in got


def test_a_branch_verified_alone_reads_what_it_refers_to_in_its_parent(
    snapshotted: tuple[Path, str, str], tmp_path: Path
) -> None:
    """`car verify BRANCH` checks the branch and its ancestors (it chains on its parent's
    row at the fork point): intact, it is clean."""
    path = tmp_path / "j.db"
    shutil.copy(snapshotted[0], path)
    child = snapshotted[2]
    with Journal(path, readonly=True) as j:
        alone = verify_journal(j, run_id=child)
        events = j.events(child)
    assert alone.ok, alone.problems
    assert alone.events_checked > 0
    assert len(events) > 100
