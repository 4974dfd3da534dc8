"""The contrastive single-step estimator and the point-of-commitment rule.

For step k: keep steps < k factual, re-decide step k and everything after it (do_resample(k)
and run forward), and estimate

    effect_k = P(bad | do_resample(k)) - P(bad | factual).

P(bad | factual) is taken as exactly 1: the run being attributed is a recorded bad run, and
keeping every step replays its actions, so a deterministic (rule-based) outcome is bad again.
Only P(bad | do_resample(k)) is estimated, from n forward runs, with a Wilson interval; the
effect's interval is that interval shifted by -1. Effects are therefore never positive, and an
interval lies entirely below zero exactly when at least one forward run was rescued. The
assumption fails for judge-based or otherwise noisy outcomes; such a model should estimate the
factual rate itself.

Resampling step k also re-rolls every later step (the run-forward confound), so early
irrelevant steps look causal. The point-of-commitment rule therefore names as the causal locus
the LAST step whose interval lies entirely below zero: the last point where re-deciding can
still save the run. No such step means no locus (None).

The scan runs from the last step backwards and, by default, stops at the locus: steps before
it are estimated only on request (`all_steps`). Stopping there costs no error rate: the run
being attributed is bad under its factual actions, so a step without effect can never show a
rescue and no look at it can exclude zero by chance; every look's error is in its interval's
coverage, which the looks' alpha split below pays for.

Two modes:

* FIXED (the paper): K forward runs at every scanned step, each interval at the nominal level.
* ADAPTIVE: scan from the last step backwards and spend runs where they decide something.
  Each scanned step is sampled cumulatively at a pre-specified schedule of looks (`Look`),
  and stops at the first look whose interval has half-width <= target: below zero, it is the
  locus; containing zero, the step has no effect and the scan moves one step earlier. The
  schedule puts a quick look at `batch` runs (large effects show a rescue at once), a look
  where a rescue-free step is settled, and a refine look sized so that the worst case
  (p = 1/2) meets the target. Steps before the locus get `min_runs` runs only, one look each
  at the nominal level, for the ranked table.

Repeated looks are paid for with a Bonferroni split of alpha = 1 - confidence over the
schedule (5% / 15% / 80% of alpha for the quick, settle and refine looks). The look sizes are
fixed before any data is seen, so by the union bound all looks of a step cover the truth
simultaneously with probability >= confidence, whichever look the data stops at; the reported
interval keeps the nominal coverage despite the optional stopping. A look that cannot stop a
step at any count of bad runs (`blind_looks`: at the defaults, the quick look) gets its runs
in one batch with the next look's: the same runs and answer, one wait for the workers fewer.

Settling (`settle_contrastive`, `car attribute --settle N`): up to N scans until the locus is
settled against the later steps (`locus_settling`), each at 1/N of the error rate, a later
scan on forward runs of its own at the target the one before suggested.

Common random numbers: run i of every step uses the same branch seed, so under the
ForwardModel's (branch_seed, j) contract the runs of different steps share the random numbers
of later steps. This does NOT narrow any single effect's interval (P(bad | factual) is known,
so each effect is a one-sample estimate); it correlates the estimates of neighbouring steps,
which makes their differences (how much step k adds over step k+1) less noisy. The benchmark
measures both.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from enum import StrEnum
from statistics import NormalDist
from typing import TYPE_CHECKING, Any, Union

import msgspec

from engine.attribution.base import (
    ForwardModel,
    ForwardRequest,
    Progress,
    parse_enum,
    report_progress,
)
from engine.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np

    from engine.attribution.pcg import SeedStream

_SEED_BOUND = 2**63
#: The adaptive scan's defaults: runs of a step's quick look, and the most runs a step takes
#: (the settling check must plan with the schedule the scan ran with)
BATCH = 16
MAX_RUNS_PER_STEP = 4096
#: Most forward runs per step of the FIXED mode a command takes (`car attribute -K`)
MAX_FIXED_RUNS = 100_000
#: Fewest forward runs per step of the FIXED mode: below it the Wilson interval's coverage
#: falls far short of its level (79% at a nominal 95% for one run; measured by `car validate`).
MIN_FIXED_RUNS = 2


#: Where branch seeds come from: `engine.attribution.pcg.SeedStream`, or a numpy Generator
#: (the same draws for the same seed)
IntegerSource = Union["SeedStream", "np.random.Generator"]


class ContrastiveMode(StrEnum):
    """How forward runs are spent across steps."""

    FIXED = "fixed"
    ADAPTIVE = "adaptive"

    @classmethod
    def parse(cls, value: str | ContrastiveMode) -> ContrastiveMode:
        """The enum member for `value`; a typo fails loudly with the valid values."""
        return parse_enum(cls, value, "contrastive mode")


class Look(msgspec.Struct, frozen=True):
    """A point of the adaptive schedule: after n cumulative runs, an interval at level 1-alpha."""

    n: int
    alpha: float


class StepEffect(msgspec.Struct, frozen=True):
    """The estimated effect of re-deciding one step, with its interval and cost."""

    step: int
    label: str
    agent: str | None
    effect: float
    ci: tuple[float, float]
    n: int  # forward runs spent on this step
    excludes_zero: bool  # the interval lies entirely below zero: re-deciding can rescue
    level: float  # the confidence level of this particular interval (after the alpha split)
    phase: str  # "fixed", "settled" (adaptive, stopped), "minimum" (before the locus)

    @property
    def half_width(self) -> float:
        return (self.ci[1] - self.ci[0]) / 2


class ContrastiveResult(msgspec.Struct, frozen=True):
    """Per-step effects, the causal locus, and the forward runs it cost."""

    mode: str
    confidence: float
    crn: bool
    steps: tuple[StepEffect, ...]
    locus: int | None
    forward_runs: int
    target_half_width: float | None = None  # adaptive only
    all_steps: bool = True  # False: the scan stopped at the locus; earlier steps not estimated

    @property
    def locus_label(self) -> str | None:
        return None if self.locus is None else self.effect_of(self.locus).label

    def effect_of(self, step: int) -> StepEffect:
        """The estimate of `step` (KeyError when the scan stopped before reaching it)."""
        for s in self.steps:
            if s.step == step:
                return s
        raise KeyError(step)

    def ranked(self) -> list[StepEffect]:
        """Steps from the strongest rescue (most negative effect) to the weakest."""
        return sorted(self.steps, key=lambda s: (s.effect, s.step))

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready)."""
        return {
            "mode": self.mode,
            "confidence": self.confidence,
            "crn": self.crn,
            "target_half_width": self.target_half_width,
            "locus": self.locus,
            "locus_label": self.locus_label,
            "forward_runs": self.forward_runs,
            "all_steps": self.all_steps,
            "steps": [
                {
                    "step": s.step,
                    "label": s.label,
                    "agent": s.agent,
                    "effect": s.effect,
                    "ci": list(s.ci),
                    "n": s.n,
                    "excludes_zero": s.excludes_zero,
                    "level": s.level,
                    "phase": s.phase,
                }
                for s in self.steps
            ],
        }


