"""validate()'s report on a model whose exact answers are worked out by hand, its plain data,
the family rule's text and checks, the generators per model, and the progress count.

Model `pair`: steps a and b, each 1 with p = 1/2, bad iff both (factual [1, 1]). By hand:
P(bad | keep {}) = 1/4, keep {a} or {b} = 1/2, keep {a, b} = 1; contrastive effects
(1/4 - 1, 1/2 - 1) = (-3/4, -1/2), so the locus is b; Shapley values by symmetry
(1 - 1/4) / 2 = 3/8 each; efficiency v(all) - v(none) = 3/4.
"""

from __future__ import annotations

import zlib

import msgspec
import numpy as np
import pytest

from engine.attribution import contrastive
from engine.attribution.scm import EXACT_TOLERANCE, builtin_models, load_scm
from engine.attribution.shapley import shapley
from engine.attribution.validate import covers, family_rule, model_rng, validate
from engine.errors import ConfigError

PAIR = load_scm(
    "name: pair\ndescription: both must go wrong\nsteps:\n  - {name: a, p: 0.5}\n"
    "  - {name: b, p: 0.5, agent: bo}\nbad: 'a and b'\nfactual: [1, 1]\n"
)


def test_covers_forgives_only_enumeration_noise() -> None:
    """covers() accepts a value within 1e-9 outside the interval, not more."""
    assert covers((0.0, 0.5), 0.5 + 5e-10) and covers((0.0, 0.5), -5e-10)
    assert not covers((0.0, 0.5), 0.5 + 2e-9) and not covers((0.0, 0.5), -2e-9)
    assert covers((0.2, 0.3), 0.25)
    # both ends inclusive, tolerance included
    assert covers((0.5, 1.0), 0.5 - EXACT_TOLERANCE) and covers((0.5, 1.0), 1.0 + EXACT_TOLERANCE)
    assert covers((0.5, 1.0), 0.5) and covers((0.5, 1.0), 1.0)


def test_model_rng_is_keyed_by_seed_and_model_name() -> None:
    """The two generators are the children of SeedSequence([seed, crc32(name)]), so a
    model's answer does not depend on which other models are validated with it."""
    a, b = model_rng(7, PAIR)
    ref_a, ref_b = np.random.SeedSequence([7, zlib.crc32(b"pair")]).spawn(2)
    assert a.integers(0, 2**63, size=4).tolist() == (
        np.random.default_rng(ref_a).integers(0, 2**63, size=4).tolist()
    )
    assert b.integers(0, 2**63, size=4).tolist() == (
        np.random.default_rng(ref_b).integers(0, 2**63, size=4).tolist()
    )


def test_family_rule_text_and_counts() -> None:
    """m counts every step and every player of every model before any run; the rule's text
    states the count, the per-interval level to three decimals and the family's level."""
    rule = family_rule(builtin_models(), "steps", 0.05)
    assert rule.intervals == 30 and rule.level == pytest.approx(1 - 0.05 / 30, abs=1e-15)
    assert rule.describe() == (
        "check: every exact value inside its interval; Bonferroni over 30 intervals, each at "
        "99.833%, so that a correct estimator passes with probability >= 95%"
    )
    agents = family_rule([PAIR], "agents", 0.1)
    assert agents.intervals == 2 + 2 and agents.alpha == 0.1
    assert agents.level == pytest.approx(1 - 0.1 / 4, abs=1e-15)
    none = family_rule([], "steps", 0.05)
    assert (none.intervals, none.level) == (0, 0.95)  # no intervals: nothing to split
    for alpha in (0.0, 1.0):
        with pytest.raises(
            ConfigError, match=r"^family-wise alpha must lie strictly between 0 and 1, got"
        ):
            family_rule([PAIR], "steps", alpha)


@pytest.mark.parametrize("k", [None, 40])
def test_report_on_a_hand_worked_model(k: int | None) -> None:
    """The report holds the estimators' answers (run with the model's generators at the
    family level) next to the exact values worked out by hand."""
    (report,) = validate([PAIR], seed=3, k=k, budget=600, all_steps=True)
    level = 1 - 0.05 / 4
    c_rng, s_rng = model_rng(3, PAIR)
    mode = "adaptive" if k is None else "fixed"
    c = contrastive(PAIR, rng=c_rng, mode=mode, k=k or 100, confidence=level, all_steps=True)
    s = shapley(PAIR, rng=s_rng, budget=600, confidence=level)
    assert (report.scm, report.description, report.players, report.mode, report.seed) == (
        "pair", "both must go wrong", "steps", mode, 3,
    )  # fmt: skip
    assert report.level == pytest.approx(level, abs=1e-15)
    assert [e.exact for e in report.contrastive] == pytest.approx([-0.75, -0.5], abs=1e-12)
    assert [e.effect for e in report.contrastive] == [e.effect for e in c.steps]
    assert [e.ci for e in report.contrastive] == [e.ci for e in c.steps]
    assert [e.n for e in report.contrastive] == [e.n for e in c.steps]
    assert [e.label for e in report.contrastive] == ["a", "b"]
    assert [e.excludes_zero for e in report.contrastive] == [e.excludes_zero for e in c.steps]
    for e in report.contrastive:
        assert e.covered == (e.ci[0] - 1e-9 <= e.exact <= e.ci[1] + 1e-9)
    assert [x.exact for x in report.shapley] == pytest.approx([0.375, 0.375], abs=1e-12)
    assert [(x.player, x.phi, x.ci) for x in report.shapley] == [
        (v.player, v.phi, v.ci) for v in s.values
    ]
    assert report.efficiency_exact == pytest.approx(0.75, abs=1e-12)
    assert report.efficiency_estimated == s.efficiency.sum_phi
    assert report.efficiency_runs_estimate == s.efficiency.difference
    assert (report.locus_exact, report.locus_exact_label) == (1, "b")
    assert (report.locus_estimated, report.locus_estimated_label) == (c.locus, "b")
    assert report.locus_ok
    assert (report.contrastive_runs, report.shapley_runs) == (c.forward_runs, s.forward_runs)
    assert report.forward_runs == c.forward_runs + s.forward_runs
    assert (report.permutations, report.partial) == (s.permutations, s.partial)
    covered = [e.covered for e in report.contrastive] + [x.covered for x in report.shapley]
    assert report.ok == all(covered)


