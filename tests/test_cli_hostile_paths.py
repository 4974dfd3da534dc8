"""What a careless or hostile user's journal paths, URLs and altered journals got: a traceback,
a hang, or a new journal built on another database's leftovers. Each now gets one `error:`
line and a non-zero exit, and loses nothing. Real processes and real SQLite files."""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
from pathlib import Path

import pytest
from journal_helpers import car

from engine.heist.session import record_heist
from engine.heist.sim import SimPolicy
from engine.interventions import DoResample, fork_many
from engine.journal import Journal


def one_error_line(proc: subprocess.CompletedProcess[str], code: int = 1) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert proc.stderr.startswith("error: "), proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr


@pytest.fixture()
def heist(tmp_path: Path) -> tuple[Path, str]:
    path = tmp_path / "j.db"
    with Journal(path) as j:
        run = record_heist(j, SimPolicy(), seed=3, rounds=1).run_id
        fork_many(j, run, DoResample(2), 1)
    return path, run


def test_a_log_left_beside_a_missing_journal_is_not_read_into_a_new_one(
    heist: tuple[Path, str], tmp_path: Path
) -> None:
    """A journal deleted while its write-ahead log stayed (or a log copied alone): the next
    `car heist` at that name built a new journal on top of it - SQLite replays a log whose
    name matches - reported success, and `car verify` then found damaged pages. Now it refuses
    in one line naming the log, and creates nothing."""
    path, _ = heist
    with Journal(path) as j:  # a log with pages in it: a writer that is still open
        keep = sqlite3.connect(path)
        keep.execute("PRAGMA wal_autocheckpoint=0")
        j.create_run("more")
        target = tmp_path / "new.db"
        shutil.copyfile(f"{path}-wal", f"{target}-wal")
        keep.close()
    err = one_error_line(car(target, "heist", "-q", "--rounds", "1"))
    assert "write-ahead log" in err and f"{target}-wal" in err
    assert not target.exists() and Path(f"{target}-wal").exists()


def test_a_parent_cycle_is_one_line_not_a_hang(heist: tuple[Path, str]) -> None:
    """A run made its own parent by hand (triggers dropped): `car show` and the other readers
    walked the parent chain forever, memory growing; `car runs --all` left the run out
    silently. Now the readers fail in one line naming the cycle, and the listing says which
    run it left out."""
    path, run = heist
    db = sqlite3.connect(path)
    db.execute("DROP TRIGGER runs_no_update")
    db.execute("UPDATE runs SET parent_run_id = run_id, fork_seq = 3 WHERE run_id = ?", (run,))
    db.commit()
    db.close()
    for args in (["show", run], ["state", run, "--at", "2"], ["export", run]):
        err = one_error_line(car(path, *args, timeout=60))
        assert "parent cycle" in err and run in err
    listed = car(path, "runs", "--all", "--json", timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert run in listed.stderr and "not listed" in listed.stderr
    assert run not in {r["run_id"] for r in json.loads(listed.stdout)}


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["heist", "-q", "--policy", "openai", "--base-url", "http://[::1"], 2),
        (["detect", "RUN", "--method", "llm", "--base-url", "http://[::1"], 1),
        (["record", "--base-url", "http://[::1", "--", "true"], 1),
        (["export", "RUN", "--otlp-endpoint", "http://[::1"], 1),
    ],
    ids=["heist", "detect-llm", "record", "export-otlp"],
)
def test_a_url_with_a_bracket_left_open_is_one_line(
    heist: tuple[Path, str], args: list[str], code: int
) -> None:
    """`http://[::1` (a bracket left open) raised ValueError deep in the URL parser: a
    traceback from every command that takes a server URL."""
    path, run = heist
    err = car(path, *[run if a == "RUN" else a for a in args])
    line = one_error_line(err, code)
    assert "http://[::1" in line and "IPv6" in line


def test_journal_paths_that_cannot_be_made_are_one_line(tmp_path: Path) -> None:
    """A journal under a regular file, a name longer than the file system takes, a device:
    tracebacks (FileExistsError, OSError) or advice to remove a device node. Now one line, and
    nothing made."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    err = one_error_line(car(blocker / "j.db", "heist", "-q", "--rounds", "1"))
    assert "cannot create a journal" in err
    long = tmp_path / ("a" * 300 + ".db")
    err = one_error_line(car(long, "heist", "-q", "--rounds", "1"))
    assert "File name too long" in err
    err = one_error_line(car(Path("/dev/null"), "runs"))
    assert "not a regular file" in err and "remove" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_a_run_id_longer_than_any_is_unknown_in_a_short_line(heist: tuple[Path, str]) -> None:
    """100,000 characters as a run id: the prefix lookup failed with SQLite's "LIKE or GLOB
    pattern too complex", blamed on the journal. Now it is an unknown run id, the id clipped."""
    path, _ = heist
    err = one_error_line(car(path, "show", "a" * 100_000))
    assert "unknown run id" in err and len(err) < 200


def test_a_schema_revision_this_engine_does_not_know_is_not_called_newer(
    heist: tuple[Path, str],
) -> None:
    """An `alembic_version` holding a revision no engine wrote was reported as "newer than this
    engine knows": it says it is unknown, and both ways it can come about."""
    path, _ = heist
    db = sqlite3.connect(path)
    db.execute("UPDATE alembic_version SET version_num = '0006_old'")
    db.commit()
    db.close()
    err = one_error_line(car(path, "runs"))
    assert "'0006_old'" in err and "does not know" in err and "altered" in err