@functools.lru_cache(maxsize=1024)
def z_value(alpha: float) -> float:
    """The two-sided normal quantile for level 1 - alpha (the standard library's: scipy's
    ndtri agrees to 1e-15 and costs ~0.3-0.9 s of every `car attribute` to import)."""
    return NormalDist().inv_cdf(1 - alpha / 2)


def wilson(bad: float, n: int, alpha: float) -> tuple[float, float]:
    """Wilson score interval for a proportion of `bad` out of `n` (no continuity correction).

    Same formula as scipy's binomtest(...).proportion_ci(method="wilson"), written out because
    the adaptive scan evaluates it at every look; the ends are pinned at 0 and 1 exactly when
    all or none of the runs were bad, so "below zero" never hinges on a rounding error.
    """
    if n <= 0:
        return (0.0, 1.0)
    z = z_value(alpha)
    z2 = z * z
    center = (bad + z2 / 2) / (n + z2)
    half = z / (n + z2) * math.sqrt(bad * (n - bad) / n + z2 / 4)
    lo = 0.0 if bad == 0 else max(0.0, center - half)
    hi = 1.0 if bad == n else min(1.0, center + half)
    return (lo, hi)


@functools.lru_cache(maxsize=64)
def adaptive_schedule(
    confidence: float, target_half_width: float, batch: int, max_runs: int
) -> tuple[Look, ...]:
    """The pre-specified looks of one adaptively scanned step; their alphas sum to 1-confidence.

    Quick look at `batch` runs (5% of alpha); settle look where a step without any rescue
    reaches the target half-width (15%); refine look where even p = 1/2 does (80%). Looks
    that coincide are merged (alphas add up); sizes are capped at `max_runs`.
    """
    alpha = 1 - confidence
    shares = [(0.05, None), (0.15, "settle"), (0.80, "refine")]
    looks: list[Look] = []
    previous = 0
    for share, kind in shares:
        a = share * alpha
        if kind is None:
            n = batch
        elif kind == "settle":
            n = _runs_for_half_width(target_half_width, a, worst_case=False)
        else:
            n = _runs_for_half_width(target_half_width, a, worst_case=True)
        n = min(max(n, previous, 1), max_runs)
        if looks and looks[-1].n == n:
            looks[-1] = Look(n=n, alpha=looks[-1].alpha + a)
        else:
            looks.append(Look(n=n, alpha=a))
        previous = n
    return tuple(looks)


