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

import pytest

from engine.attribution import ForwardRequest
from engine.attribution.contrastive import (
    ContrastiveMode,
    ContrastiveResult,
    StepEffect,
    _rescue_free,
    adaptive_schedule,
    contrastive,
    locus_settling,
    wilson,
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
