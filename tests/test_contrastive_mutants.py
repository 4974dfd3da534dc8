"""The contrastive estimator where mutation testing found it unchecked: the look sizes, the
seeds each phase uses, the defaults, the labels of phases and agents, and the interval's ends.

Expected values come from scipy or from formulas written out here, never from the function
under test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from attribution_helpers import MODELS, Recording, Rule
from scipy.stats import norm

from engine.attribution import contrastive
from engine.attribution.contrastive import _runs_for_half_width, wilson
from engine.errors import ConfigError


def half_by_hand(bad: int, n: int, alpha: float) -> float:
    """The Wilson half-width written out with scipy's z, ends pinned at 0 and 1."""
    z = float(norm.ppf(1 - alpha / 2))
    p = bad / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    lo = 0.0 if bad == 0 else max(0.0, centre - h)
    hi = 1.0 if bad == n else min(1.0, centre + h)
    return (hi - lo) / 2


@pytest.mark.parametrize("worst_case", [True, False])
@pytest.mark.parametrize("alpha", [0.05, 0.0075, 0.04])
@pytest.mark.parametrize("target", [0.3, 0.1, 0.05, 0.02])
def test_runs_for_half_width_is_the_smallest_such_n(
    target: float, alpha: float, worst_case: bool
) -> None:
    """The look size is the smallest n whose Wilson half-width (half of the runs bad in the
    worst case, all of them otherwise) is at most the target: every smaller n misses it."""
    n = _runs_for_half_width(target, alpha, worst_case=worst_case)

    def half(m: int) -> float:
        return half_by_hand(m // 2 if worst_case else m, m, alpha)

    assert half(n) <= target + 1e-12
    assert all(half(m) > target for m in range(1, n))


def test_a_target_equal_to_a_half_width_is_met_there() -> None:
    """ "Half-width <= target" includes equality: a target that is exactly the half-width at
    300 runs is met at 300 runs, not one later (300 is no power of two, so the bisection, not
    the doubling, finds it)."""
    alpha = 0.05
    lo, hi = wilson(150, 300, alpha)
    target = (hi - lo) / 2
    assert half_by_hand(149, 299, alpha) > target
    assert _runs_for_half_width(target, alpha, worst_case=True) == 300


def test_an_unreachable_target_is_refused() -> None:
    """A half-width that would need more than 2^30 runs is a ConfigError, not a hang."""
    with pytest.raises(ConfigError, match=r"target half-width 1e-06 is out of reach"):
        _runs_for_half_width(1e-6, 0.05, worst_case=True)


def test_wilson_ends_stay_in_the_unit_interval_for_fractional_counts() -> None:
    """The Shapley rare-event bound passes fractional counts. Just below n (or just above 0)
    the closed form can round past 1 (or below 0); the interval is clipped to [0, 1] at
    every such count."""
    for n in range(2, 60):
        for eps in (1e-8, 1e-9, 1e-10):
            lo, hi = wilson(n - eps, n, 0.05)
            assert 0.0 <= lo < hi <= 1.0, (n, eps)
            lo, hi = wilson(eps, n, 0.05)
            assert 0.0 <= lo < hi <= 1.0, (n, eps)


def test_fixed_mode_defaults_to_100_runs_per_step() -> None:
    """The paper's K: without `k`, the fixed scan spends 100 forward runs on every step."""
    model = Recording(MODELS["refund_pivot"])
    result = contrastive(model, rng=np.random.default_rng(1), mode="fixed", all_steps=True)
    assert [s.n for s in result.steps] == [100, 100, 100]
    assert result.forward_runs == 300 == len(model.requests)


def test_fixed_mode_uses_the_first_seeds_drawn() -> None:
    """Run i of every step takes the i-th branch seed drawn from `rng` (integers below 2^63),
    from the first one on."""
    model = Rule(3, lambda keep: 1 in keep, ["a", "b", "c"])
    contrastive(model, rng=np.random.default_rng(7), mode="fixed", k=30, all_steps=True)
    drawn = [int(s) for s in np.random.default_rng(7).integers(0, 2**63, size=30)]
    for step in range(3):
        seeds = [r.branch_seed for r in model.requests if r.keep == frozenset(range(step))]
        assert seeds == drawn, step


def test_adaptive_minimum_phase_reuses_the_first_shared_seeds() -> None:
    """Steps before the locus get `min_runs` runs on the first `min_runs` shared seeds (the
    same seeds as the locus' first runs), and say so in their phase; the steps scanned at the
    schedule's looks are "settled"."""
    model = Rule(4, lambda keep: 2 in keep, ["a", "b", "c", "d"])
    result = contrastive(model, rng=np.random.default_rng(9), min_runs=12, batch=16, all_steps=True)
    assert result.locus == 2
    drawn = [int(s) for s in np.random.default_rng(9).integers(0, 2**63, size=16)]
    for step in (0, 1):
        seeds = [r.branch_seed for r in model.requests if r.keep == frozenset(range(step))]
        assert seeds == drawn[:12], step
        assert result.effect_of(step).phase == "minimum"
        assert result.effect_of(step).n == 12
    locus_seeds = [r.branch_seed for r in model.requests if r.keep == frozenset(range(2))]
    assert locus_seeds[:16] == drawn
    assert [result.effect_of(s).phase for s in (2, 3)] == ["settled", "settled"]


@pytest.mark.parametrize("mode", ["fixed", "adaptive"])
def test_each_effect_names_the_agent_of_its_step(mode: str) -> None:
    """Every step's effect carries the agent that acted at that step (None where none did)."""
    agents = ["planner", None, "driver", "planner"]
    model = Rule(4, lambda keep: 2 in keep, agents)
    result = contrastive(model, rng=np.random.default_rng(2), mode=mode, k=20, all_steps=True)
    assert [s.agent for s in result.steps] == agents
    assert [s.label for s in result.steps] == ["s0", "s1", "s2", "s3"]


def test_adaptive_result_keeps_the_confidence_asked_for() -> None:
    """The adaptive result reports the confidence it was run at and its target half-width."""
    result = contrastive(
        MODELS["refund_pivot"], rng=np.random.default_rng(4), confidence=0.9, target_half_width=0.1
    )
    assert result.confidence == 0.9 and result.target_half_width == 0.1
    assert result.mode == "adaptive" and result.to_dict()["confidence"] == 0.9


def test_a_model_without_steps_is_refused() -> None:
    """A model with no steps is a ConfigError saying so, in either mode."""
    for mode in ("fixed", "adaptive"):
        with pytest.raises(ConfigError, match=r"^the model has no steps to attribute$"):
            contrastive(Rule(0, lambda keep: True, []), rng=np.random.default_rng(0), mode=mode)


def test_batch_below_one_is_refused_and_one_is_enough() -> None:
    """batch 0 is a ConfigError naming `batch`; batch 1 and min_runs 1 are valid settings
    (a quick look after a single run)."""
    with pytest.raises(ConfigError, match=r"^batch must be at least 1, got 0$"):
        contrastive(MODELS["refund_pivot"], rng=np.random.default_rng(0), batch=0)
    model = Rule(3, lambda keep: 1 in keep, ["a", "b", "c"])
    result = contrastive(model, rng=np.random.default_rng(0), batch=1, min_runs=1, all_steps=True)
    assert result.locus == 1
    assert result.effect_of(0).n == 1 and result.effect_of(0).phase == "minimum"


def test_a_single_step_run_is_attributed() -> None:
    """A one-step run is a valid model: re-deciding its only step rescues, so it is the locus."""
    for mode in ("fixed", "adaptive"):
        result = contrastive(
            Rule(1, lambda keep: 0 in keep, ["a"]), rng=np.random.default_rng(0), mode=mode, k=20
        )
        assert result.locus == 0 and result.effect_of(0).effect == -1.0, mode


@pytest.mark.parametrize("crn", [True, False])
def test_adaptive_result_says_whether_seeds_were_shared(crn: bool) -> None:
    """The adaptive result reports the CRN setting it ran with."""
    result = contrastive(MODELS["refund_pivot"], rng=np.random.default_rng(1), crn=crn)
    assert result.crn is crn and result.to_dict()["crn"] is crn


def test_adaptive_minimum_defaults_to_16_runs() -> None:
    """Without `min_runs`, each step before the locus gets 16 forward runs."""
    model = Rule(4, lambda keep: 2 in keep, ["a", "b", "c", "d"])
    result = contrastive(model, rng=np.random.default_rng(3), all_steps=True)
    assert [result.effect_of(s).n for s in (0, 1)] == [16, 16]


def test_effect_of_a_step_not_scanned_names_it() -> None:
    """effect_of() of a step the scan stopped before raises KeyError carrying that step."""
    model = Rule(4, lambda keep: 2 in keep, ["a", "b", "c", "d"])
    result = contrastive(model, rng=np.random.default_rng(3), mode="fixed", k=10)
    with pytest.raises(KeyError) as caught:
        result.effect_of(0)
    assert caught.value.args == (0,)