@functools.lru_cache(maxsize=64)
def blind_looks(schedule: tuple[Look, ...], target_half_width: float) -> frozenset[int]:
    """The looks of `schedule` (all but its last) that cannot stop a step, whatever their runs
    show: at every count of bad runs their interval is wider than the target. The scan issues
    their runs together with the next look's, in one batch (one wait for the slowest worker
    instead of two); the step is decided at the same look on the same runs, so the answer is
    the same."""
    blind = set()
    for i, look in enumerate(schedule[:-1]):
        widths = (wilson(bad, look.n, look.alpha) for bad in range(look.n + 1))
        if all((hi - lo) / 2 > target_half_width for lo, hi in widths):
            blind.add(i)
    return frozenset(blind)


def _runs_for_half_width(target: float, alpha: float, worst_case: bool) -> int:
    """Smallest n whose Wilson interval has half-width <= target: with all n runs bad, or in
    the worst case (half of the runs bad, the widest interval)."""

    def half_width(n: int) -> float:
        bad = n // 2 if worst_case else n
        lo, hi = wilson(bad, n, alpha)
        return (hi - lo) / 2

    # Both half-widths shrink monotonically with n: double until met, then bisect.
    hi = 1
    while half_width(hi) > target:
        hi *= 2
        if hi > 1 << 30:
            raise ConfigError(f"target half-width {target!r} is out of reach")
    lo = hi // 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if half_width(mid) <= target:
            hi = mid
        else:
            lo = mid
    return hi


