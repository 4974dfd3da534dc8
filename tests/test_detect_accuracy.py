"""The accuracy claims of the README, tested statistically over many games (seeds printed).

Games use seeds of their own (never the calibration's, which start at 1e9), the default crew
and crews of 4 and 8 agents whose names the detector was never developed on. A claim holds
when its 95% Wilson interval says so, not when one lucky seed does.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.detect.evaluate import evaluate, record_games
from engine.heist.sim import SimPolicy
from engine.journal import Journal

DATA = Path(__file__).resolve().parent / "data"
GAMES = 60
SEED = 70_000


@pytest.fixture(scope="module")
def default_crew(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:  # type: ignore[type-arg]
    print(f"default crew: {GAMES} games, seeds {SEED}..{SEED + GAMES - 1}")
    with Journal(tmp_path_factory.mktemp("acc") / "j.db") as j:
        runs = record_games(j, GAMES, seed=SEED, policy=SimPolicy())
        yield evaluate(j, runs, ["rules", "causal"])


def test_rules_beat_random_by_far(default_crew: dict) -> None:  # type: ignore[type-arg]
    """rules: top-1 accuracy >= 0.5 on the default crew, its 95% interval wholly above the
    random baseline 1/6, and AUROC of the per-agent scores above 0.75."""
    m = default_crew["methods"]["rules"]
    print(m["hits"], m["n"], m["ci95"], m["auroc"])
    assert m["n"] == GAMES
    assert m["accuracy"] >= 0.5 and m["ci95"][0] > m["random_baseline"]
    assert m["auroc"] > 0.75


def test_causal_names_the_mole(default_crew: dict) -> None:  # type: ignore[type-arg]
    """causal: top-1 accuracy >= 0.9 with the lower end of its 95% interval above 0.8, at
    most half the forward runs of a fixed K = 20 per agent (120 a game)."""
    m = default_crew["methods"]["causal"]
    print(m["hits"], m["n"], m["ci95"], m["forward_runs_per_game"])
    assert m["accuracy"] >= 0.9 and m["ci95"][0] > 0.8
    assert m["forward_runs_per_game"] <= 60


@pytest.mark.parametrize("method", ["rules", "causal"])
def test_confidence_is_calibrated_on_held_out_games(
    default_crew: dict,  # type: ignore[type-arg]
    method: str,
) -> None:
    """On games the calibration never saw, `confidence` is a probability: the mean confidence
    lies within the 95% interval of the hit rate (+/- 0.05), and its Brier score beats the
    best constant forecast (the hit rate itself) or equals it when every game is a hit."""
    m = default_crew["methods"][method]
    assert m["calibrated"]
    confs = [r["mean_confidence"] * r["games"] for r in m["reliability"] if r["games"]]
    mean_conf = sum(confs) / m["n"]
    acc = m["accuracy"]
    print(method, mean_conf, acc, m["ci95"], m["brier"])
    assert m["ci95"][0] - 0.05 <= mean_conf <= m["ci95"][1] + 0.05
    assert m["brier"] <= acc * (1 - acc) + 0.01


@pytest.mark.parametrize("crew", ["crew_unseen_4.yaml", "crew_unseen_8.yaml"])
def test_unseen_crews(tmp_path: Path, crew: str) -> None:
    """On 4- and 8-agent crews with names never seen, both rules and causal beat the random
    baseline: the lower end of each 95% interval lies above 1/#agents."""
    n, seed = 30, 80_000
    print(f"{crew}: {n} games, seeds {seed}..{seed + n - 1}")
    with Journal(tmp_path / "j.db") as j:
        runs = record_games(j, n, seed=seed, policy=SimPolicy(), config_path=DATA / crew)
        report = evaluate(j, runs, ["rules", "causal"], options={"k_max": 12})
    for method in ("rules", "causal"):
        m = report["methods"][method]
        print(method, m["hits"], m["n"], m["ci95"], m["random_baseline"])
        assert m["ci95"][0] > m["random_baseline"], method
