"""Whether a locus is settled against the steps after it, and what would settle it.

The locus is the last step whose interval excludes zero; a later step without a rescue only
backs that claim when its own interval excludes an effect as strong as the locus's. On the
seed-7 heist a default scan's locus is 1-2 rescues in ~100 runs while the later steps have
29 runs each, so another --seed names another step: the report says so and what would
settle it."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import msgspec
import pytest

from engine.attribution import ForwardRequest
from engine.attribution.contrastive import (
    BATCH,
    MAX_FIXED_RUNS,
    MAX_RUNS_PER_STEP,
    MIN_FIXED_RUNS,
    ContrastiveMode,
    ContrastiveResult,
    Settling,
    StepEffect,
    _rescue_free,
    _round_down,
    _runs_to_exclude,
    adaptive_schedule,
    contrastive,
    locus_settling,
    wilson,
    z_value,
)
from engine.attribution.pcg import SeedStream
from engine.attribution.report import _to_settle
from engine.journal import Journal
from tests.test_attribute_cli import failed_heist

ROOT = Path(__file__).resolve().parent.parent


def effect(step: int, bad: int, n: int, alpha: float) -> StepEffect:
    lo, hi = wilson(bad, n, alpha)
    return StepEffect(
        step=step, label=str(step), agent=None, effect=bad / n - 1.0, ci=(lo - 1.0, hi - 1.0),
        n=n, excludes_zero=hi < 1.0, level=1 - alpha, phase="settled",
    )  # fmt: skip


def result(mode: str, steps: list[StepEffect], target: float | None = 0.1) -> ContrastiveResult:
    locus = max((s.step for s in steps if s.excludes_zero), default=None)
    return ContrastiveResult(
        mode=mode, confidence=0.95, crn=True, steps=tuple(steps), locus=locus,
        forward_runs=sum(s.n for s in steps), target_half_width=target, all_steps=False,
    )  # fmt: skip


def test_a_weak_locus_is_not_settled_and_the_suggested_width_settles_it() -> None:
    """Two rescues in 102 runs at step 2, none in 29 at steps 3 and 4 (the seed-7 heist's
    shape): both later intervals admit -0.0196; the suggested half-width gives rescue-free
    intervals that exclude it, and one twice as wide would not."""
    res = result("adaptive", [effect(2, 100, 102, 0.0375), effect(3, 29, 29, 0.0075),
                              effect(4, 29, 29, 0.0075)])  # fmt: skip
    s = locus_settling(res)
    assert s is not None and not s.settled
    assert s.not_excluded == (3, 4)
    assert s.half_width is not None and s.runs_per_step is not None
    n, lower = _rescue_free(0.95, s.half_width, 16, 4096)
    assert lower > res.effect_of(2).effect and n == s.runs_per_step
    # not needlessly narrow: twice the suggestion would not settle it
    assert _rescue_free(0.95, 2 * s.half_width, 16, 4096)[1] <= res.effect_of(2).effect


def test_a_strong_locus_is_settled() -> None:
    """Every run rescued at the locus: 29 rescue-free runs per later step exclude -1."""
    res = result("adaptive", [effect(5, 0, 16, 0.0025), effect(6, 29, 29, 0.0075)])
    assert locus_settling(res) is not None and locus_settling(res).settled  # type: ignore[union-attr]


def test_only_later_steps_count_and_no_locus_is_none() -> None:
    """An earlier step's wide interval does not unsettle the locus; without a locus, None."""
    res = result("adaptive", [effect(0, 16, 16, 0.05), effect(1, 0, 16, 0.0025)])
    assert locus_settling(res).settled  # type: ignore[union-attr]
    assert locus_settling(result("adaptive", [effect(0, 29, 29, 0.0075)])) is None


def test_fixed_mode_suggests_the_fewest_runs() -> None:
    """-K: the smallest K whose rescue-free interval (at the nominal level) excludes the
    locus's effect."""
    res = result("fixed", [effect(2, 98, 100, 0.05), effect(3, 100, 100, 0.05)], target=None)
    s = locus_settling(res)
    assert s is not None and not s.settled and s.not_excluded == (3,)
    k, strength = s.runs_per_step, res.effect_of(2).effect
    assert k is not None and _to_settle(s) == {"runs": k, "runs_per_step": k}
    assert wilson(k, k, 0.05)[0] - 1 > strength >= wilson(k - 1, k - 1, 0.05)[0] - 1


def test_out_of_reach_says_so() -> None:
    """An effect no rescue-free step can exclude within the cap per step: no suggestion."""
    res = result("adaptive", [effect(2, 9999, 10000, 0.0375), effect(3, 29, 29, 0.0075)])
    s = locus_settling(res)
    assert s is not None and not s.settled and s.half_width is None and s.runs_per_step is None


