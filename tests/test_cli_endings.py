"""How a command ends when its output's reader goes away, and what `runs` and `show` say of
a run's ending."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine.heist.session import record_heist
from engine.heist.sim import SimPolicy
from engine.journal import Journal

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "args",
    [
        ["show", "{run}"],  # rich
        ["show", "{run}", "--json"],  # JSON through the CLI framework's echo
        ["runs"],
        ["export", "{run}"],
        ["state", "{run}", "--at", "3"],
        ["diff", "{run}", "{run}"],
    ],
)
def test_a_reader_that_went_away_ends_every_command_alike(args: list[str], tmp_path: Path) -> None:
    """Output into a pipe whose reader has gone (`car show RUN | head`): one exit status for
    every command and output path, 141 as a process ended by SIGPIPE gets, and not a word
    (they were 1 from rich or the CLI framework, 120 from a failed final flush)."""
    journal = tmp_path / "j.db"
    with Journal(journal) as j:
        run = record_heist(j, SimPolicy(), seed=7, rounds=1).run_id
    read, write = os.pipe()
    os.close(read)
    try:
        res = subprocess.run(
            [sys.executable, "-m", "cli", "--journal", str(journal),
             *(a.format(run=run) for a in args)],
            stdout=write, stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=120,
        )  # fmt: skip
    finally:
        os.close(write)
    assert res.returncode == 141, res.stderr
    assert res.stderr == ""


def test_a_heist_whose_reader_went_away_is_closed_as_stopped(tmp_path: Path) -> None:
    """`car heist | head` with the reader gone before the first line: the run is closed
    `stopped` in the journal at once (not left recording, not played on unseen) and the
    command exits 141."""
    journal = tmp_path / "j.db"
    read, write = os.pipe()
    os.close(read)
    try:
        res = subprocess.run(
            [sys.executable, "-m", "cli", "--journal", str(journal), "heist", "--seed", "7"],
            stdout=write, stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=120,
        )  # fmt: skip
    finally:
        os.close(write)
    assert res.returncode == 141, res.stderr
    with Journal(journal) as j:
        (run,) = j.runs()
        assert j.status(run.run_id) == "stopped"
        assert j.verify().ok


def test_runs_and_show_agree_on_the_outcome_of_every_ending(tmp_path: Path) -> None:
    """`car runs --json` and `car show --json` give the same outcome: the plan's for a run
    that completed, null for one that stopped without one (`runs` gave `{}`)."""
    journal = tmp_path / "j.db"
    with Journal(journal) as j:
        done = record_heist(j, SimPolicy(), seed=7, rounds=1).run_id
    read, write = os.pipe()
    os.close(read)
    try:  # a heist whose reader went away is closed stopped
        subprocess.run(
            [sys.executable, "-m", "cli", "--journal", str(journal), "heist", "--seed", "8"],
            stdout=write, stderr=subprocess.PIPE, cwd=ROOT, timeout=120,
        )  # fmt: skip
    finally:
        os.close(write)

    def car(*args: str) -> Any:
        res = subprocess.run(
            [sys.executable, "-m", "cli", "--journal", str(journal), *args, "--json"],
            capture_output=True, text=True, cwd=ROOT, timeout=120,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout)

    listed = {r["run_id"]: r for r in car("runs")}
    assert len(listed) == 2
    for run_id, row in listed.items():
        shown = car("show", run_id)
        assert row["outcome"] == shown["outcome"], row["status"]
        if run_id == done:
            assert row["status"] == "completed" and "bad" in row["outcome"]
        else:
            assert row["status"] == "stopped" and row["outcome"] is None


def test_the_listing_gives_each_endings_outcome(tmp_path: Path) -> None:
    """The listing `car runs` and `car show` print, read in this process: a completed run's
    outcome even when empty, none for a run that stopped or failed without one, and the one a
    run that stopped or failed with one (a recorded program's exit status) ended with."""
    from engine import events as ev
    from engine.projections import list_runs

    endings = {
        "completed, an outcome": ("completed", {"bad": True}),
        "completed, none": ("completed", {}),
        "stopped, none": ("stopped", {}),
        "failed, none": ("failed", {}),
        "failed, an exit status": ("failed", {"exit_code": 3}),
        "stopped, an exit status": ("stopped", {"exit_code": -15}),
    }
    with Journal(tmp_path / "j.db") as j:
        for label, (status, outcome) in endings.items():
            run = j.create_run("test", label=label)
            j.append(run, [ev.RunEnded(status=status, outcome=outcome)], 0)
        open_run = j.create_run("test", label="recording")
        j.append(open_run, [ev.ChatMessage(step=0, agent="a", text="hi")], 0)
        rows, unreadable = list_runs(j, include_branches=False, limit=10)
    assert not unreadable
    got = {r["label"]: (r["status"], r["outcome"]) for r in rows}
    assert got == {
        "completed, an outcome": ("completed", {"bad": True}),
        "completed, none": ("completed", {}),
        "stopped, none": ("stopped", None),
        "failed, none": ("failed", None),
        "failed, an exit status": ("failed", {"exit_code": 3}),
        "stopped, an exit status": ("stopped", {"exit_code": -15}),
        "recording": ("recording", None),
    }
