"""Writer leases: a run whose process was killed is recognisable as abandoned, `car runs`
says so, `car runs --close-stale` closes it by appending, and it can then be forked and accused.
Also: an event that would not read back is refused before it reaches the journal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_journal_contract import record, started

from engine import events as ev
from engine.errors import JournalError
from engine.journal import LEASE_TTL, Journal
from engine.runtime.recorder import Recorder
from engine.state import State

ROOT = Path(__file__).resolve().parent.parent


def _car(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli", *args], capture_output=True, text=True, cwd=ROOT, timeout=300
    )


# The engine's own heist recorder with the embedded policy, slowed to 40 ms a step (as an LLM
# would be) so that the kill lands mid-run of a heist short enough to fork to its end.
SLOW_HEIST = """
import sys, time
from engine.heist.session import record_heist
from engine.journal import Journal
from engine.policies.registry import make_policy
with Journal(sys.argv[1]) as j:
    record_heist(j, make_policy({"name": "sim"}), seed=5, rounds=12,
                 on_step=lambda *a: time.sleep(0.04))
"""


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A journal holding a heist whose recording process was SIGKILLed mid-run."""
    jp = tmp_path_factory.mktemp("killed") / "j.db"
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_HEIST, str(jp)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    run = ""
    while time.monotonic() < deadline:
        time.sleep(0.3)
        if jp.exists():
            with Journal(jp, readonly=True) as j:
                runs = j.runs()
                if runs and j.steps(runs[0].run_id) > 20:
                    run = runs[0].run_id
                    assert j.status(run) == "recording"  # alive: not abandoned
                    break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert run, "the heist recorded nothing within a minute"
    return jp, run


def test_killed_writer_is_abandoned(killed: tuple[Path, str]) -> None:
    """After SIGKILL the run's status is `abandoned`, and `car runs` shows it with a hint."""
    jp, run = killed
    with Journal(jp, readonly=True) as j:
        assert j.status(run) == "abandoned"
        lease = j.lease(run)
        assert lease is not None and lease.host and lease.pid > 0
    res = _car("--journal", str(jp), "runs")
    assert res.returncode == 0 and "abandoned" in res.stdout and "--close-stale" in res.stdout
    rows = json.loads(_car("--journal", str(jp), "runs", "--json").stdout)
    assert [r["status"] for r in rows] == ["abandoned"]


def test_abandoned_run_is_neither_forked_nor_accused(killed: tuple[Path, str]) -> None:
    """An abandoned run (its last step may be half-told, no verdict possible on an unfinished
    game) is refused by fork and accuse with one line naming --close-stale; nothing written."""
    jp, run = killed
    with Journal(jp, readonly=True) as j:
        runs, head = len(j.runs()), j.head(run)
    for args in (
        ("fork", run, "--at", "3", "--do", "resample", "-n", "1"),
        ("accuse", run, "intel"),
    ):
        res = _car("--journal", str(jp), *args)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 1 and len(lines) == 1, res.stderr
        assert "abandoned" in lines[0] and "car runs --close-stale" in lines[0]
    with Journal(jp, readonly=True) as j:
        assert (len(j.runs()), j.head(run), j.status(run)) == (runs, head, "abandoned")


