"""Opening a journal: creation is atomic and safe against concurrent first opens; read-only
commands never write to a file that is not already a journal; old journals stay readable."""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgspec
import pytest

from engine.errors import JournalError, NotAJournal
from engine.journal import HEAD_REVISION, KNOWN_REVISIONS, Journal
from engine.state import state_at

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _car(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli", *args], capture_output=True, text=True, cwd=ROOT, timeout=120
    )


def test_static_revisions_match_alembic() -> None:
    """The revision list the fast open relies on is exactly Alembic's history, head last."""
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    cfg = Config()
    cfg.set_main_option("script_location", str(ROOT / "migrations"))
    script = ScriptDirectory.from_config(cfg)
    history = [r.revision for r in reversed(list(script.walk_revisions()))]
    assert tuple(history) == KNOWN_REVISIONS
    assert script.get_current_head() == HEAD_REVISION


OPENER = textwrap.dedent(
    """
    import sys, time
    from engine.journal import Journal
    from engine import events as ev
    t = float(sys.argv[2])
    while time.time() < t:
        pass
    with Journal(sys.argv[1]) as j:
        run = j.create_run("race")
        j.append(run, [ev.ChatMessage(agent="a", text="hi")])
        print(j.revision)
    """
)


def test_concurrent_first_opens(tmp_path: Path) -> None:
    """Four processes opening one new journal at the same instant all succeed, on one schema."""
    path = tmp_path / "new" / "j.db"
    start = time.time() + 1.5
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", OPENER, str(path), str(start)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    results = [p.communicate(timeout=60) for p in procs]
    for p, (out, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err
        assert out.strip() == HEAD_REVISION
    with Journal(path, readonly=True) as j:
        assert len(j.runs()) == 4 and j.verify().ok
    assert [p.name for p in path.parent.iterdir() if "creating" in p.name] == []


CREATOR = textwrap.dedent(
    """
    import sys
    from engine.journal import Journal
    Journal(sys.argv[1]).close()
    print("done", flush=True)
    """
)


@pytest.mark.parametrize("delay", [0.25, 0.35, 0.45, 0.55, 0.65, 0.8])
def test_kill_during_creation_leaves_nothing_half_made(tmp_path: Path, delay: float) -> None:
    """SIGKILL at some moment of a first open: the journal path holds either nothing or a
    complete journal, and the next open works."""
    path = tmp_path / "j.db"
    proc = subprocess.Popen(
        [sys.executable, "-c", CREATOR, str(path)], cwd=ROOT, stdout=subprocess.DEVNULL
    )
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    if path.exists():
        with Journal(path, readonly=True) as j:
            assert j.revision == HEAD_REVISION
    with Journal(path) as j:
        assert j.revision == HEAD_REVISION and j.runs() == []


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _other_app_db(path: Path, *, empty: bool) -> None:
    db = sqlite3.connect(path)
    if empty:
        db.execute("PRAGMA user_version = 7")  # a valid, table-less database file
    else:
        db.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT)")
        db.execute("INSERT INTO notes (body) VALUES ('keep me')")
    db.commit()
    db.close()


