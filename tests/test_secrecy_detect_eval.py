"""`car detect-eval --runs` is no back door to the reveal.

Scoring a game shows its mole: the confusion table has a row per true mole, the per-strategy
table a row per strategy, and top-1 says whether the suggestion was right. So a game nobody has
accused is scored only with --reveal; games that were accused, or that detect-eval itself
recorded for scoring, need nothing. The refusal reads no secret: it is the same for a game
with a mole and for one without."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from journal_helpers import car

from engine.heist.mole import Strategy
from engine.heist.session import record_heist
from engine.heist.sim import SimPolicy
from engine.journal import Journal

STRATEGIES = [s.value for s in Strategy]


@pytest.fixture()
def games(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """Four games of one seed: three moles and no mole."""
    path = tmp_path / "j.db"
    with Journal(path) as j:
        runs = {
            m: record_heist(j, SimPolicy(), seed=5, mole=m, strategy="WRONG_TOOLS").run_id
            for m in ("planner", "intel", "lookout")
        }
        runs["none"] = record_heist(j, SimPolicy(), seed=5, no_mole=True).run_id
    return path, runs


def test_an_unaccused_game_is_not_scored_without_reveal(
    games: tuple[Path, dict[str, str]],
) -> None:
    """Before: `detect-eval --runs RUN` printed the game's mole (the confusion table's row) and
    strategy, exit 0. Now: one error line naming only the run, exit 1, the same wording for
    every game — mole or none — and nothing on stdout."""
    path, runs = games
    errors = []
    for who, rid in runs.items():
        for extra in ((), ("--json",)):
            proc = car(path, "detect-eval", "--runs", rid, *extra)
            assert proc.returncode == 1 and proc.stdout == "", (who, proc.stdout)
            assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1
            assert "--reveal" in proc.stderr and "Traceback" not in proc.stderr
            for secret in [*STRATEGIES, "planner", "intel", "lookout", "mole to evaluate"]:
                assert secret not in proc.stderr.replace(rid, "RUN"), (who, secret)
            errors.append(proc.stderr.replace(rid, "RUN"))
    assert len(set(errors)) == 1, errors
    # several runs: the first unaccused one is named, whatever the others hold
    proc = car(path, "detect-eval", "--runs", runs["intel"], "--runs", runs["none"])
    assert proc.returncode == 1 and f"run '{runs['intel']}' (and 1 more)" in proc.stderr


def test_reveal_accused_and_evaluation_games_are_scored(
    games: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """--reveal scores any game; an accused game needs no flag (its branch neither: the
    verdict is its game's); games detect-eval recorded need none either."""
    path, runs = games
    proc = car(path, "detect-eval", "--runs", runs["intel"], "--reveal", "--json")
    assert proc.returncode == 0, proc.stderr
    assert set(json.loads(proc.stdout)["methods"]["rules"]["confusion"]) == {"intel"}
    assert car(path, "accuse", runs["lookout"], "planner").returncode == 0
    proc = car(path, "detect-eval", "--runs", runs["lookout"], "--json")
    assert proc.returncode == 0, proc.stderr
    assert set(json.loads(proc.stdout)["methods"]["rules"]["confusion"]) == {"lookout"}
    fork = car(path, "fork", runs["lookout"], "--at", "3", "--do", "resample", "-n", "1", "--json")
    assert fork.returncode == 0, fork.stderr
    branch = json.loads(fork.stdout)["branches"][0]["run_id"]
    proc = car(path, "detect-eval", "--runs", branch, "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["games"] == 1, proc.stderr
    # a game played by a user in the same journal stays hidden next to evaluation games
    proc = car(path, "detect-eval", "-n", "1", "--seed", "11", "--json")
    assert proc.returncode == 0, proc.stderr
    with Journal(path) as j:
        recorded = [r.run_id for r in j.runs() if r.label == "detect-eval"]
    assert len(recorded) == 1
    assert car(path, "detect-eval", "--runs", recorded[0]).returncode == 0
    proc = car(path, "detect-eval", "--runs", recorded[0], "--runs", runs["planner"])
    assert proc.returncode == 1 and runs["planner"] in proc.stderr