def contrastive(
    model: ForwardModel,
    *,
    rng: IntegerSource,
    mode: str | ContrastiveMode = ContrastiveMode.ADAPTIVE,
    k: int = 100,
    confidence: float = 0.95,
    target_half_width: float = 0.05,
    batch: int = BATCH,
    min_runs: int = 16,
    max_runs_per_step: int = MAX_RUNS_PER_STEP,
    crn: bool = True,
    all_steps: bool = False,
    progress: Progress | None = None,
) -> ContrastiveResult:
    """Estimate the point-of-commitment locus, scanning from the last step backwards; with
    `all_steps` also every step before it (FIXED: k runs each, ADAPTIVE: `min_runs` each).

    `k` is the runs per step of the FIXED mode; `target_half_width`, `batch`, `min_runs` and
    `max_runs_per_step` shape the ADAPTIVE mode. Branch seeds come from `rng`; with `crn`
    run i of every step shares one branch seed.
    """
    kind = ContrastiveMode.parse(mode)
    if not 0 < confidence < 1:
        raise ConfigError(f"confidence must lie strictly between 0 and 1, got {confidence!r}")
    n_steps = model.n_steps
    if n_steps < 1:
        raise ConfigError("the model has no steps to attribute")
    runner = _Runner(model, rng, crn, progress)
    if kind is ContrastiveMode.FIXED:
        if k < MIN_FIXED_RUNS:
            # a Wilson interval from one run covers as little as 79% at a nominal 95%
            raise ConfigError(
                f"k (forward runs per step) must be at least {MIN_FIXED_RUNS}, got {k!r}:"
                " the interval of a single run does not hold its confidence"
            )
        runner.total = n_steps * k if all_steps else None
        alpha = 1 - confidence
        fixed: dict[int, StepEffect] = {}
        for step in reversed(range(n_steps)):
            bad = runner.run(step, 0, k)
            fixed[step] = _effect(model, step, bad, k, alpha, "fixed")
            if fixed[step].excludes_zero and not all_steps:
                break
        effects = [fixed[step] for step in sorted(fixed)]
        return _result(kind, confidence, crn, effects, runner.done, None, all_steps)

    for name, value in (("batch", batch), ("min_runs", min_runs)):
        if value < 1:
            raise ConfigError(f"{name} must be at least 1, got {value!r}")
    if not 0 < target_half_width < 0.5:
        raise ConfigError(
            f"target half-width must lie strictly between 0 and 0.5, got {target_half_width!r}"
        )
    schedule = adaptive_schedule(confidence, target_half_width, batch, max_runs_per_step)
    blind = blind_looks(schedule, target_half_width)
    found: dict[int, StepEffect] = {}
    locus: int | None = None
    for step in reversed(range(n_steps)):
        if locus is not None:
            if not all_steps:
                break
            bad = runner.run(step, 0, min_runs)
            found[step] = _effect(model, step, bad, min_runs, 1 - confidence, "minimum")
            continue
        bad, n = 0, 0
        for i, look in enumerate(schedule):
            if i in blind:
                continue  # its runs go with the next look's: it cannot stop the step
            bad += runner.run(step, n, look.n - n)
            n = look.n
            effect = _effect(model, step, bad, n, look.alpha, "settled")
            if effect.half_width <= target_half_width or i == len(schedule) - 1:
                break
        found[step] = effect
        if effect.excludes_zero:
            locus = step
    effects = [found[step] for step in sorted(found)]
    return _result(kind, confidence, crn, effects, runner.done, target_half_width, all_steps)


class Settling(msgspec.Struct, frozen=True):
    """How firmly a scan's locus stands against the steps after it. The locus is the last step
    whose interval excludes zero; a later step without a rescue only settles that claim when
    its own interval excludes an effect as strong as the locus's. `not_excluded` names the
    later steps whose interval still admits it; `runs_per_step` is the forward runs each would
    need for its rescue-free interval to exclude it (None: out of reach), reached with the
    target `half_width` in the adaptive mode and with that many runs (-K) in the fixed one."""

    settled: bool
    not_excluded: tuple[int, ...] = ()
    half_width: float | None = None
    runs_per_step: int | None = None