def test_a_missed_interval_makes_the_report_not_ok() -> None:
    """A model whose forward runs never end bad cannot cover its exact values: not ok, and
    no locus is estimated where the exact one is b."""

    class Never:
        name = PAIR.name
        description = PAIR.description
        n_steps = PAIR.n_steps
        step_agents = PAIR.step_agents
        step_labels = PAIR.step_labels
        exact_effects = PAIR.exact_effects
        exact_locus = PAIR.exact_locus
        exact_shapley = PAIR.exact_shapley
        exact_efficiency = PAIR.exact_efficiency
        require_exact = PAIR.require_exact
        source = PAIR.source

        def run_batch(self, requests: list[object]) -> list[bool]:
            return [False] * len(requests)

    (report,) = validate([Never()], seed=1, k=30, budget=400)  # type: ignore[list-item]
    assert not report.ok
    assert not all(x.covered for x in report.shapley)
    assert report.locus_estimated == 1 and report.locus_exact == 1


def test_players_agents_and_the_plain_data() -> None:
    """players='agents' values the model's agents; to_dict() names exactly its fields and
    holds the report's values."""
    (report,) = validate([PAIR], seed=5, budget=500, players="agents", crn=False)
    assert report.players == "agents"
    assert [x.player for x in report.shapley] == ["a", "bo"]
    data = msgspec.json.decode(msgspec.json.encode(report.to_dict()))
    assert set(data) == {
        "scm", "description", "players", "mode", "seed", "locus", "shapley", "efficiency",
        "forward_runs", "contrastive_runs", "shapley_runs", "permutations", "partial", "level",
        "contrastive", "ok", "locus_ok",
    }  # fmt: skip
    assert data["locus"] == {
        "estimated": report.locus_estimated,
        "exact": 1,
        "estimated_label": report.locus_estimated_label,
        "exact_label": "b",
        "ok": report.locus_ok,
    }
    assert data["efficiency"] == {
        "estimated": report.efficiency_estimated,
        "exact": report.efficiency_exact,
        "forward_runs_estimate": report.efficiency_runs_estimate,
    }
    assert data["shapley"] == [
        {"player": x.player, "phi": x.phi, "ci": list(x.ci), "exact": x.exact, "covered": x.covered}
        for x in report.shapley
    ]
    assert data["contrastive"] == [
        {
            "step": e.step, "label": e.label, "effect": e.effect, "ci": list(e.ci), "n": e.n,
            "exact": e.exact, "covered": e.covered, "excludes_zero": e.excludes_zero,
        }
        for e in report.contrastive
    ]  # fmt: skip
    assert (data["scm"], data["description"], data["mode"], data["seed"]) == (
        "pair", "both must go wrong", "adaptive", 5,
    )  # fmt: skip
    assert data["forward_runs"] == report.forward_runs
    assert (data["contrastive_runs"], data["shapley_runs"]) == (
        report.contrastive_runs, report.shapley_runs,
    )  # fmt: skip
    assert (data["permutations"], data["partial"], data["level"]) == (
        report.permutations, report.partial, report.level,
    )  # fmt: skip
    assert (data["ok"], data["locus_ok"]) == (report.ok, report.locus_ok)


def test_progress_counts_runs_across_models() -> None:
    """progress(done, None) rises across all models' runs, contrastive then Shapley, and ends
    at the sum of every report's forward runs."""
    calls: list[tuple[int, int | None]] = []
    models = [PAIR, *builtin_models()[:2]]
    reports = validate(models, seed=2, budget=500, progress=lambda d, t: calls.append((d, t)))
    done = [d for d, _ in calls]
    assert done == sorted(done) and {t for _, t in calls} == {None}
    assert done[-1] == sum(r.forward_runs for r in reports)
    first = reports[0]
    assert first.contrastive_runs in done
    assert first.forward_runs in done
    assert first.forward_runs + reports[1].contrastive_runs in done


def test_by_default_the_scan_stops_at_the_locus() -> None:
    """Without all_steps the contrastive part checks only the locus and the steps after it
    (here b alone: a is never estimated)."""
    (report,) = validate([PAIR], seed=3, budget=400)
    assert [e.step for e in report.contrastive] == [1]
    assert report.locus_estimated == 1
