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
from engine.verify import VerifyReport, _Checker, verify_journal

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


def v3_copy(tmp_path: Path) -> Path:
    """A copy of the schema v3 fixture (texts by reference, the text-keyed layout)."""
    path = tmp_path / "v3.db"
    shutil.copy(FIXTURES / "journal_v3.db", path)
    return path


def edit_first_text(path: Path, sql: str, *args: object) -> str:
    """Run `sql` on the journal's first text (its key the last argument); that key."""
    db = raw(path)
    (key,) = db.execute("SELECT hash FROM texts ORDER BY hash LIMIT 1").fetchone()
    db.execute(sql, (*args, key))
    db.close()
    return str(key)


def test_a_v3_payload_that_does_not_parse_is_undecodable(tmp_path: Path) -> None:
    """A schema v3 row (texts by reference, the text-keyed layout) whose bytes are no
    msgpack: that row is undecodable, with the parser's reason, and nothing else breaks."""
    path = v3_copy(tmp_path)
    db = raw(path)
    (run,) = db.execute("SELECT run_id FROM events WHERE seq = 1 LIMIT 1").fetchone()
    db.execute("UPDATE events SET payload = ? WHERE run_id = ? AND seq = 1", (b"\xc1", run))
    db.close()
    report = check(path)
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


def test_a_damaged_page_that_only_the_file_check_sees_is_a_finding_a_line(
    journal: tuple[Path, str, str],
) -> None:
    """The free-page count in the file's header made wrong: no event, run or text check
    reads it, SQLite's quick_check does; each line of its report is one finding, without its
    banner."""
    path, _run, _child = journal
    data = bytearray(path.read_bytes())
    count = int.from_bytes(data[36:40], "big")
    data[36:40] = (count + 2).to_bytes(4, "big")
    path.write_bytes(bytes(data))
    report = check(path)
    ((run_id, seq, code, problem),) = [
        (p.run_id, p.seq, p.code, p.problem) for p in report.problems
    ]
    assert (run_id, seq, code) == (None, None, "damaged")
    assert problem.startswith("database file damaged: ") and "freelist" in problem
    assert "\n" not in problem and "***" not in problem


def test_a_kinds_code_that_is_not_an_integer_is_named(journal: tuple[Path, str, str]) -> None:
    """`kinds` re-created without its INTEGER key holds a code in text: a finding about the
    table, naming the row."""
    path, run, child = journal
    db = raw(path)
    rows = db.execute("SELECT code, name FROM kinds").fetchall()
    db.execute("DROP TABLE kinds")
    db.execute("CREATE TABLE kinds (code, name)")
    db.executemany("INSERT INTO kinds VALUES (?, ?)", rows)
    db.execute("INSERT INTO kinds VALUES ('x', 'forged')")
    db.close()
    got = found(check(path), {"R": run, "C": child})
    assert got == {
        (None, None, "kinds", "kinds row 'forged' has a code 'x' that is not an integer")
    }


def test_a_hash_cell_of_the_wrong_length_is_named_by_its_bytes(
    journal: tuple[Path, str, str],
) -> None:
    path, run, child = journal
    edit(
        path,
        f"UPDATE events SET hash = ? WHERE run_key = {KEY_OF} AND seq = 10",
        (b"\x01" * 31, run),
    )
    got = found(check(path), {"R": run, "C": child})
    assert ("R", 10, "type", "hash cell is 31 bytes, not a 32-byte digest") in got


