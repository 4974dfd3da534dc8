"""`car state` at the edges of a run: one past its last step is the run's final state."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def car(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli", *args], capture_output=True, text=True, cwd=ROOT
    )


def test_state_one_past_the_last_step_is_the_ended_run(tmp_path: Path) -> None:
    """--at STEPS (one past the last step) folds the whole run: an ended run says how it
    ended and names no next agent, in the public view, with --reveal, and as text; the step
    before it is still the run as it was then (recording, with the agent about to act)."""
    j = str(tmp_path / "j.db")
    res = car("--journal", j, "heist", "--seed", "3", "--rounds", "1", "--json")
    assert res.returncode == 0, res.stderr
    run = json.loads(res.stdout)["run_id"]
    steps = 6
    for extra in ([], ["--reveal"]):
        end = json.loads(
            car("--journal", j, "state", run, "--at", str(steps), *extra, "--json").stdout
        )
        assert end["status"] == "completed" and end["acting_agent"] is None
        last = json.loads(
            car("--journal", j, "state", run, "--at", str(steps - 1), *extra, "--json").stdout
        )
        assert last["status"] == "recording" and last["acting_agent"] is not None
        text = car("--journal", j, "state", run, "--at", str(steps), *extra)
        assert text.returncode == 0, text.stderr
        first = text.stdout.splitlines()[0]
        assert "no next agent, status completed" in first and "recording" not in first
    past = car("--journal", j, "state", run, "--at", str(steps + 1))
    assert past.returncode != 0 and "out of range" in past.stderr
