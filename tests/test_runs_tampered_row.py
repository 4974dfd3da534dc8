"""One runs row whose created_at cell was overwritten by hand (a number, words, bytes that are
no UTF-8) must not hide every other run: `car runs` and the server's session list leave it out
and name it (a warning line on stderr; `unreadable` in the server's JSON), while whatever
addresses that run by id still fails with the one TamperedJournal line, and `car verify` still
flags it. The journal is real, recorded by `car`, and tampered through sqlite3 with the
append-only triggers dropped around the edit, as someone with write access to the file would."""

from __future__ import annotations

import json
import shutil
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from journal_helpers import car
from server_helpers import car_serve

from engine.errors import TamperedJournal
from engine.journal import Journal

# what was written over a created_at cell (the column's TEXT affinity stores a number as its
# digits)
RETYPINGS = {
    "epoch seconds": "1700000000",
    "garbage": "'garbage'",
    "not UTF-8": "CAST(X'C328FF' AS TEXT)",
}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str], str]:
    """A journal with three one-round heists and one branch of the first: (path, the roots
    oldest first, the branch)."""
    path = tmp_path_factory.mktemp("runs") / "j.db"
    roots = []
    for seed in (1, 2, 3):
        res = car(path, "heist", "-q", "--seed", str(seed), "--rounds", "1", "--json")
        assert res.returncode == 0, res.stderr
        roots.append(json.loads(res.stdout)["run_id"])
    res = car(path, "fork", roots[0], "--at", "3", "--do", "resample", "-n", "1", "--json")
    assert res.returncode == 0, res.stderr
    with Journal(path, readonly=True) as j:
        (branch,) = [c.run_id for c in j.children(roots[0])]
    return path, roots, branch


def _tampered(recorded: tuple[Path, list[str], str], tmp_path: Path, run: str, cell: str) -> Path:
    """A copy of the journal whose run `run` has `cell` (SQL) as its created_at."""
    path = tmp_path / "j.db"
    shutil.copy(recorded[0], path)
    db = sqlite3.connect(path)
    triggers = db.execute("SELECT name, sql FROM sqlite_master WHERE type = 'trigger'").fetchall()
    for name, _ in triggers:
        db.execute(f"DROP TRIGGER {name}")
    assert db.execute(f"UPDATE runs SET created_at = {cell} WHERE run_id = ?", (run,)).rowcount == 1
    for _, create in triggers:
        db.execute(create)
    db.commit()
    db.close()
    return path


def _warning(run: str) -> str:
    return f"warning: run {run} has a tampered created_at cell and is not listed (see `car verify`)"


@pytest.mark.parametrize("retyping", sorted(RETYPINGS))
def test_runs_lists_the_other_runs_and_names_the_tampered_one(
    recorded: tuple[Path, list[str], str], tmp_path: Path, retyping: str
) -> None:
    """`car runs` (also --all, also --json) lists every other run, exit 0, with one warning
    line on stderr naming the tampered run; the JSON stays the list of runs."""
    _, roots, branch = recorded
    bad = roots[1]
    path = _tampered(recorded, tmp_path, bad, RETYPINGS[retyping])
    for args in (["runs"], ["runs", "--all"]):
        res = car(path, *args)
        assert res.returncode == 0, (args, res.stdout, res.stderr)
        assert res.stderr.strip().splitlines() == [_warning(bad)], res.stderr
        assert roots[0] in res.stdout and roots[2] in res.stdout and bad not in res.stdout
        assert (branch in res.stdout) == ("--all" in args)
    res = car(path, "runs", "--json")
    assert res.returncode == 0, res.stderr
    assert res.stderr.strip().splitlines() == [_warning(bad)]
    rows = json.loads(res.stdout)
    assert [r["run_id"] for r in rows] == [roots[0], roots[2]]
    assert rows[0]["branches"] == 1 and all(r["status"] == "completed" for r in rows)