def test_verify_reads_what_its_resolver_has_forgotten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a journal of more than 20,000 events the resolver's caches are cleared while it
    reads: a reference then loads its row again, as stored. Forgetting everything at every
    event, a heist and a branch of it (their requests and strings refer to earlier rows, of
    the run and of the parent) still verify clean, and an edited row is still found."""
    from engine.heist.session import record_heist
    from engine.heist.sim import SimPolicy
    from engine.interventions import DoResample, parent_info, run_branch

    path = tmp_path / "j.db"
    with Journal(path) as j:
        run = record_heist(j, SimPolicy(), seed=7, rounds=2).run_id
        child = run_branch(j, parent_info(j, run), DoResample(k=5), 3).run_id
        j.checkpoint()
    remembered = check(path)
    loads: list[tuple[str, int]] = []
    load_row = _Checker.load_row

    def forget(self: ev.Resolver) -> None:
        self.inline.clear()
        self.requests.clear()

    def counted(self: _Checker, rid: str, seq: int) -> tuple[int, bytes]:
        loads.append((rid, seq))
        return load_row(self, rid, seq)

    monkeypatch.setattr(ev.Resolver, "clear_if_large", forget)
    monkeypatch.setattr(_Checker, "load_row", counted)
    forgetting = check(path)
    assert forgetting.ok, forgetting.problems
    assert forgetting.events_checked == remembered.events_checked > 80
    assert {r for r, _s in loads} == {run, child}, "rows of both runs were loaded again"
    db = raw(path)
    forge(db, run, 40, msgspec.msgpack.encode({"kind": "no_such_kind", "step": 13}))
    db.close()
    got = found(check(path), {"R": run, "C": child})
    assert ("R", 40, "hash", "hash mismatch: event altered or reordered") in got


def test_a_v3_text_that_is_no_longer_utf8_is_named_at_each_event_using_it(
    tmp_path: Path,
) -> None:
    """The schema v3 fixture with one of its texts overwritten by bytes that decode to no
    text: the text is altered, and each event using it says so and does not resolve."""
    path = v3_copy(tmp_path)
    key = edit_first_text(path, "UPDATE texts SET body = ? WHERE hash = ?", b"\xff\xfe\xfd")
    got = found(check(path), {})
    assert (None, None, "text", f"text {key} altered: its bytes no longer hash to it") in got
    users = {(r, s) for r, s, c, _p in got if c == "undecodable"}
    assert users, got
    for r, s in users:
        assert (r, s, "text", f"uses altered text {key}") in got
        (why,) = [p for rr, ss, c, p in got if (rr, ss, c) == (r, s, "undecodable")]
        assert why.startswith("stored payload does not resolve: 'utf-8' codec can't decode")


def test_a_deleted_text_is_named_at_the_event_that_uses_it(tmp_path: Path) -> None:
    """A system prompt's text row deleted from a recorded heist: the event that refers to it
    says which text is missing."""
    from engine.heist.session import record_heist
    from engine.heist.sim import SimPolicy

    path = tmp_path / "j.db"
    with Journal(path) as j:
        run = record_heist(j, SimPolicy(), seed=7, rounds=1).run_id
        j.checkpoint()
    key = edit_first_text(path, "DELETE FROM texts WHERE hash = ?")
    got = found(check(path), {"R": run})
    assert got, "a missing text is a finding"
    for r, _seq, code, problem in got:
        assert (r, code) == ("R", "undecodable")
        assert problem == f"stored payload does not resolve: it uses text {key}, which is missing"


def _small_journal(path: Path, steps: int = 30) -> str:
    with Journal(path) as j:
        run = record(j, steps)
        j.checkpoint()
    return run


@pytest.mark.parametrize(
    ("cell", "words"),
    [
        ("'six'", "'six' is not an integer"),
        ("-1", "-1 is out of range"),
        ("4294967296", "4294967296 is out of range"),
    ],
    ids=["text", "negative", "past 32 bits"],
)
def test_a_version_cell_that_is_no_version_is_named_and_the_run_read_on(
    tmp_path: Path, cell: str, words: str
) -> None:
    """The chain packs an event's version in 32 bits: a cell outside them (or not a number)
    is one finding, and the rest of the run is still checked (it once ended the run's check
    with "cannot check run ...: argument out of range")."""
    path = tmp_path / "j.db"
    run = _small_journal(path)
    last = packing.BLOCK - 1  # the last row of its block: no row is packed against it
    # its hash made wrong too: the next event chains on it and is not blamed for it
    edit(
        path,
        f"UPDATE events SET version = {cell}, hash = randomblob(32)"
        f" WHERE run_key = {KEY_OF} AND seq = {last}",
        (run,),
    )
    report = check(path)
    assert found(report, {"R": run}) == {("R", last, "type", f"version cell {words}")}
    with Journal(path, readonly=True) as j:
        assert report.events_checked == j.head(run) > last + 1


def test_a_deleted_parent_row_is_said_once_and_its_events_are_orphans(
    journal: tuple[Path, str, str],
) -> None:
    path, run, child = journal
    db = raw(path)
    db.execute("PRAGMA foreign_keys = OFF")
    (key,) = db.execute("SELECT run_key FROM runs WHERE run_id = ?", (run,)).fetchone()
    (count,) = db.execute("SELECT count(*) FROM events WHERE run_key = ?", (key,)).fetchone()
    db.execute("DELETE FROM runs WHERE run_id = ?", (run,))
    db.close()
    got = found(check(path), {"C": child})
    assert got == {
        ("C", None, "missing_parent", f"parent run {run!r} has no row (deleted?)"),
        ("C", 20, "hash", "hash mismatch: event altered or reordered"),
        (
            None,
            0,
            "orphan",
            f"{count} events of run_key {key!r}, which names no run (deleted run or forged events)",
        ),
    }


def test_edited_runs_and_texts_rows_are_named(tmp_path: Path) -> None:
    """A fork point in text, a root naming another root, a texts row whose key is no digest."""
    path = tmp_path / "j.db"
    with Journal(path) as j:
        a, b = record(j, 5), record(j, 5)
        child = j.fork(a, 3)
        j.append(child, [ev.RunEnded(status="completed")])
        j.checkpoint()
    db = raw(path)
    db.execute("INSERT INTO texts VALUES ('nope', x'00')")
    db.execute("UPDATE runs SET fork_seq = 'abc' WHERE run_id = ?", (child,))
    db.execute("UPDATE runs SET root_run_id = ? WHERE run_id = ?", (b, a))
    db.close()
    got = found(check(path), {"A": a, "B": b, "C": child})
    assert {
        ("C", None, "type", "run row's fork_seq is a text, not an integer"),
        ("A", None, "run_row", "a root run that names another root"),
        ("C", None, "run_row", "root run differs from its parent's"),
        (None, None, "text", "texts row with a malformed key 'nope'"),
    } <= got


def test_every_snapshot_is_checked_and_one_that_does_not_decode_is_named(
    tmp_path: Path,
) -> None:
    """Two snapshots (512 and 1024) are both checked, past a row of another fold version
    (which every reader ignores); a snapshot that is no state says why."""
    from engine.state import FOLD_VERSION, build_snapshots

    path = tmp_path / "j.db"
    with Journal(path) as j:
        run = record(j, 400)
        build_snapshots(j, run)
        j.checkpoint()
    clean = check(path)
    assert clean.ok and clean.snapshots_checked == 2
    db = raw(path)
    db.execute("INSERT INTO snapshots VALUES (?, 256, ?, x'00')", (run, FOLD_VERSION + 1))
    db.execute("UPDATE snapshots SET state = x'0001' WHERE seq = 1024")
    db.close()
    report = check(path)
    assert report.snapshots_checked == 2
    ((r, seq, code, why),) = found(report, {"R": run})
    assert (r, seq, code) == ("R", 1024, "snapshot")
    assert why.startswith("snapshot does not decode: ")


def test_a_dropped_snapshots_table_is_one_finding(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    run = _small_journal(path)
    edit(path, "DROP TABLE snapshots", ())
    assert found(check(path), {"R": run}) == {
        (None, None, "schema", "table 'snapshots' is missing (renamed or dropped)")
    }


def test_a_deleted_and_an_unknown_kind_are_named(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    run = _small_journal(path, 5)
    db = raw(path)
    (name,) = db.execute("SELECT name FROM kinds WHERE code = 1").fetchone()
    db.execute("DELETE FROM kinds WHERE code = 1")
    db.execute("INSERT INTO kinds VALUES (99, 'mystery')")
    db.close()
    assert found(check(path), {"R": run}) == {
        (None, None, "kinds", f"kinds lacks code 1 ({name!r})"),
        (None, None, "kinds", "kinds holds code 99 ('mystery'), unknown here"),
    }


def test_a_deleted_v3_text_is_named_at_the_event_that_uses_it(tmp_path: Path) -> None:
    path = v3_copy(tmp_path)
    key = edit_first_text(path, "DELETE FROM texts WHERE hash = ?")
    got = {(seq, code, problem) for _r, seq, code, problem in found(check(path), {})}
    assert got and all(s is not None for s, _c, _p in got)
    assert {(c, p) for _s, c, p in got} == {("text", f"uses text {key}, which is missing")}


def test_an_anchor_that_cannot_be_read_is_one_finding(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    _small_journal(path, 5)
    report = check(path, anchor={})
    assert [(p.run_id, p.seq, p.code, p.problem) for p in report.problems] == [
        (None, None, "unreadable", "cannot check the anchor: 'runs'")
    ]


def test_findings_come_run_by_run_in_the_order_of_the_run_ids(tmp_path: Path) -> None:
    """Roots are checked in the order of their ids (and each before its branches): the same
    journal gives the same report, whatever order its rows were written in."""
    path = tmp_path / "j.db"
    with Journal(path) as j:
        runs = [record(j, 3) for _ in range(4)]
        j.checkpoint()
    for run in runs:
        edit(path, f"UPDATE events SET step = 7 WHERE run_key = {KEY_OF} AND seq = 2", (run,))
    order = [p.run_id for p in check(path).problems if p.code != "trigger"]
    assert order == sorted(runs) and len(order) == 4


def test_snapshots_are_checked_past_those_of_runs_not_asked_for(tmp_path: Path) -> None:
    """`car verify B`: run A's snapshot rows, stored first, are passed over, B's both checked
    and B's forged one found."""
    from engine.state import build_snapshots

    path = tmp_path / "j.db"
    with Journal(path) as j:
        a, b = record(j, 400), record(j, 400)
        build_snapshots(j, a)
        build_snapshots(j, b)
        j.checkpoint()
    edit(path, "UPDATE snapshots SET state = x'0001' WHERE run_id = ? AND seq = 1024", (b,))
    with Journal(path, readonly=True) as j:
        report = verify_journal(j, run_id=b)
    assert report.snapshots_checked == 2
    assert [(p.run_id, p.seq, p.code) for p in report.problems if p.code != "trigger"] == [
        (b, 1024, "snapshot")
    ]