def test_close_stale_then_fork_and_accuse(killed: tuple[Path, str], tmp_path: Path) -> None:
    """`car runs --close-stale` appends Control(stop) + RunEnded(stopped, "abandoned: writer
    ... gone"), chained like any event; the run is then stopped (without an outcome, as
    `car fork` says), forkable and accusable."""
    src, run = killed
    jp = tmp_path / "j.db"
    import shutil

    for suffix in ("", "-wal", "-shm"):  # the killed writer left its last steps in the WAL
        if Path(f"{src}{suffix}").exists():
            shutil.copy(f"{src}{suffix}", f"{jp}{suffix}")
    with Journal(jp, readonly=True) as j:
        head = j.head(run)
        steps = j.steps(run)
    res = _car("--journal", str(jp), "runs", "--close-stale", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert [c["run_id"] for c in out["closed"]] == [run]
    assert out["runs"][0]["status"] == "stopped"
    with Journal(jp) as j:
        last = [s.event for s in j.read(run, head)]
        assert j.head(run) == head + 2 and j.steps(run) == steps
        assert isinstance(last[0], ev.Control) and last[0].action == "stop"
        assert isinstance(last[1], ev.RunEnded) and last[1].status == "stopped"
        assert last[1].error is not None and last[1].error.startswith("abandoned: writer pid")
        assert j.lease(run) is None and j.verify().ok
    again = _car("--journal", str(jp), "runs", "--close-stale")
    assert again.returncode == 0 and "no abandoned runs" in again.stdout
    fork = _car("--journal", str(jp), "fork", run, "--at", "10", "--do", "resample", "-n", "1")
    assert fork.returncode == 0, fork.stderr
    # a stopped run has no outcome, which the report says (not "ok", as it did)
    assert f"on run {run} (factual outcome: none)" in fork.stdout
    accuse = _car("--journal", str(jp), "accuse", run, "planner", "--json")
    assert accuse.returncode == 0, accuse.stderr


def test_live_writer_is_not_abandoned(tmp_path: Path) -> None:
    """A run this (live) process writes stays `recording`; its RunEnded releases the lease."""
    with Journal(tmp_path / "j.db") as j:
        run = record(j, 2)
        assert j.status(run) == "recording" and j.lease(run) is not None
        j.append(run, [ev.RunEnded(status="completed")])
        assert j.status(run) == "completed" and j.lease(run) is None


def test_other_host_goes_by_heartbeat(tmp_path: Path) -> None:
    """Seen from another host (a shared PostgreSQL journal), a writer is gone only when its
    heartbeat is older than LEASE_TTL. The other host is simulated by editing the lease's host:
    a second machine cannot be had here."""
    now = [1000.0]
    with Journal(tmp_path / "j.db", wall=lambda: now[0]) as j:
        run = record(j, 1)
        import sqlite3

        db = sqlite3.connect(tmp_path / "j.db", isolation_level=None)
        db.execute("UPDATE leases SET host = 'elsewhere', pid = 1")
        db.close()
        now[0] += LEASE_TTL - 1
        assert j.status(run) == "recording"
        now[0] += 2
        assert j.status(run) == "abandoned"


def test_recorder_takes_over_the_lease(tmp_path: Path) -> None:
    """A recorder holds the lease for its run from the moment it is made."""
    with Journal(tmp_path / "j.db") as j:
        run = j.create_run("test")
        import sqlite3

        db = sqlite3.connect(tmp_path / "j.db", isolation_level=None)
        db.execute("UPDATE leases SET pid = 999999999")  # a creator that died
        db.close()
        assert j.status(run) == "abandoned"
        Recorder(j, run, State(), 0)
        assert j.status(run) == "recording"


# ----------------------------------------------------- events that do not read back


POISON = [
    ("fingerprint is a number", {"system_fingerprint": 12345}, "system_fingerprint"),
    ("fingerprint is an object", {"system_fingerprint": {"a": 1}}, "system_fingerprint"),
    ("tokens a float", {"prompt_tokens": 1e30}, "prompt_tokens"),
    ("tokens below int64", {"completion_tokens": -(2**70)}, "int"),
    ("tokens above uint64", {"prompt_tokens": 2**65}, "int"),
    ("response not text", {"response": b"\xff"}, "response"),
]


def _llm_call(**fields: object) -> ev.LlmCall:
    base: dict[str, object] = {
        "step": 0,
        "agent": "a",
        "request": [{"role": "user", "content": "go"}],
        "seed": 1,
        "model": "m",
        "response": "ok",
        "finish_reason": "stop",
    }
    return ev.LlmCall(**{**base, **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize(("name", "fields", "match"), POISON, ids=[p[0] for p in POISON])
def test_poisoned_event_refused(
    tmp_path: Path, name: str, fields: dict[str, object], match: str
) -> None:
    """An event whose bytes would not decode is refused with a JournalError naming the
    problem; nothing is written, and the journal stays readable and verified."""
    with Journal(tmp_path / "j.db") as j:
        run = j.create_run("test")
        head = j.append(run, [started()], 0)
        with pytest.raises(JournalError, match="refusing to journal a llm_call event") as info:
            j.append(run, [_llm_call(**fields)], head)
        assert match in str(info.value) or match in str(info.value.__cause__), name
        assert j.head(run) == head and j.verify().ok
        assert [s.kind for s in j.read(run)] == ["run_started"]


def test_poisoned_step_does_not_drop_the_pending_group(tmp_path: Path) -> None:
    """With group commit, a bad step fails alone: the good steps pending before it are kept."""
    with Journal(tmp_path / "j.db") as j:
        run = j.create_run("test")
        rec = Recorder(j, run, State(), 0, group_ms=60_000.0)
        rec.append([started()])
        rec.append([_llm_call(step=0), ev.ChatMessage(step=0, agent="a", text="fine")])
        with pytest.raises(JournalError):
            rec.append([_llm_call(step=1, prompt_tokens=-(2**70))])
        rec.flush()
        assert [s.kind for s in j.read(run)] == ["run_started", "llm_call", "chat_message"]
        assert j.verify().ok
