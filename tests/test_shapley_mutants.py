"""The Shapley estimator where mutation testing found it unchecked: seeds without CRN, long
runs, the interval's ends at few pairs, the bookkeeping of the result and its plain data.

Expected values come from scipy or from formulas written out here, never from the function
under test.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
from attribution_helpers import MODELS, Recording, Rule
from scipy import stats

from engine.attribution.base import Player
from engine.attribution.shapley import _values, estimate_value, shapley
from engine.errors import ConfigError


def wilson_by_hand(x: float, n: int, z: float) -> tuple[float, float]:
    p = x / n
    c = (p + z * z / (2 * n)) / (1 + z * z / n)
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (0.0 if x == 0 else c - h, 1.0 if x == n else c + h)


def rare_by_hand(column: np.ndarray, alpha: float) -> tuple[float, float]:
    """Newcombe's hybrid interval of the positive and negative parts' means (Wilson ends)."""
    n = len(column)
    z = float(stats.norm.ppf(1 - alpha / 2))
    pos, neg = float(np.clip(column, 0, 1).sum()), float(np.clip(-column, 0, 1).sum())
    (l1, u1), (l0, u0) = wilson_by_hand(pos, n, z), wilson_by_hand(neg, n, z)
    p1, p0 = pos / n, neg / n
    return (p1 - p0 - math.hypot(p1 - l1, u0 - p0), p1 - p0 + math.hypot(u1 - p1, p0 - l0))


def test_without_crn_every_coalition_of_a_chain_gets_its_own_seed() -> None:
    """crn=False: the m + 1 coalitions of a chain run on m + 1 different branch seeds."""
    model = Recording(MODELS["and_interaction"])
    shapley(model, rng=np.random.default_rng(3), permutations=6, efficiency_runs=8, crn=False)
    chains = [model.requests[i : i + 4] for i in range(0, 6 * 4, 4)]
    for chain in chains:
        assert len({r.branch_seed for r in chain}) == 4
    assert len({r.branch_seed for chain in chains for r in chain}) == 24


def test_a_run_of_64_steps() -> None:
    """Coalitions of a 64-step run (its last step is a word's top bit) are still the right
    keep sets: bad iff steps 0 and 63 are both kept gives each of them 1/2 in every antithetic
    pair and every other step 0; chain position t keeps exactly t steps."""
    model = Rule(64, lambda keep: {0, 63} <= keep)
    res = shapley(model, rng=np.random.default_rng(1), permutations=4, efficiency_runs=8)
    phi = [v.phi for v in res.values]
    assert phi[0] == phi[63] == 0.5 and phi[1:63] == [0.0] * 62
    chains = [model.requests[i : i + 65] for i in range(0, 4 * 65, 65)]
    for chain in chains:
        assert [len(r.keep) for r in chain] == list(range(65))


def test_two_pairs_already_give_a_t_interval() -> None:
    """With exactly two pairs (df = 1) the interval is the wider of the t interval and the
    rare-event bound, not the whole range; the spread is the ddof-1 standard deviation."""
    column = np.array([[0.5], [0.52]])
    (v,) = _values([Player("p", (0,))], column, 0.95)
    sd = float(np.std(column, ddof=1))
    t_half = float(stats.t.ppf(0.975, 1)) * sd / math.sqrt(2)
    rare = rare_by_hand(column[:, 0], 0.05)
    want = (max(-1.0, min(0.51 - t_half, rare[0])), min(1.0, max(0.51 + t_half, rare[1])))
    assert v.sd == pytest.approx(sd, abs=1e-12)
    assert v.ci == pytest.approx(want, abs=1e-12)
    assert v.ci != (-1.0, 1.0)


def test_the_interval_is_clipped_at_minus_one() -> None:
    """A strongly negative value with a wide interval is clipped to [-1, 1] at the low end."""
    column = np.array([[-1.0], [-1.0], [0.0]])
    (v,) = _values([Player("p", (0,))], column, 0.95)
    assert v.phi == pytest.approx(-2 / 3)
    assert v.ci[0] == -1.0 and -2 / 3 < v.ci[1] < 1.0


def test_fewer_than_two_pairs_keep_the_players_steps() -> None:
    """The whole-range interval of a single pair still names each player's steps."""
    res = shapley(
        MODELS["crew_late_pivot"], rng=np.random.default_rng(1), players="agents", permutations=2
    )
    assert [(v.player, v.steps) for v in res.values] == [
        ("planner", (0, 3)),
        ("intel", (1,)),
        ("hacker", (2,)),
        ("driver", (4, 5)),
    ]
    assert all(v.ci == (-1.0, 1.0) for v in res.values)


def test_estimate_value_uses_the_first_seeds_drawn() -> None:
    """A value's forward runs take the branch seeds drawn from `rng` (integers below 2^63)
    in order, one run each, with the asked keep set."""
    model = Recording(MODELS["refund_pivot"])
    got = estimate_value(model, frozenset({0, 1}), 25, np.random.default_rng(12))
    drawn = [int(s) for s in np.random.default_rng(12).integers(0, 2**63, size=25)]
    assert [r.branch_seed for r in model.requests] == drawn
    assert all(r.keep == frozenset({0, 1}) for r in model.requests)
    assert got == sum(MODELS["refund_pivot"].run_batch(model.requests)) / 25


def test_progress_total_without_a_budget() -> None:
    """With permutations and no budget, progress reports the planned total: the pairs' runs
    plus the efficiency check's (here 5 pairs x 2 chains x 4 coalitions + 2 x 8)."""
    calls: list[tuple[int, int | None]] = []
    res = shapley(
        MODELS["and_interaction"],
        rng=np.random.default_rng(2),
        permutations=10,
        efficiency_runs=8,
        progress=lambda done, total: calls.append((done, total)),
    )
    assert {total for _, total in calls} == {5 * 2 * 4 + 16}
    assert calls[-1] == (56, 56) == (res.forward_runs, res.forward_runs)


def test_a_single_step_gets_the_whole_value() -> None:
    """A one-step run is a valid model: its only player's value is v(all) - v(none) = 1."""
    res = shapley(
        Rule(1, lambda keep: 0 in keep), rng=np.random.default_rng(0), permutations=4,
        efficiency_runs=8,
    )  # fmt: skip
    assert [v.phi for v in res.values] == [1.0]
    assert res.efficiency.v_all == 1.0 and res.efficiency.v_none == 0.0


def test_a_model_without_steps_is_refused() -> None:
    """A model with no steps is a ConfigError saying so."""
    with pytest.raises(ConfigError, match=r"^the model has no steps to attribute$"):
        shapley(Rule(0, lambda keep: True), rng=np.random.default_rng(0), permutations=2)


def test_confidence_of_one_is_refused() -> None:
    """A confidence of exactly 1 has no finite interval: it is a ConfigError."""
    with pytest.raises(ConfigError, match=r"confidence must lie strictly between 0 and 1"):
        shapley(MODELS["and_interaction"], rng=np.random.default_rng(0), budget=1000, confidence=1)


@pytest.mark.parametrize("players", ["steps", "agents"])
def test_result_names_its_players_kind_and_budget(players: str) -> None:
    """The result says which players it valued and the budget it was given."""
    res = shapley(MODELS["refund_pivot"], rng=np.random.default_rng(5), players=players, budget=600)
    assert res.players == players and res.budget == 600
    assert res.to_dict()["players"] == players and res.to_dict()["budget"] == 600


def test_to_dict_keys() -> None:
    """to_dict() names exactly its fields, per value and for the efficiency check, with the
    values the result holds."""
    res = shapley(
        MODELS["refund_pivot"], rng=np.random.default_rng(6), budget=500, crn=False,
        runs_per_coalition=2,
    )  # fmt: skip
    data = msgspec.json.decode(msgspec.json.encode(res.to_dict()))
    assert set(data) == {
        "players", "values", "efficiency", "permutations", "permutations_requested",
        "partial", "forward_runs", "budget", "runs_per_coalition", "confidence", "crn",
    }  # fmt: skip
    assert (data["crn"], data["runs_per_coalition"], data["budget"]) == (False, 2, 500)
    assert (data["confidence"], data["permutations_requested"]) == (0.95, None)
    assert data["permutations"] == res.permutations and data["partial"] is False
    for v, want in zip(data["values"], res.values, strict=True):
        assert set(v) == {"player", "steps", "phi", "ci", "sd"}
        assert v["steps"] == list(want.steps) and v["ci"] == list(want.ci)
        assert (v["player"], v["phi"], v["sd"]) == (want.player, want.phi, want.sd)
    assert data["efficiency"]["difference_ci"] == list(res.efficiency.difference_ci)
    assert data["efficiency"]["runs"] == res.efficiency.runs


def test_no_pairs_give_zero_and_the_whole_range() -> None:
    """With no pairs at all each player's value is 0 (not the NaN mean of nothing), its
    interval [-1, 1] and its spread unknown."""
    values = _values([Player("p", (0,)), Player("q", (1,))], np.zeros((0, 2)), 0.95)
    assert [(v.phi, v.ci, v.sd) for v in values] == [(0.0, (-1.0, 1.0), None)] * 2
