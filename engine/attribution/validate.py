"""Validation of the estimators against SCMs with exact ground truth.

Any attribution method must first recover what is known: for each SCM both estimators run
exactly as they would on a recorded run (only through the ForwardModel protocol), and their
answers are set against exact values from enumeration.

The check is a test with a stated error rate, not "every interval happened to cover": each
interval misses its exact value with a small probability even for a correct estimator, and a
dozen of them at 95% each miss together about half the time. So the intervals of one
validation form a family with a family-wise error rate alpha (default 5%), split by Bonferroni:
with m intervals (every step's contrastive effect and every player's Shapley value of every
model, counted before any run), each is computed at level 1 - alpha/m. A correct estimator
then passes with probability >= 1 - alpha, and a miss is evidence against the estimator at
that level. The locus is reported beside it (it can only be missed for lack of power: a step
whose interval covers its exact effect but shows no rescue).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from engine.attribution.base import PlayersKind, Progress, players_of
from engine.attribution.contrastive import ContrastiveMode, ContrastiveResult, contrastive
from engine.attribution.scm import EXACT_TOLERANCE, SCM
from engine.attribution.shapley import ShapleyResult, shapley
from engine.errors import ConfigError
from engine.terminal import printable


class EffectCheck(msgspec.Struct, frozen=True):
    """One step's estimated contrastive effect next to the exact one."""

    step: int
    label: str
    effect: float
    ci: tuple[float, float]
    n: int
    exact: float
    covered: bool
    excludes_zero: bool


class ShapleyCheck(msgspec.Struct, frozen=True):
    """One player's estimated Shapley value next to the exact one."""

    player: str
    phi: float
    ci: tuple[float, float]
    exact: float
    covered: bool


class ValidationReport(msgspec.Struct, frozen=True):
    """Both estimators on one SCM, against its exact ground truth."""

    scm: str
    description: str
    players: str
    mode: str
    seed: int
    locus_estimated: int | None
    locus_exact: int | None
    locus_estimated_label: str | None
    locus_exact_label: str | None
    contrastive: tuple[EffectCheck, ...]
    shapley: tuple[ShapleyCheck, ...]
    efficiency_estimated: float  # sum of the estimated phi
    efficiency_exact: float  # v(all) - v(none), exact
    efficiency_runs_estimate: float  # v(all) - v(none) from the separate forward runs
    contrastive_runs: int
    shapley_runs: int
    permutations: int
    partial: bool
    ok: bool  # every interval of this model covers its exact value
    level: float = 0.95  # the confidence level of each interval (after the Bonferroni split)

    @property
    def forward_runs(self) -> int:
        return self.contrastive_runs + self.shapley_runs

    @property
    def locus_ok(self) -> bool:
        return self.locus_estimated == self.locus_exact

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready)."""
        return {
            "scm": self.scm,
            "description": self.description,
            "players": self.players,
            "mode": self.mode,
            "seed": self.seed,
            "locus": {
                "estimated": self.locus_estimated,
                "exact": self.locus_exact,
                "estimated_label": self.locus_estimated_label,
                "exact_label": self.locus_exact_label,
                "ok": self.locus_ok,
            },
            "shapley": [
                {
                    "player": c.player,
                    "phi": c.phi,
                    "ci": list(c.ci),
                    "exact": c.exact,
                    "covered": c.covered,
                }
                for c in self.shapley
            ],
            "efficiency": {
                "estimated": self.efficiency_estimated,
                "exact": self.efficiency_exact,
                "forward_runs_estimate": self.efficiency_runs_estimate,
            },
            "forward_runs": self.forward_runs,
            "contrastive_runs": self.contrastive_runs,
            "shapley_runs": self.shapley_runs,
            "permutations": self.permutations,
            "partial": self.partial,
            "level": self.level,
            "contrastive": [
                {
                    "step": c.step,
                    "label": c.label,
                    "effect": c.effect,
                    "ci": list(c.ci),
                    "n": c.n,
                    "exact": c.exact,
                    "covered": c.covered,
                    "excludes_zero": c.excludes_zero,
                }
                for c in self.contrastive
            ],
            "ok": self.ok,
            "locus_ok": self.locus_ok,
        }


def covers(ci: tuple[float, float], exact: float) -> bool:
    """Whether `exact` lies in `ci`, forgiving the enumeration's floating-point noise."""
    return ci[0] - EXACT_TOLERANCE <= exact <= ci[1] + EXACT_TOLERANCE


def model_rng(seed: int, model: SCM) -> tuple[np.random.Generator, np.random.Generator]:
    """Independent generators for the two estimators, keyed by the seed and the model's name,
    so that a model gives the same answer whichever other models are validated with it."""
    contrast, shap = np.random.SeedSequence([seed, zlib.crc32(model.name.encode())]).spawn(2)
    return np.random.default_rng(contrast), np.random.default_rng(shap)


class AlphaError(ConfigError):
    """A family-wise alpha that no validation can use."""


class FamilyRule(msgspec.Struct, frozen=True):
    """The error rule of one validation: m intervals, each at `level`, family-wise `alpha`."""

    alpha: float
    intervals: int
    level: float

    def describe(self) -> str:
        return (
            f"check: every exact value inside its interval; Bonferroni over {self.intervals} "
            f"intervals, each at {100 * self.level:.3f}%, so that a correct estimator passes "
            f"with probability >= {100 * (1 - self.alpha):.0f}%"
        )