@pytest.mark.parametrize("seed", range(6))
def test_settling_matches_the_intervals_of_a_real_scan(seed: int) -> None:
    """On a model where re-deciding step 3 rescues with probability 1/20 and later steps never
    do, over seeds: the report's later steps are exactly those whose interval reaches the
    locus's effect, and a settled locus has none."""

    class Weak:
        n_steps = 6
        step_agents: ClassVar[list[str | None]] = [None] * 6
        step_labels: ClassVar[list[str]] = [str(i) for i in range(6)]

        def run_batch(self, requests: Sequence[ForwardRequest]) -> list[bool]:
            return [not (len(r.keep) == 3 and r.branch_seed % 20 == 0) for r in requests]

    res = contrastive(Weak(), rng=SeedStream(seed), mode=ContrastiveMode.ADAPTIVE,
                      target_half_width=0.1)  # fmt: skip
    s = locus_settling(res)
    if res.locus is None:
        assert s is None
        return
    strength = res.effect_of(res.locus).effect
    later = tuple(e.step for e in res.steps if e.step > res.locus and e.ci[0] <= strength)
    assert s is not None and s.not_excluded == later and s.settled == (not later)


def test_schedule_settle_look_is_what_a_rescue_free_step_takes() -> None:
    """The default scan's rescue-free step: 29 runs, interval down to -0.198 (the report's)."""
    n, lower = _rescue_free(0.95, 0.1, 16, 4096)
    assert n == 29 and math.isclose(lower, -0.19776788282102475)
    assert any(look.n == 29 for look in adaptive_schedule(0.95, 0.1, 16, 4096))


def test_cli_reports_whether_the_locus_is_settled(tmp_path: Path) -> None:
    """`car attribute`: --json carries locus_settled, not_excluded and to_settle, consistent
    with its ranked intervals; the text says "not settled" exactly when the JSON does."""
    jp = tmp_path / "j.db"
    with Journal(jp) as j:
        run = failed_heist(j)
    seen = set()
    for seed in range(3):
        base = [sys.executable, "-m", "cli", "--journal", str(jp), "attribute", run,
                "--seed", str(seed)]  # fmt: skip
        res = subprocess.run([*base, "--json"], capture_output=True, text=True, cwd=ROOT)
        assert res.returncode == 0, res.stderr
        data = json.loads(res.stdout)
        text = subprocess.run(base, capture_output=True, text=True, cwd=ROOT)
        assert text.returncode == 0, text.stderr
        if data["locus"] is None:
            assert data["locus_settled"] is None and data["not_excluded"] == []
            assert "is not excluded at any step" in text.stdout
            seen.add("none")
            continue
        rows = {r["step"]: r for r in data["ranked"]}
        strength = rows[data["locus"]]["effect"]
        later = sorted(s for s, r in rows.items() if s > data["locus"] and r["ci"][0] <= strength)
        assert data["not_excluded"] == later
        assert data["locus_settled"] == (not later)
        assert ("not settled" in text.stdout) == (not data["locus_settled"])
        if later and data["to_settle"] is not None:
            assert f"--half-width {data['to_settle']['half_width']:g}" in text.stdout
        seen.add(str(data["locus_settled"]))
    assert "False" in seen  # the heist's default scan leaves a locus unsettled


class NeverRescued:
    """One step whose re-decided runs all end bad: what a rescue-free later step sees."""

    n_steps = 1
    step_agents: ClassVar[list[str | None]] = [None]
    step_labels: ClassVar[list[str]] = ["0"]

    def run_batch(self, requests: Sequence[ForwardRequest]) -> list[bool]:
        return [True] * len(requests)


@pytest.mark.parametrize("half_width", [0.3, 0.15, 0.1, 0.05, 0.02, 0.0098, 0.0045, 0.001])
def test_rescue_free_is_where_the_scan_stops(half_width: float) -> None:
    """The settling check plans with the scan's own stopping rule: at every target, the runs
    and the interval it expects of a rescue-free step are those `contrastive` gives it (at
    0.15 the quick look's interval is just too wide to stop at)."""
    res = contrastive(NeverRescued(), rng=SeedStream(0), mode=ContrastiveMode.ADAPTIVE,
                      target_half_width=half_width)  # fmt: skip
    (step,) = res.steps
    assert _rescue_free(0.95, half_width, BATCH, MAX_RUNS_PER_STEP) == (step.n, step.ci[0])


def test_round_down_keeps_two_digits() -> None:
    assert [_round_down(x) for x in (0.0123456, 0.09, 0.987, 0.1, 0.00999)] == [
        0.012, 0.09, 0.98, 0.1, 0.0099,
    ]  # fmt: skip


