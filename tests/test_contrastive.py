"""The contrastive estimator: intervals, the look schedule, modes, seeds and bookkeeping."""

from __future__ import annotations

import importlib

import msgspec
import numpy as np
import pytest
from attribution_helpers import MODELS, Recording
from scipy.stats import binomtest

from engine.attribution import contrastive
from engine.attribution.contrastive import adaptive_schedule, wilson
from engine.attribution.scm import load_scm
from engine.errors import ConfigError

# the module (the package's `contrastive` is its function)
contrastive_module = importlib.import_module("engine.attribution.contrastive")


@pytest.mark.parametrize(("bad", "n"), [(0, 10), (3, 10), (10, 10), (50, 100), (99, 100), (1, 418)])
@pytest.mark.parametrize("confidence", [0.95, 0.99])
def test_wilson_matches_scipy(bad: int, n: int, confidence: float) -> None:
    """The written-out Wilson interval equals scipy's binomtest(...).proportion_ci("wilson")."""
    ours = wilson(bad, n, 1 - confidence)
    ref = binomtest(bad, n).proportion_ci(confidence, method="wilson")
    assert ours == pytest.approx((ref.low, ref.high), abs=1e-12)


@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
@pytest.mark.parametrize("target", [0.02, 0.05, 0.1])
def test_schedule_spends_exactly_alpha_and_reaches_the_target(
    confidence: float, target: float
) -> None:
    """The looks' alphas add up to 1 - confidence; the last look meets the target in the worst
    case and the settle look meets it for a step without rescues."""
    looks = adaptive_schedule(confidence, target, 16, 100_000)
    assert sum(look.alpha for look in looks) == pytest.approx(1 - confidence)
    assert [look.n for look in looks] == sorted({look.n for look in looks})
    last = looks[-1]
    lo, hi = wilson(last.n // 2, last.n, last.alpha)
    assert (hi - lo) / 2 <= target
    settle = looks[-2]
    lo, hi = wilson(settle.n, settle.n, settle.alpha)
    assert (hi - lo) / 2 <= target


def test_fixed_mode_spends_k_runs_per_step_with_shared_seeds() -> None:
    """FIXED: k runs per step, keep = steps before k, run i of every step on one branch seed."""
    model = Recording(MODELS["refund_pivot"])
    result = contrastive(model, rng=np.random.default_rng(7), mode="fixed", k=40, all_steps=True)
    assert result.forward_runs == 3 * 40 == len(model.requests)
    assert [s.n for s in result.steps] == [40, 40, 40]
    # scanned from the last step backwards
    by_step = [model.requests[40 * (2 - k) : 40 * (3 - k)] for k in range(3)]
    for k, requests in enumerate(by_step):
        assert all(r.keep == frozenset(range(k)) for r in requests)
    assert [r.branch_seed for r in by_step[0]] == [r.branch_seed for r in by_step[2]]
    assert len({r.branch_seed for r in by_step[0]}) == 40


def test_without_crn_each_step_draws_its_own_seeds() -> None:
    """crn=False: the steps' branch seeds are independent draws."""
    model = Recording(MODELS["refund_pivot"])
    contrastive(model, rng=np.random.default_rng(7), mode="fixed", k=40, crn=False, all_steps=True)
    seeds = [{r.branch_seed for r in model.requests[40 * k : 40 * (k + 1)]} for k in range(3)]
    assert not (seeds[0] & seeds[1] or seeds[1] & seeds[2])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_adaptive_mode_meets_the_target_where_the_locus_claim_rests(name: str) -> None:
    """ADAPTIVE: the locus and every later step reach the target half-width; earlier steps
    get only the minimum budget; the runs add up."""
    model = Recording(MODELS[name])
    result = contrastive(
        model, rng=np.random.default_rng(3), target_half_width=0.05, min_runs=16, all_steps=True
    )
    assert result.locus == MODELS[name].exact_locus()
    assert result.locus is not None
    for step in result.steps[result.locus :]:
        assert step.half_width <= 0.05, step
    for step in result.steps[: result.locus]:
        assert step.n == 16 and step.phase == "minimum"
    assert result.forward_runs == sum(s.n for s in result.steps) == len(model.requests)


def test_adaptive_scan_shares_seeds_across_steps() -> None:
    """ADAPTIVE with CRN: run i of every scanned step uses the same branch seed."""
    model = Recording(MODELS["and_interaction"])
    contrastive(model, rng=np.random.default_rng(11))
    seeds: dict[frozenset[int], list[int]] = {}
    for r in model.requests:
        seeds.setdefault(r.keep, []).append(r.branch_seed)
    first = [seeds[k] for k in sorted(seeds, key=len)]
    shortest = min(len(s) for s in first)
    assert all(s[:shortest] == first[0][:shortest] for s in first)


def test_no_locus_when_no_step_can_rescue() -> None:
    """A run that is bad whatever happens has no locus, in both modes."""
    model = load_scm(
        "name: doomed\nsteps:\n  - name: a\n    p: 0.5\n  - name: b\n    p: 0.5\n"
        "bad: '1'\nfactual: [1, 1]\n"
    )
    assert model.exact_locus() is None
    for mode in ("fixed", "adaptive"):
        result = contrastive(model, rng=np.random.default_rng(1), mode=mode)
        assert len(result.steps) == 2  # no locus: the scan reaches the first step
        assert result.locus is None and result.locus_label is None
        assert all(s.effect == 0 and s.ci[1] == 0 for s in result.steps)


def test_progress_reports_runs_as_they_complete() -> None:
    """progress(done, total) rises to the runs spent; total is known in FIXED mode only."""
    calls: list[tuple[int, int | None]] = []
    result = contrastive(
        MODELS["refund_pivot"],
        rng=np.random.default_rng(1),
        mode="fixed",
        k=50,
        all_steps=True,
        progress=lambda done, total: calls.append((done, total)),
    )
    assert [c[0] for c in calls] == sorted(c[0] for c in calls)
    assert calls[-1] == (result.forward_runs, 150)
    calls.clear()
    result = contrastive(
        MODELS["refund_pivot"],
        rng=np.random.default_rng(1),
        progress=lambda done, total: calls.append((done, total)),
    )
    assert calls[-1] == (result.forward_runs, None)


def test_result_to_dict_is_plain_data() -> None:
    """to_dict() gives JSON-ready data with per-step effect, ci, n and the totals."""
    result = contrastive(MODELS["and_interaction"], rng=np.random.default_rng(2), all_steps=True)
    data = msgspec.json.decode(msgspec.json.encode(result.to_dict()))
    assert data["locus"] == 1 and data["locus_label"] == "skip_fraud_check"
    assert data["forward_runs"] == sum(s["n"] for s in data["steps"])
    assert set(data["steps"][0]) >= {"step", "label", "effect", "ci", "n", "excludes_zero"}
    assert [s.step for s in result.ranked()] == [0, 1, 2]


@pytest.mark.parametrize("mode", ["fixed", "adaptive"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_default_scan_stops_at_the_locus(name: str, mode: str) -> None:
    """By default the scan from the end stops at the locus: no forward run is spent on an
    earlier step, and the locus is the same as with --all-steps."""
    model = Recording(MODELS[name])
    result = contrastive(model, rng=np.random.default_rng(5), mode=mode, k=60)
    full = contrastive(MODELS[name], rng=np.random.default_rng(5), mode=mode, k=60, all_steps=True)
    assert result.locus == full.locus == MODELS[name].exact_locus()
    assert result.locus is not None
    assert [s.step for s in result.steps] == list(range(result.locus, model.n_steps))
    assert all(len(r.keep) >= result.locus for r in model.requests)
    assert result.forward_runs == len(model.requests) <= full.forward_runs
    if result.locus > 0:
        assert result.forward_runs < full.forward_runs
    assert not result.all_steps and full.all_steps


BAD_ARGUMENTS = [
    ({"mode": "fixd"}, r"contrastive mode must be one of 'fixed', 'adaptive', got 'fixd'"),
    ({"mode": "fixed", "k": 0}, r"k \(forward runs per step\) must be at least 2, got 0"),
    ({"mode": "fixed", "k": 1}, r"must be at least 2, got 1: the interval of a single run"),
    ({"confidence": 1.0}, r"confidence must lie strictly between 0 and 1, got 1\.0"),
    ({"target_half_width": 0.0}, r"target half-width must lie strictly between 0 and 0\.5"),
    ({"min_runs": 0}, r"min_runs must be at least 1, got 0"),
]


@pytest.mark.parametrize(("kwargs", "match"), BAD_ARGUMENTS)
def test_bad_arguments_fail_loudly(kwargs: dict[str, object], match: str) -> None:
    """Misspelled modes and impossible settings are ConfigErrors saying what was expected."""
    with pytest.raises(ConfigError, match=match):
        contrastive(MODELS["refund_pivot"], rng=np.random.default_rng(0), **kwargs)  # type: ignore[arg-type]


def test_result_to_dict_keys_and_settings() -> None:
    """to_dict() names exactly its fields; the confidence and the CRN setting are the ones
    asked for, each step names the agent that acted there, and the fixed scan's steps say
    they come from the fixed phase."""
    model = MODELS["and_interaction"]
    result = contrastive(
        model, rng=np.random.default_rng(2), mode="fixed", k=20, confidence=0.9, crn=False
    )
    data = result.to_dict()
    assert set(data) == {
        "mode", "confidence", "crn", "target_half_width", "locus", "locus_label",
        "forward_runs", "all_steps", "steps",
    }  # fmt: skip
    assert (data["confidence"], data["crn"], data["mode"]) == (0.9, False, "fixed")
    for s in data["steps"]:
        assert set(s) == {
            "step", "label", "agent", "effect", "ci", "n", "excludes_zero", "level", "phase",
        }  # fmt: skip
        assert s["agent"] == model.step_agents[s["step"]] and s["phase"] == "fixed"
        assert s["level"] == pytest.approx(0.9)


@pytest.mark.parametrize(
    ("confidence", "target"), [(0.95, 0.1), (0.95, 0.05), (0.9, 0.2), (0.99, 0.1), (0.95, 0.3)]
)
def test_blind_looks_are_exactly_those_no_count_of_bad_runs_can_stop(
    confidence: float, target: float
) -> None:
    """A look is blind when its interval is wider than the target at every count of bad runs;
    every other look but the last can stop a step at some count; the last is never blind."""
    schedule = adaptive_schedule(confidence, target, 16, 4096)
    blind = contrastive_module.blind_looks(schedule, target)
    assert len(schedule) - 1 not in blind
    for i, look in enumerate(schedule[:-1]):
        widths = [
            (hi - lo) / 2 for lo, hi in (wilson(b, look.n, look.alpha) for b in range(look.n + 1))
        ]
        assert (i in blind) == (min(widths) > target), (i, look)


def test_the_default_quick_look_is_blind() -> None:
    """At `car attribute`'s defaults (95%, half-width 0.1, batch 16) the quick look cannot
    stop a step: its 16 runs go with the settle look's, one batch of 29 where a step starts."""
    schedule = adaptive_schedule(0.95, 0.1, 16, 4096)
    assert [look.n for look in schedule] == [16, 29, 102]
    assert contrastive_module.blind_looks(schedule, 0.1) == frozenset({0})
    sizes: list[int] = []

    class Sizes(Recording):
        def run_batch(self, requests):  # type: ignore[no-untyped-def]
            sizes.append(len(requests))
            return super().run_batch(requests)

    model = Sizes(MODELS["refund_pivot"])
    result = contrastive(model, rng=np.random.default_rng(5), target_half_width=0.1)
    assert sizes[0] == 29 and 16 not in sizes
    assert sum(sizes) == result.forward_runs


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("target", [0.05, 0.1, 0.2])
def test_merging_blind_looks_changes_the_batches_only(
    name: str, target: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scan with blind looks merged into the next gives the same answer, from the same
    forward runs with the same seeds, as the scan that stops at every look, over 4 seeds;
    in no more batches."""
    for seed in range(4):
        merged = Recording(MODELS[name])
        kwargs = {"target_half_width": target, "all_steps": seed % 2 == 1}
        got = contrastive(merged, rng=np.random.default_rng(seed), **kwargs)  # type: ignore[arg-type]
        with monkeypatch.context() as m:
            m.setattr(contrastive_module, "blind_looks", lambda *a: frozenset())
            each = Recording(MODELS[name])
            want = contrastive(each, rng=np.random.default_rng(seed), **kwargs)  # type: ignore[arg-type]
        assert msgspec.to_builtins(got) == msgspec.to_builtins(want)
        assert [(r.keep, r.branch_seed) for r in merged.requests] == [
            (r.keep, r.branch_seed) for r in each.requests
        ]
        assert merged.batches <= each.batches