def family_rule(
    models: Sequence[SCM], players: str | PlayersKind, alpha: float = 0.05
) -> FamilyRule:
    """Bonferroni over every interval the validation can report, counted before any run."""
    if not 0 < alpha < 1:
        raise AlphaError(f"family-wise alpha must lie strictly between 0 and 1, got {alpha!r}")
    _distinct_names(models)
    kind = PlayersKind.parse(players)
    m = sum(model.n_steps + len(players_of(model, kind)) for model in models)
    level = 1 - alpha / max(m, 1)
    if not level < 1:
        raise AlphaError(
            f"family-wise alpha {alpha!r} split over {m} intervals leaves each interval at "
            "a level that rounds to 1 (intervals of no error at all); give a larger alpha"
        )
    return FamilyRule(alpha=alpha, intervals=m, level=level)


def _distinct_names(models: Sequence[SCM]) -> None:
    """Reports, seeds and the exit message name a model by its name: two alike are refused."""
    sources: dict[str, str] = {}
    for model in models:
        if model.name in sources:
            first = printable(sources[model.name])
            again = printable(model.source)
            raise ConfigError(
                f"two models are named {model.name!r} ({first} and {again}); the models of one "
                "validation need distinct names (rename one, or leave out the built-ins with "
                "--no-builtin)"
            )
        sources[model.name] = model.source


def validate(
    models: Sequence[SCM],
    seed: int,
    k: int | None = None,
    budget: int = 4000,
    *,
    players: str | PlayersKind = PlayersKind.STEPS,
    alpha: float = 0.05,
    target_half_width: float = 0.05,
    crn: bool = True,
    all_steps: bool = False,
    progress: Progress | None = None,
) -> list[ValidationReport]:
    """Run both estimators on each model and compare them with exact ground truth.

    `k` set: the paper's fixed-K contrastive estimator with k runs per step; `k` None: the
    adaptive one with intervals of half-width `target_half_width`. `budget` caps the Shapley
    estimator's forward runs (it uses as many permutations as fit). Every interval is at the
    Bonferroni level of `family_rule(models, players, alpha)`. `progress` receives the
    forward runs done across all models (total None).
    """
    kind = PlayersKind.parse(players)
    mode = ContrastiveMode.ADAPTIVE if k is None else ContrastiveMode.FIXED
    if not 0 <= seed < 2**63:
        raise ConfigError(f"seed must lie within 0..{2**63 - 1}, got {seed!r}")
    confidence = family_rule(models, kind, alpha).level
    for model in models:
        # what cannot be checked is refused before any forward run, not after them all
        model.require_exact(kind)
    reports = []
    offset = 0
    for model in models:
        base = offset

        def step_progress(done: int, total: int | None, base: int = base) -> None:
            if progress is not None:
                progress(base + done, None)

        contrast_rng, shapley_rng = model_rng(seed, model)
        contrast = contrastive(
            model,
            rng=contrast_rng,
            mode=mode,
            k=k if k is not None else 100,
            confidence=confidence,
            target_half_width=target_half_width,
            crn=crn,
            all_steps=all_steps,
            progress=step_progress,
        )
        offset += contrast.forward_runs
        base = offset

        def shap_progress(done: int, total: int | None, base: int = base) -> None:
            if progress is not None:
                progress(base + done, None)

        shap = shapley(
            model,
            rng=shapley_rng,
            players=kind,
            budget=budget,
            confidence=confidence,
            crn=crn,
            progress=shap_progress,
        )
        offset += shap.forward_runs
        reports.append(_report(model, seed, kind, contrast, shap, confidence))
    return reports


def _report(
    model: SCM,
    seed: int,
    kind: PlayersKind,
    contrast: ContrastiveResult,
    shap: ShapleyResult,
    level: float,
) -> ValidationReport:
    exact_effects = model.exact_effects()
    exact_locus = model.exact_locus()
    exact_phi = model.exact_shapley(kind)
    effects = tuple(
        EffectCheck(
            step=s.step,
            label=s.label,
            effect=s.effect,
            ci=s.ci,
            n=s.n,
            exact=exact_effects[s.step],
            covered=covers(s.ci, exact_effects[s.step]),
            excludes_zero=s.excludes_zero,
        )
        for s in contrast.steps
    )
    checks = tuple(
        ShapleyCheck(
            player=v.player,
            phi=v.phi,
            ci=v.ci,
            exact=exact_phi[v.player],
            covered=covers(v.ci, exact_phi[v.player]),
        )
        for v in shap.values
    )
    labels = list(model.step_labels)
    return ValidationReport(
        scm=model.name,
        description=model.description,
        players=kind.value,
        mode=contrast.mode,
        seed=seed,
        locus_estimated=contrast.locus,
        locus_exact=exact_locus,
        locus_estimated_label=None if contrast.locus is None else labels[contrast.locus],
        locus_exact_label=None if exact_locus is None else labels[exact_locus],
        contrastive=effects,
        shapley=checks,
        efficiency_estimated=shap.efficiency.sum_phi,
        efficiency_exact=model.exact_efficiency(),
        efficiency_runs_estimate=shap.efficiency.difference,
        contrastive_runs=contrast.forward_runs,
        shapley_runs=shap.forward_runs,
        permutations=shap.permutations,
        partial=shap.partial,
        ok=all(c.covered for c in checks) and all(c.covered for c in effects),
        level=level,
    )