def locus_settling(
    result: ContrastiveResult,
    *,
    batch: int = BATCH,
    max_runs_per_step: int = MAX_RUNS_PER_STEP,
    max_fixed_runs: int = MAX_FIXED_RUNS,
) -> Settling | None:
    """Whether `result`'s locus is settled against the later steps (None without a locus).
    `batch` and `max_runs_per_step` must be those the scan ran with (its adaptive schedule).
    The adaptive suggestion is the first of target, 0.9 target, ... (two digits, rounded
    down) whose rescue-free step excludes the locus's effect; out of reach once such a step
    takes `max_runs_per_step` runs."""
    if result.locus is None:
        return None
    strength = result.effect_of(result.locus).effect
    later = tuple(s.step for s in result.steps if s.step > result.locus and s.ci[0] <= strength)
    if not later:
        return Settling(settled=True)
    if result.mode == ContrastiveMode.FIXED.value:
        k = _runs_to_exclude(strength, 1 - result.confidence)
        return Settling(
            settled=False, not_excluded=later, runs_per_step=k if k <= max_fixed_runs else None
        )
    h = result.target_half_width or 0.5  # a result made by hand may not say: the widest
    while True:
        h = _round_down(h * 0.9)
        n, lower = _rescue_free(result.confidence, h, batch, max_runs_per_step)
        if lower > strength:
            return Settling(settled=False, not_excluded=later, half_width=h, runs_per_step=n)
        if n >= max_runs_per_step:  # narrower targets only add looks past the cap
            return Settling(settled=False, not_excluded=later)


#: The most scans `settle_contrastive` makes (each at the rounds-th part of the error rate).
MAX_SETTLE_ROUNDS = 8


class SettleScan(msgspec.Struct, frozen=True):
    """One scan of a settling attribution: its target half-width (adaptive) or runs a step
    (fixed), the forward runs it spent, its locus and whether that was settled (None: no
    locus)."""

    half_width: float | None
    runs_per_step: int | None
    forward_runs: int
    locus: int | None
    settled: bool | None


def settle_contrastive(
    model: ForwardModel,
    rng_of_scan: Callable[[int], IntegerSource],
    *,
    rounds: int,
    confidence: float = 0.95,
    mode: str | ContrastiveMode = ContrastiveMode.ADAPTIVE,
    k: int = 100,
    target_half_width: float = 0.05,
    all_steps: bool = False,
    progress: Progress | None = None,
) -> tuple[ContrastiveResult, tuple[SettleScan, ...]]:
    """Scan until the locus is settled against the later steps, `rounds` scans at most; the
    last scan's result and every scan's summary.

    Every scan runs at confidence 1 - (1 - `confidence`) / `rounds`, so that, by the union
    bound, the answer reported holds at `confidence` whichever scan it comes from. A later
    scan draws forward runs of its own (`rng_of_scan(i)`: scan i's seeds, independent of the
    earlier scans', on which its target was chosen) at the target the scan before suggested
    (`locus_settling`: a --half-width, or -K in the fixed mode). It stops at a scan whose locus
    is settled, that has no locus, or whose suggestion is out of reach."""
    if not 1 <= rounds <= MAX_SETTLE_ROUNDS:
        raise ConfigError(f"rounds must lie within 1..{MAX_SETTLE_ROUNDS}, got {rounds!r}")
    if not 0 < confidence < 1:
        raise ConfigError(f"confidence must lie strictly between 0 and 1, got {confidence!r}")
    each = 1 - (1 - confidence) / rounds
    kind = ContrastiveMode.parse(mode)
    spent = 0
    scans: list[SettleScan] = []

    def shifted(done: int, total: int | None) -> None:
        if progress is not None:
            progress(spent + done, None if total is None else spent + total)

    for i in range(rounds):
        result = contrastive(
            model,
            rng=rng_of_scan(i),
            mode=kind,
            k=k,
            confidence=each,
            target_half_width=target_half_width,
            all_steps=all_steps,
            progress=shifted,
        )
        spent += result.forward_runs
        settling = locus_settling(result)
        fixed = kind is ContrastiveMode.FIXED
        scans.append(
            SettleScan(
                half_width=None if fixed else target_half_width,
                runs_per_step=k if fixed else None,
                forward_runs=result.forward_runs,
                locus=result.locus,
                settled=None if settling is None else settling.settled,
            )
        )
        if settling is None or settling.settled or settling.runs_per_step is None:
            break
        if fixed:
            k = settling.runs_per_step
        elif settling.half_width is not None:
            target_half_width = settling.half_width
    return result, tuple(scans)