@pytest.mark.parametrize("kind", ["zero-length", "empty-sqlite", "other-app"])
@pytest.mark.parametrize(
    "command", [("runs",), ("verify",), ("show", "x"), ("state", "x", "-k", "0")]
)
def test_read_only_commands_leave_non_journals_alone(
    tmp_path: Path, kind: str, command: tuple[str, ...]
) -> None:
    """A read-only command on a file that is not a journal fails with one line and leaves the
    file byte for byte as it was: no schema written, no switch to WAL, no sidecar files."""
    path = tmp_path / "x.db"
    if kind == "zero-length":
        path.touch()
    else:
        _other_app_db(path, empty=kind == "empty-sqlite")
    before = _digest(path)
    res = _car("--journal", str(path), *command)
    assert res.returncode == 1
    assert res.stderr.startswith("error: ") and res.stderr.count("\n") == 1, res.stderr
    assert "not a journal" in res.stderr or "empty" in res.stderr
    assert _digest(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.db"]


def test_write_open_refuses_another_apps_database(tmp_path: Path) -> None:
    """Even a writing open refuses a database with other tables, before changing anything."""
    path = tmp_path / "x.db"
    _other_app_db(path, empty=False)
    before = _digest(path)
    with pytest.raises(NotAJournal, match="notes"):
        Journal(path)
    assert _digest(path) == before
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "delete"


def test_read_only_missing_journal(tmp_path: Path) -> None:
    """A read-only open of a missing path creates nothing and says so."""
    with pytest.raises(JournalError, match="no journal at"):
        Journal(tmp_path / "none.db", readonly=True)
    assert list(tmp_path.iterdir()) == []


def test_read_only_refuses_writes(tmp_path: Path) -> None:
    """A journal opened read-only refuses appends with a clear error, and stores no snapshot."""
    Journal(tmp_path / "j.db").close()
    with (
        Journal(tmp_path / "j.db", readonly=True) as j,
        pytest.raises(JournalError, match="read-only"),
    ):
        j.create_run("x")


# ------------------------------------------------------------ the v2 fixture


@pytest.fixture
def v2(tmp_path: Path) -> Path:
    dst = tmp_path / "journal_v2.db"
    shutil.copy(FIXTURES / "journal_v2.db", dst)
    return dst


RUNS = {"2cee56fa4461": [3, 6], "f127b61ac668": [5]}


@pytest.mark.parametrize("readonly", [True, False], ids=["read-only", "upgraded"])
def test_v2_journal_reads_verifies_and_folds(v2: Path, readonly: bool) -> None:
    """A journal written by the schema-v2 engine (revision 0001) verifies, and folds to exactly
    the states that engine computed — read as it is, and after the upgrade to the head."""
    expected_verify = json.loads((FIXTURES / "journal_v2.verify.json").read_text())
    with Journal(v2, readonly=readonly) as j:
        assert j.revision == ("0001_journal_tables" if readonly else HEAD_REVISION)
        report = j.verify()
        assert report.ok, report.problems
        # read as it is, its rows could still be REPLACEd: said, with the way out
        assert report.notes == (
            []
            if not readonly
            else [
                "journal at schema revision 0001: REPLACE is not refused; open it for writing"
                " once (`car db upgrade`) to add the triggers that refuse it"
            ]
        )
        assert report.runs_checked == expected_verify["runs_checked"]
        assert report.events_checked == expected_verify["events_checked"]
        for run, ks in RUNS.items():
            assert j.status(run) == "completed"
            for k in ks:
                want = (FIXTURES / f"journal_v2.fold_{run[:4]}_at{k}.json").read_bytes()
                got = msgspec.json.format(msgspec.json.encode(state_at(j, run, k, snapshots=False)))
                assert got == want, (run, k)


def test_v2_journal_cli_state(v2: Path) -> None:
    """`car state --reveal --json` on the old journal prints what the old engine printed."""
    res = _car("--journal", str(v2), "state", "2cee", "--at", "3", "--json", "--reveal")
    assert res.returncode == 0, res.stderr
    want = json.loads((FIXTURES / "journal_v2.state_2cee_at3.json").read_text())
    got = json.loads(res.stdout)
    assert (got["seq"], got["acting_agent"], got["transcript"]) == (
        want["seq"],
        want["acting_agent"],
        want["transcript"],
    )


def test_a_postgresql_server_that_refuses_the_connection_is_one_line(tmp_path: Path) -> None:
    """A PostgreSQL journal URL where nothing listens: `car runs` exits 1 with one `error:`
    line naming the journal (password hidden), never the driver's traceback."""
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens on it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"postgresql+psycopg://car:hunter2@127.0.0.1:{port}/car"
    res = _car("--journal", url, "runs")
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot open journal"), res.stderr
    assert "hunter2" not in res.stderr and "Traceback" not in res.stderr