def test_a_later_interval_reaching_exactly_the_locus_effect_admits_it() -> None:
    """The boundary: a later step whose interval ends exactly at the locus's effect does not
    exclude it."""
    locus = StepEffect(step=1, label="1", agent=None, effect=-0.25, ci=(-0.5, -0.1), n=8,
                       excludes_zero=True, level=0.95, phase="settled")  # fmt: skip
    later = StepEffect(step=2, label="2", agent=None, effect=0.0, ci=(-0.25, 0.0), n=8,
                       excludes_zero=False, level=0.95, phase="settled")  # fmt: skip
    s = locus_settling(result("adaptive", [locus, later]))
    assert s is not None and s.settled is False and s.not_excluded == (2,)
    nudged = msgspec.structs.replace(later, ci=(-0.2499, 0.0))
    assert locus_settling(result("adaptive", [locus, nudged])) == Settling(settled=True)


def test_unsettled_answers_are_false_not_merely_falsy() -> None:
    """settled is False (the JSON's `locus_settled: false`), in each mode and out of reach;
    out of reach still names the steps."""
    weak = [effect(2, 100, 102, 0.0375), effect(3, 29, 29, 0.0075)]
    out_of_reach = [effect(2, 9999, 10000, 0.0375), effect(3, 29, 29, 0.0075)]
    fixed = [effect(2, 98, 100, 0.05), effect(3, 100, 100, 0.05)]
    for s in (locus_settling(result("adaptive", weak)),
              locus_settling(result("adaptive", out_of_reach)),
              locus_settling(result("fixed", fixed, target=None))):  # fmt: skip
        assert s is not None and s.settled is False and s.not_excluded == (3,)


def test_a_result_without_its_target_starts_from_the_widest() -> None:
    """A hand-made adaptive result that does not say its target still gets a suggestion."""
    steps = [effect(2, 100, 102, 0.0375), effect(3, 29, 29, 0.0075)]
    s = locus_settling(result("adaptive", steps, target=None))
    assert s is not None and s.half_width is not None
    assert _rescue_free(0.95, s.half_width, BATCH, MAX_RUNS_PER_STEP)[1] > steps[0].effect


@pytest.mark.parametrize("alpha", [0.05, 0.01, 0.0075])
@pytest.mark.parametrize("strength", [-0.9, -0.25, -0.02, -0.0031, -1e-4])
def test_fewest_fixed_runs_by_the_closed_form(alpha: float, strength: float) -> None:
    """-K's suggestion is the fewest runs whose rescue-free interval excludes the effect
    (at least MIN_FIXED_RUNS), checked against the Wilson interval itself."""
    k = _runs_to_exclude(strength, alpha)
    assert wilson(k, k, alpha)[0] - 1 > strength
    assert k == MIN_FIXED_RUNS or wilson(k - 1, k - 1, alpha)[0] - 1 <= strength


def test_fixed_suggestion_is_capped_by_what_the_cli_takes() -> None:
    """Up to `car attribute -K`'s bound a suggestion is made (76,826 runs for -5e-05, which
    a doubling search once gave up on), beyond it none."""
    from engine.commands.counterfactual import MAX_RUNS

    assert MAX_FIXED_RUNS == MAX_RUNS
    near = [effect(2, 19999, 20000, 0.05), effect(3, 100, 100, 0.05)]  # -5e-05
    s = locus_settling(result("fixed", near, target=None))
    assert s is not None and s.runs_per_step == 76_826
    far = [effect(2, 199_999, 200_000, 0.05), effect(3, 100, 100, 0.05)]  # -5e-06
    s = locus_settling(result("fixed", far, target=None))
    assert s is not None and s.settled is False and s.runs_per_step is None


def test_a_suggestion_is_a_half_width_the_command_takes() -> None:
    """Without its target, a strong locus against a later step of one run: the suggestion is
    the widest candidate below the command's bound (--half-width < 0.5), 0.45."""
    locus = effect(2, 1, 4, 0.0375)  # -0.75
    later = effect(3, 1, 1, 0.0075)  # one run: its interval reaches -0.9
    s = locus_settling(result("adaptive", [locus, later], target=None))
    assert s is not None and s.not_excluded == (3,) and s.half_width == 0.45


def test_a_fixed_suggestion_at_exactly_the_bound_is_made() -> None:
    """An effect whose fewest runs are exactly -K's bound still gets its suggestion."""
    z2 = z_value(0.05) ** 2
    strength = -z2 / (
        MAX_FIXED_RUNS - 0.5 + z2
    )  # n > MAX_FIXED_RUNS - 1 - ... exactly at the bound
    assert _runs_to_exclude(strength, 0.05) == MAX_FIXED_RUNS
    locus = StepEffect(step=2, label="2", agent=None, effect=strength, ci=(-0.5, -1e-9), n=9,
                       excludes_zero=True, level=0.95, phase="fixed")  # fmt: skip
    s = locus_settling(result("fixed", [locus, effect(3, 100, 100, 0.05)], target=None))
    assert s is not None and s.runs_per_step == MAX_FIXED_RUNS