def test_a_snapshot_of_a_run_that_has_no_row_is_named(journal: tuple[Path, str, str]) -> None:
    path, run, child = journal
    edit(path, "INSERT INTO snapshots VALUES ('ghost', 512, 1, x'00')", ())
    got = found(check(path), {"R": run, "C": child})
    assert got == {("ghost", 512, "snapshot", "snapshot of a run that has no row")}


def test_events_of_a_deleted_run_in_the_text_keyed_layout_are_orphans(tmp_path: Path) -> None:
    """The schema v3 fixture's root row deleted: its events are named orphans, from their
    first seq, and each branch says its parent has no row."""
    path = v3_copy(tmp_path)
    db = raw(path)
    (root,) = db.execute("SELECT run_id FROM runs WHERE parent_run_id IS NULL").fetchone()
    (count,) = db.execute("SELECT count(*) FROM events WHERE run_id = ?", (root,)).fetchone()
    branches = [
        r for (r,) in db.execute("SELECT run_id FROM runs WHERE parent_run_id = ?", (root,))
    ]
    db.execute("PRAGMA foreign_keys = OFF")
    db.execute("DELETE FROM runs WHERE run_id = ?", (root,))
    db.close()
    got = {(p.run_id, p.seq, p.code, p.problem) for p in check(path).problems}
    why = f"{count} events whose run has no row (deleted run or forged events)"
    assert (root, 0, "orphan", why) in got
    for b in branches:
        assert (b, None, "missing_parent", f"parent run {root!r} has no row (deleted?)") in got


