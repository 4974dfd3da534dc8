"""The Monte Carlo Shapley estimator: budget, no caching, antithetic pairs, players."""

from __future__ import annotations

import itertools

import msgspec
import numpy as np
import pytest
from attribution_helpers import MODELS, Recording

from engine.attribution import ForwardRequest, players_of
from engine.attribution.shapley import estimate_value, shapley
from engine.errors import ConfigError


def test_circuit_breaker_stops_at_the_budget_and_marks_partial() -> None:
    """A budget below the requested permutations stops cleanly, never overspends, says partial."""
    model = Recording(MODELS["and_interaction"])
    result = shapley(model, rng=np.random.default_rng(1), permutations=10_000, budget=500)
    # one antithetic pair = 2 chains x 4 coalitions; 10% of the budget (2 x 25 runs) stays
    # reserved for the efficiency check
    assert result.partial
    assert result.efficiency.runs == 50
    assert result.permutations == 2 * ((500 - 50) // 8) == 112
    assert result.permutations_requested == 10_000
    assert result.forward_runs == len(model.requests) <= 500


def test_enough_budget_is_not_partial() -> None:
    """With the budget to spare, every requested permutation completes."""
    result = shapley(
        MODELS["and_interaction"], rng=np.random.default_rng(1), permutations=100, budget=10_000
    )
    assert not result.partial and result.permutations == 100
    # the efficiency check is 10% of what the permutations need: 400 / 0.9 * 0.1 = 2 x 22
    assert result.efficiency.runs == 44
    assert result.forward_runs == 50 * 8 + 44
    only_budget = shapley(MODELS["and_interaction"], rng=np.random.default_rng(1), budget=1000)
    assert only_budget.efficiency.runs == 100
    assert not only_budget.partial and only_budget.permutations == 2 * (900 // 8)


def test_efficiency_check_grows_with_the_budget() -> None:
    """The efficiency check spends a fixed share of the budget, not a fixed number of runs."""
    runs = [
        shapley(MODELS["and_interaction"], rng=np.random.default_rng(1), budget=b).efficiency.runs
        for b in (200, 512, 2000, 8000)
    ]
    assert runs == [20, 50, 200, 800]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"budget": 20},
            r"budget of 20 forward runs cannot cover one antithetic pair \(8 runs for 3 players\) "
            r"plus the efficiency check \(16 runs\)",
        ),
        ({}, r"give a number of permutations, a budget of forward runs, or both"),
        ({"permutations": 1}, r"permutations must be at least 2"),
        (
            {"budget": 1000, "players": "agent"},
            r"players must be one of 'steps', 'agents', got 'agent'",
        ),
        ({"budget": 1000, "confidence": 0}, r"confidence must lie strictly between 0 and 1"),
    ],
)
def test_bad_arguments_fail_loudly(kwargs: dict[str, object], match: str) -> None:
    """Impossible budgets and misspelled players are ConfigErrors saying what was expected."""
    with pytest.raises(ConfigError, match=match):
        shapley(MODELS["and_interaction"], rng=np.random.default_rng(0), **kwargs)  # type: ignore[arg-type]


def test_values_are_never_cached_across_permutations() -> None:
    """Every coalition is re-run with fresh seeds each time a permutation needs it."""
    model = Recording(MODELS["and_interaction"])
    result = shapley(model, rng=np.random.default_rng(5), permutations=200, budget=10_000)
    chains = result.permutations
    # m + 1 coalitions per chain, no reuse; then the efficiency check
    assert len(model.requests) == chains * 4 + result.efficiency.runs
    by_keep: dict[frozenset[int], list[int]] = {}
    for r in model.requests[: chains * 4]:
        by_keep.setdefault(r.keep, []).append(r.branch_seed)
    # the empty and the full coalition close every chain; each time with a new seed
    assert len(by_keep[frozenset()]) == chains
    assert len(set(by_keep[frozenset()])) == chains


def test_two_estimates_of_one_value_differ() -> None:
    """Two estimates of the same v(S) come from different forward runs and differ."""
    model = MODELS["and_interaction"]
    rng = np.random.default_rng(8)
    estimates = {estimate_value(model, frozenset({0}), 200, rng) for _ in range(5)}
    assert len(estimates) > 1


def test_permutations_come_in_antithetic_pairs_sharing_seeds_within_a_chain() -> None:
    """Each permutation is followed by its reverse; a chain's coalitions share branch seeds."""
    model = Recording(MODELS["crew_late_pivot"])
    shapley(model, rng=np.random.default_rng(4), permutations=20, budget=10_000)
    m = model.n_steps
    chains = [model.requests[i : i + m + 1] for i in range(0, 20 * (m + 1), m + 1)]

    def order(chain: list[ForwardRequest]) -> list[int]:
        return [next(iter(b.keep - a.keep)) for a, b in itertools.pairwise(chain)]

    for forward, backward in zip(chains[0::2], chains[1::2], strict=True):
        assert order(backward) == order(forward)[::-1]
    for chain in chains:
        assert len({r.branch_seed for r in chain}) == 1
    assert len({chain[0].branch_seed for chain in chains}) == len(chains)


def test_agents_are_players_whose_steps_move_together() -> None:
    """players='agents': one value per agent; an agent's steps join a coalition at once."""
    model = Recording(MODELS["crew_late_pivot"])
    result = shapley(
        model, rng=np.random.default_rng(6), players="agents", permutations=40, budget=10_000
    )
    assert [v.player for v in result.values] == ["planner", "intel", "hacker", "driver"]
    assert result.values[0].steps == (0, 3)
    sizes = {len(r.keep) for r in model.requests}
    assert {0, 6} <= sizes
    groups = [set(p.steps) for p in players_of(model, "agents")]
    for r in model.requests:
        assert all(g <= r.keep or not (g & r.keep) for g in groups)


def test_fewer_than_two_pairs_give_the_whole_range() -> None:
    """One antithetic pair cannot estimate a spread: its intervals are [-1, 1]."""
    result = shapley(MODELS["and_interaction"], rng=np.random.default_rng(1), permutations=2)
    assert all(v.ci == (-1.0, 1.0) and v.sd is None for v in result.values)


def test_progress_and_to_dict() -> None:
    """progress ends at the runs spent, with the planned total; to_dict() is plain data."""
    calls: list[tuple[int, int | None]] = []
    result = shapley(
        MODELS["refund_pivot"],
        rng=np.random.default_rng(3),
        budget=2000,
        progress=lambda done, total: calls.append((done, total)),
    )
    assert calls[-1] == (result.forward_runs, result.forward_runs)
    data = msgspec.json.decode(msgspec.json.encode(result.to_dict()))
    assert [v["player"] for v in data["values"]] == ["greet", "decide_refund", "issue_refund"]
    assert set(data["efficiency"]) == {
        "sum_phi",
        "v_all",
        "v_none",
        "difference",
        "difference_ci",
        "runs",
    }
    assert data["efficiency"]["v_all"] == 1.0