@pytest.mark.parametrize("retyping", sorted(RETYPINGS))
def test_what_addresses_the_tampered_run_still_fails_and_verify_flags_it(
    recorded: tuple[Path, list[str], str], tmp_path: Path, retyping: str
) -> None:
    """`car show` and `car export` of the tampered run end with the one TamperedJournal line
    (exit 1), naming the run (text that is not UTF-8 fails in the driver, before the row is
    read: that line names the column and the run it finds holding it); `car verify` reports
    the run (exit 1); the other runs read as before."""
    _, roots, _branch = recorded
    bad = roots[1]
    path = _tampered(recorded, tmp_path, bad, RETYPINGS[retyping])
    for args in (["show", bad], ["export", bad, "-o", str(tmp_path / "out.json")]):
        res = car(path, *args)
        assert res.returncode == 1, (args, res.stdout, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
        assert "(see `car verify`)" in lines[0], lines
        assert bad in lines[0], lines
        if retyping == "not UTF-8":
            assert f"the created_at cell of run '{bad}'" in lines[0], lines
            assert "not UTF-8 text" in lines[0] and "where bytes belong" not in lines[0]
    res = car(path, "verify")
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"run {bad}" in res.stdout + res.stderr
    assert car(path, "show", roots[2]).returncode == 0


def test_a_tampered_branch_is_left_out_of_its_parents_listing(
    recorded: tuple[Path, list[str], str], tmp_path: Path
) -> None:
    """A branch's row tampered: `car runs` still lists every root (the branch is not counted
    among its parent's forks), `--all` lists the roots without it, and the warning names it."""
    _, roots, branch = recorded
    path = _tampered(recorded, tmp_path, branch, "42")
    for args in (["runs", "--json"], ["runs", "--all", "--json"]):
        res = car(path, *args)
        assert res.returncode == 0, (args, res.stdout, res.stderr)
        assert res.stderr.strip().splitlines() == [_warning(branch)], res.stderr
        rows = json.loads(res.stdout)
        assert [r["run_id"] for r in rows] == roots
        assert rows[0]["branches"] == 0
    res = car(path, "show", branch)
    assert res.returncode == 1 and "(see `car verify`)" in res.stderr


def test_close_stale_json_names_the_unreadable_runs(
    recorded: tuple[Path, list[str], str], tmp_path: Path
) -> None:
    """`car runs --close-stale --json` (an object) names the rows it left out in
    `unreadable`, and lists the others."""
    _, roots, _branch = recorded
    path = _tampered(recorded, tmp_path, roots[0], "'garbage'")
    res = car(path, "runs", "--close-stale", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["unreadable"] == [roots[0]] and doc["closed"] == []
    assert [r["run_id"] for r in doc["runs"]] == roots[1:]
    clean = car(recorded[0], "runs", "--close-stale", "--json")
    assert json.loads(clean.stdout)["unreadable"] == [] and clean.stderr == ""


def test_the_journal_lists_leniently_only_when_asked(
    recorded: tuple[Path, list[str], str], tmp_path: Path
) -> None:
    """`Journal.listing()` gives the runs that read and names the rest; `runs()`,
    `children()` and `run()` stay strict (what anchors and forks read)."""
    _, roots, branch = recorded
    path = _tampered(recorded, tmp_path, branch, "42")
    with Journal(path, readonly=True) as j:
        infos, unreadable = j.listing()
        assert [i.run_id for i in infos] == roots
        assert [(u.run_id, u.column) for u in unreadable] == [(branch, "created_at")]
        assert "has a created_at cell '42', not an ISO 8601 time" in unreadable[0].error
        with pytest.raises(TamperedJournal, match="created_at"):
            j.runs()
        with pytest.raises(TamperedJournal, match="created_at"):
            j.children(roots[0])
        with pytest.raises(TamperedJournal, match="created_at"):
            j.run(branch)


@pytest.fixture
def served(recorded: tuple[Path, list[str], str], tmp_path: Path) -> Iterator[tuple[str, str]]:
    """`car serve` on a copy of the journal whose second heist has a garbage created_at:
    (its URL, the tampered run)."""
    bad = recorded[1][1]
    path = _tampered(recorded, tmp_path, bad, "'garbage'")
    with car_serve(path, "--sim-step-delay", "0") as s:
        yield s.url, bad


def test_the_server_lists_the_other_sessions_and_names_the_tampered_one(
    recorded: tuple[Path, list[str], str], served: tuple[str, str]
) -> None:
    """GET /api/sessions answers 200 with every other heist and the tampered run's id in
    `unreadable`; addressing that run is still an error, as JSON."""
    import httpx

    url, bad = served
    roots = recorded[1]
    with httpx.Client(base_url=url, timeout=60) as client:
        r = client.get("/api/sessions")
        assert r.status_code == 200, r.text
        page = r.json()
        assert [s["session_id"] for s in page["sessions"]] == [roots[2], roots[0]]
        assert page["total"] == 2 and page["unreadable"] == [bad]
        assert page["sessions"][1]["branches"] == 1
        r = client.get(f"/api/sessions/{bad}")
        assert r.status_code == 500 and "car verify" in r.json()["error"], r.text