def _rescue_free(
    confidence: float, half_width: float, batch: int, max_runs: int
) -> tuple[int, float]:
    """Where the adaptive scan stops on a step none of whose runs is rescued (the first look
    whose interval is narrow enough, else the last): its runs and the lower end of its
    effect's interval."""
    for look in adaptive_schedule(confidence, half_width, batch, max_runs):
        lo, hi = wilson(look.n, look.n, look.alpha)
        if (hi - lo) / 2 <= half_width:
            break
    return look.n, lo - 1.0


def _runs_to_exclude(strength: float, alpha: float) -> int:
    """Fewest runs n whose rescue-free Wilson interval excludes an effect of `strength` (< 0).
    With every run bad the interval's lower end is n / (n + z^2), so the effect's is
    -z^2 / (n + z^2), above `strength` exactly when n > z^2 / -strength - z^2."""
    z2 = z_value(alpha) ** 2
    return max(math.floor(z2 / -strength - z2) + 1, MIN_FIXED_RUNS)


def _round_down(x: float) -> float:
    """`x` rounded down to two significant digits (a smaller half-width only narrows)."""
    scale = 10 ** (1 - math.floor(math.log10(x)))
    return math.floor(x * scale) / scale


class _Runner:
    """Issues the forward runs of one estimate: seeds, batching, the progress count."""

    def __init__(
        self, model: ForwardModel, rng: IntegerSource, crn: bool, progress: Progress | None
    ) -> None:
        self.model = model
        self.rng = rng
        self.crn = crn
        self.progress = progress
        self.done = 0
        self.total: int | None = None
        self.shared: list[int] = []  # branch seed of run i, shared by every step under CRN
        self.own: dict[int, list[int]] = {}  # per-step seeds without CRN

    def seeds(self, step: int, start: int, count: int) -> list[int]:
        pool = self.shared if self.crn else self.own.setdefault(step, [])
        if len(pool) < start + count:
            extra = self.rng.integers(0, _SEED_BOUND, size=start + count - len(pool))
            pool.extend(int(s) for s in extra)
        return pool[start : start + count]

    def run(self, step: int, start: int, count: int) -> int:
        """Runs start..start+count-1 of do_resample(step); returns how many ended bad."""
        if count <= 0:
            return 0
        keep = frozenset(range(step))
        requests = [
            ForwardRequest(keep=keep, branch_seed=s) for s in self.seeds(step, start, count)
        ]
        outcomes = self.model.run_batch(requests)
        if len(outcomes) != count:
            raise ConfigError(
                f"forward model returned {len(outcomes)} outcomes for {count} requests"
            )
        self.done += count
        report_progress(self.progress, self.done, self.total)
        return sum(bool(o) for o in outcomes)


def _effect(
    model: ForwardModel, step: int, bad: int, n: int, alpha: float, phase: str
) -> StepEffect:
    lo, hi = wilson(bad, n, alpha)
    return StepEffect(
        step=step,
        label=model.step_labels[step],
        agent=model.step_agents[step],
        effect=bad / n - 1.0,
        ci=(lo - 1.0, hi - 1.0),
        n=n,
        excludes_zero=hi < 1.0,
        level=1 - alpha,
        phase=phase,
    )


def _result(
    kind: ContrastiveMode,
    confidence: float,
    crn: bool,
    effects: Sequence[StepEffect],
    runs: int,
    target: float | None,
    all_steps: bool = True,
) -> ContrastiveResult:
    locus = None
    for effect in effects:
        if effect.excludes_zero:
            locus = effect.step
    return ContrastiveResult(
        mode=kind.value,
        confidence=confidence,
        crn=crn,
        steps=tuple(effects),
        locus=locus,
        forward_runs=runs,
        target_half_width=target,
        all_steps=all_steps,
    )