def test_an_output_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    """stdout on a full disk (`> /dev/full`): a traceback from every command, and a heist
    closed as failed with "internal error: OSError". Now one line, exit 1, and the heist stays
    completed (its output is written after its run is closed). A closed stderr (`2>&-`) made
    a command that succeeded exit 1."""
    import sys

    from journal_helpers import ROOT

    path = tmp_path / "j.db"

    def run(*args: str, **streams: object) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "cli", "--journal", str(path), *args],
            cwd=ROOT, text=True, timeout=120, **streams,  # type: ignore[call-overload]
        )  # fmt: skip

    with open("/dev/full", "w") as full:
        p = run("heist", "-q", "--rounds", "1", stdout=full, stderr=subprocess.PIPE)
        assert (
            p.returncode == 1
            and p.stderr == "error: cannot write output: No space left on device\n"
        )
        for args in (["runs"], ["runs", "--json"], ["verify"], ["--version"]):
            p = run(*args, stdout=full, stderr=subprocess.PIPE)
            assert p.returncode == 1, (args, p.stderr)
            assert p.stderr == "error: cannot write output: No space left on device\n", args
    with Journal(path) as j:
        (info,) = j.runs()
        assert j.status(info.run_id) == "completed"
    p = run("runs", stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True)
    assert p.returncode == 0
    closed = subprocess.run(
        f"{sys.executable} -m cli --journal {path} runs >/dev/null 2>&-",
        shell=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert closed.returncode == 0


def test_a_journal_in_a_directory_it_cannot_write_is_not_called_no_journal() -> None:
    """A journal whose directory is read-only to the user (SQLite must make its -wal and -shm
    files beside it): "is not a journal: attempt to write a readonly database". Now it says it
    cannot open it and why. Run as a user the permissions bind (root drops to nobody)."""
    import os
    import sys
    import tempfile

    from journal_helpers import ROOT

    top = Path(tempfile.mkdtemp(prefix="car-ro-", dir="/tmp"))
    try:
        top.chmod(0o755)
        d = top / "d"
        d.mkdir()
        path = d / "j.db"
        with Journal(path) as j:
            record_heist(j, SimPolicy(), seed=3, rounds=1)
            j.checkpoint()
        for extra in ("-wal", "-shm"):
            Path(f"{path}{extra}").unlink(missing_ok=True)
        path.chmod(0o666)
        d.chmod(0o555)
        as_user = (
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
            if os.geteuid() == 0
            else []
        )
        p = subprocess.run(
            [*as_user, sys.executable, "-m", "cli", "--journal", str(path), "runs"],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        )  # fmt: skip
        err = one_error_line(p)
        assert "cannot open journal" in err and "not a journal" not in err
        assert "directory writable" in err
    finally:
        for sub in (top / "d", top):
            sub.chmod(0o755)
        shutil.rmtree(top)


def test_a_run_failed_in_a_calls_step_counts_the_steps_before_it(tmp_path: Path) -> None:
    """A heist whose model server refuses its third call fails at step 2: `car show` said 2
    steps, `car runs` and the server's sessions list 3 (they counted the failed call's row).
    Every listing now says what the public view says."""
    from llm_helpers import completion, scripted_server
    from server_helpers import car_serve

    path = tmp_path / "j.db"
    calls = [0]

    def reply(_: dict[str, object]) -> tuple[int, dict[str, object]]:
        calls[0] += 1
        if calls[0] <= 2:
            return 200, completion("Checking the rota.")
        return 400, {"error": {"message": "bad request"}}

    with scripted_server(reply) as server:
        p = car(path, "heist", "--policy", "openai", "--base-url", server.url, "--model", "m",
                "--rounds", "1", "-q", "--json")  # fmt: skip
    assert p.returncode == 1 and json.loads(p.stdout)["status"] == "failed", p.stderr
    run = json.loads(p.stdout)["run_id"]
    shown = json.loads(car(path, "show", run, "--json").stdout)
    listed = json.loads(car(path, "runs", "--json").stdout)
    assert shown["steps"] == 2 and [r["steps"] for r in listed] == [2]
    with car_serve(path) as s, s.client() as c:
        (session,) = c.get("/api/sessions").json()["sessions"]
        assert session["steps"] == 2


def test_sigterm_ends_any_command_as_ctrl_c_does(tmp_path: Path) -> None:
    """SIGTERM (a supervisor, `kill PID`) in the middle of `car detect-eval`: the process died by
    the signal, with no word (the recording and forking commands already treated it as
    Ctrl-C). Now it is one `interrupted` line and exit 130, as Ctrl-C, and the journal reads."""
    import os
    import signal
    import sys
    import time

    from journal_helpers import ROOT

    path = tmp_path / "j.db"
    p = subprocess.Popen(
        [sys.executable, "-m", "cli", "--journal", str(path), "detect-eval", "--games", "500",
         "-m", "causal"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and p.poll() is None:
        if path.exists():
            with Journal(path, readonly=True) as j:
                if len(j.runs()) >= 3:
                    break
        time.sleep(0.1)
    assert p.poll() is None, p.communicate()
    os.kill(p.pid, signal.SIGTERM)
    _out, err = p.communicate(timeout=60)
    assert p.returncode == 130, (p.returncode, err)
    assert err.strip().splitlines()[-1].startswith("interrupted"), err
    assert "Traceback" not in err
    assert car(path, "verify").returncode == 0