def test_a_branch_forked_below_its_parents_fork_point_verifies(tmp_path: Path) -> None:
    """C forks A at 20, G forks C at 10: G's history before 10 is A's, and G chains on A's
    event 9."""
    path = tmp_path / "j.db"
    with Journal(path) as j:
        a = record(j, 30)
        c = j.fork(a, 20)
        j.append(c, [ev.RunEnded(status="completed")])
        g = j.fork(c, 10)
        j.append(g, [ev.RunEnded(status="completed")])
        j.checkpoint()
    report = check(path)
    assert report.ok, report.problems
    assert report.runs_checked == 3


def test_a_snapshot_past_a_row_of_the_first_schema_folds_it_as_written(tmp_path: Path) -> None:
    """A run with one event written by schema version 1 (a failed tool result whose `text`
    later became `error`) just before its snapshot at 512, in the context the snapshot holds:
    the check folds each event by its own version, as the snapshot was built, and finds
    nothing."""
    from test_journal_contract import started, step_events

    from engine.journal import KIND_CODES, SPAN, chain_hash, hash_cell
    from engine.state import SNAPSHOT_EVERY, build_snapshots

    path = tmp_path / "j.db"
    with Journal(path) as j:
        run = j.create_run("test")
        key = j.run_key(run)
        head = j.append(run, [started()], 0)
        k = 0
        while head < SNAPSHOT_EVERY - 1:
            k += 1
            head = j.append(run, step_events(k)[: SNAPSHOT_EVERY - 1 - head], head)
        prev = j.hash_at(run, head - 1)
    old = msgspec.msgpack.encode(
        {
            "kind": "tool_result",
            "step": k + 1,
            "agent": "a",
            "tool": "file_reader",
            "param": "../x",
            "ok": False,
            "text": "path leaves the folder",
        }
    )
    edit(
        path,
        "INSERT INTO events (id, run_key, seq, step, kind, version, payload, hash)"
        " VALUES (?, ?, ?, ?, ?, 1, ?, ?)",
        (
            key * SPAN + head,
            key,
            head,
            k + 1,
            KIND_CODES["tool_result"],
            old,
            hash_cell(chain_hash(prev, head, "tool_result", 1, old)),
        ),
    )
    with Journal(path) as j:
        head += 1
        for step in range(k + 2, k + 12):
            head = j.append(run, step_events(step), head)
        build_snapshots(j, run)
        j.checkpoint()
    report = check(path)
    assert report.snapshots_checked == 1
    assert found(report, {"R": run}) == set()
