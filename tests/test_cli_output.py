"""The command line's output as a user and a pipe read it: help once and plain, whole lines in a
pipe, a bounded branch tree, contradictory flags refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.heist.session import record_heist
from engine.heist.sim import SimPolicy
from engine.interventions import fork_many, parse_intervention
from engine.journal import Journal

ROOT = Path(__file__).resolve().parent.parent


def car(journal: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`car --journal J ARGS` with stdout a pipe and no COLUMNS hint (rich would assume 80)."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    return subprocess.run(
        [sys.executable, "-m", "cli", "--journal", str(journal), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )


@pytest.fixture(scope="module")
def journal_with_branches(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    path = tmp_path_factory.mktemp("cli-output") / "j.db"
    with Journal(path) as j:
        run = record_heist(j, SimPolicy(), seed=7, rounds=2).run_id
        report = fork_many(j, run, parse_intervention("resample", 3, None), 5, seed=2)
        first = next(b.run_id for b in report.branches if b.run_id)
        fork_many(j, first, parse_intervention("resample", 6, None), 3, seed=3)
    return path, run


@pytest.mark.parametrize("args", [(), ("db",)])
def test_bare_group_prints_its_help_once(tmp_path: Path, args: tuple[str, ...]) -> None:
    """`car` and `car db` without a command print their usage once and exit 0."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["CAR_JOURNAL"] = str(tmp_path / "j.db")
    r = subprocess.run(
        [sys.executable, "-m", "cli", *args], capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert r.returncode == 0, r.stderr
    assert (r.stdout + r.stderr).count("Usage:") == 1


def test_help_shows_flags_without_a_bool_metavar(tmp_path: Path) -> None:
    """Flags are listed as flags (`--json`), not as options taking a value (`--json <bool>`)."""
    r = car(tmp_path / "j.db", "runs", "--help")
    assert r.returncode == 0
    assert "--json" in r.stdout
    assert "<bool>" not in r.stdout


def test_piped_transcript_keeps_whole_lines(journal_with_branches: tuple[Path, str]) -> None:
    """A pipe gets each transcript line whole: nothing is hard-wrapped at 80 columns."""
    path, run = journal_with_branches
    r = car(path, "show", run)
    assert r.returncode == 0, r.stderr
    step_lines = [ln for ln in r.stdout.splitlines() if ln.startswith("[")]
    assert any(len(ln) > 100 for ln in step_lines), "fixture has no long message"
    # every message line starts with its step marker: a wrapped line would start with text
    body = [ln for ln in r.stdout.splitlines() if ln and not ln.startswith(("[", " ", "run "))]
    assert all(ln.startswith(("policy=", "outcome", "---", "└", "├", "│", run)) for ln in body)


def test_show_bounds_the_branch_tree(journal_with_branches: tuple[Path, str]) -> None:
    """`car show --limit 2 --depth 1` prints two branches and says how many more there are."""
    path, run = journal_with_branches
    full = car(path, "show", run)
    small = car(path, "show", run, "--limit", "2", "--depth", "1")
    assert full.returncode == 0 and small.returncode == 0
    assert full.stdout.count("@step") == 5 + 3
    assert small.stdout.count("@step") == 2
    assert "3 more branches" in small.stdout
    none = car(path, "show", run, "--depth", "0")
    assert "@step" not in none.stdout


def test_mole_and_no_mole_together_is_a_usage_error(tmp_path: Path) -> None:
    """`--mole X --no-mole` is refused with one line and exit 2, not silently dropped."""
    r = car(tmp_path / "j.db", "heist", "--mole", "intel", "--no-mole", "--rounds", "1")
    assert r.returncode == 2
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1
    assert "Traceback" not in r.stderr
