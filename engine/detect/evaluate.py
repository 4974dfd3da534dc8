"""`car detect-eval`: how often each method names the mole, measured on recorded games.

Records N heists (or takes existing runs), runs every method asked for on each, and compares
the suggestion with the truth. The truth is the reveal — the run's secret event — read here and
only here, after the method has answered; the methods never see it.

Reported per method, overall and per strategy: top-1 accuracy with a 95% Wilson interval next
to the random baseline 1/#agents, AUROC of the per-agent scores (mole vs the others), Brier
score and a reliability table of `confidence`, a confusion table (true mole x suggested), and
forward runs and seconds per game.

Game i of `--seed S` has root seed S + i. The shipped calibration was fitted on seeds from
1,000,000,000 on (engine/detect/calibration.yaml), so evaluations with S + N below that never
score games the calibration saw.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine import events as ev
from engine.detect.analysis import METHODS, DetectError, analyze
from engine.detect.stats import auroc, wilson
from engine.errors import ConfigError
from engine.journal import Journal

RELIABILITY_BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
CALIBRATION_SEED_BASE = 1_000_000_000


@dataclass(frozen=True)
class Truth:
    mole: str
    strategy: str


def truth(journal: Journal, run_id: str) -> Truth | None:
    """The reveal of a run (its secret event), for scoring only; None for a game without a
    mole."""
    for stored in journal.read(run_id, 0, 4):
        if stored.kind in ev.SECRET_KINDS:
            e = stored.event
            if isinstance(e, ev.MoleAssigned):
                return None if e.none else Truth(e.agent, e.strategy)
    return None


def check_methods(methods: Sequence[str]) -> list[str]:
    """The methods asked for, each once, in order; an unknown one is a DetectError."""
    for m in methods:
        if m not in METHODS:
            raise DetectError(
                f"unknown detection method {m!r}; expected one of: " + ", ".join(METHODS)
            )
    return list(dict.fromkeys(methods))


RECORDED_LABEL = "detect-eval"  # the label of the games record_games plays


def unrevealed(journal: Journal, runs: Sequence[str]) -> list[str]:
    """The runs whose game nobody has revealed: neither accused (`car accuse` journals the
    verdict as the game's last event) nor recorded by an evaluation for scoring. Scoring such a
    run would show its mole (the confusion table, the per-strategy rows, hit or miss) through
    a command that is not the reveal. Decided without reading any secret event, so the answer
    is the same for a game with a mole and one without."""
    hidden = []
    for rid in runs:
        root = journal.run(journal.run(rid).root_run_id)
        if root.label == RECORDED_LABEL:
            continue
        last = journal.last_event(root.run_id)
        if last is None or last.kind != "suspicion_declared":
            hidden.append(rid)
    return hidden


@dataclass
class Game:
    run_id: str
    agents: list[str]
    truth: Truth
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


def record_games(
    journal: Journal,
    n: int,
    *,
    seed: int,
    policy: Any,
    config_path: str | Path | None = None,
    rounds: int | None = None,
    server: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    failures: list[str] | None = None,
) -> list[str]:
    """Record n heists with seeds seed .. seed + n - 1; the ids of those that completed.

    A game that fails (an LLM server error, say) is closed in the journal and left out; its
    seed and error go to `failures` when given, else the evaluation stops with the error."""
    from engine.heist.session import DEFAULT_ROUNDS, record_heist
    from engine.runtime.record import MAX_SEED

    if n > 0 and not 0 <= seed <= MAX_SEED - (n - 1):
        # checked before the first game: the last one's seed would be refused mid-evaluation
        raise ConfigError(
            f"root seeds {seed}..{seed + n - 1} of {n} games must lie within 0..{MAX_SEED}"
        )
    runs = []
    for i in range(n):
        r = record_heist(
            journal,
            policy,
            seed=seed + i,
            rounds=rounds or DEFAULT_ROUNDS,
            config_path=config_path,
            server=server,
            label=RECORDED_LABEL,  # never the seed: the seed names the mole
        )
        if r.status != "completed":
            if failures is None:
                raise DetectError(f"recording game seed {seed + i} ended {r.status}: {r.error}")
            failures.append(f"seed {seed + i}: {r.status}: {r.error}")
        else:
            runs.append(r.run_id)
        if progress is not None:
            progress(i + 1, n)
    return runs


def evaluate(
    journal: Journal,
    runs: Sequence[str],
    methods: Sequence[str],
    *,
    base_url: str | None = None,
    model: str | None = None,
    options: dict[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Run `methods` on `runs` and score them against the reveal."""
    methods = check_methods(methods)
    if len(set(runs)) != len(runs):
        twice = next(r for r in runs if runs.count(r) > 1)
        raise DetectError(f"run {twice!r} is given twice: a game is scored once")
    truths = {rid: truth(journal, rid) for rid in runs}
    if runs and all(t is None for t in truths.values()):
        # nothing to score against: an empty report would read as a result
        which = "the run given has no" if len(runs) == 1 else f"none of the {len(runs)} runs has a"
        raise DetectError(
            f"{which} mole to evaluate against (recorded with --no-mole, or not a heist)"
        )
    games: list[Game] = []
    skipped: list[str] = []
    total = len(runs) * len(methods)
    done = 0
    for rid in runs:
        t = truths[rid]
        if t is None:
            skipped.append(rid)
            done += len(methods)
            continue
        g: Game | None = None
        for m in methods:
            t0 = time.perf_counter()
            # the scorer knows each game's truth (`truths`): a method that reads what only the
            # reveal may (replay's recorded seeds) tells it nothing new
            out = analyze(
                journal, rid, method=m, base_url=base_url, model=model, reveal=True,
                **(options or {}),
            )  # fmt: skip
            if g is None:
                g = Game(out["session_id"], list(out["suspicion_scores"]), t)
            g.results[m] = out
            g.seconds[m] = time.perf_counter() - t0
            done += 1
            if progress is not None:
                progress(done, total)
        if g is not None:
            games.append(g)
    return {
        "games": len(games),
        "skipped_without_mole": skipped,
        "methods": {m: summarize(games, m) for m in methods},
    }


def _accuracy(hits: int, n: int) -> dict[str, Any]:
    lo, hi = wilson(hits, n)
    return {
        "n": n,
        "hits": hits,
        "accuracy": round(hits / n, 4) if n else None,
        "ci95": [round(lo, 4), round(hi, 4)],
    }


def summarize(games: Sequence[Game], method: str) -> dict[str, Any]:
    """Accuracy (overall and per strategy), AUROC, Brier, reliability, confusion, cost."""
    hits = [g.results[method]["suggested_mole"] == g.truth.mole for g in games]
    confs = [float(g.results[method]["confidence"]) for g in games]
    baseline = (sum(1 / len(g.agents) for g in games) / len(games)) if games else None
    out: dict[str, Any] = {
        **_accuracy(sum(hits), len(games)),
        "random_baseline": None if baseline is None else round(baseline, 4),
        "auroc": _auroc(games, method),
        "brier": round(sum((c - h) ** 2 for c, h in zip(confs, hits, strict=True)) / len(games), 4)
        if games
        else None,
        "reliability": _reliability(confs, hits),
        "confusion": _confusion(games, method),
        "forward_runs_per_game": round(
            sum(int(g.results[method].get("forward_runs", 0)) for g in games) / len(games), 2
        )
        if games
        else 0,
        "seconds_per_game": round(sum(g.seconds[method] for g in games) / len(games), 4)
        if games
        else 0,
        "degraded": sum(
            1
            for g in games
            if method in ("llm", "rules+llm") and "llm" not in g.results[method]["methods_run"]
        ),
        "calibrated": all(g.results[method].get("confidence_calibrated") for g in games),
    }
    by: dict[str, list[Game]] = {}
    for g in games:
        by.setdefault(g.truth.strategy, []).append(g)
    out["per_strategy"] = {
        s: {
            **_accuracy(
                sum(x.results[method]["suggested_mole"] == x.truth.mole for x in gs), len(gs)
            ),
            "auroc": _auroc(gs, method),
        }
        for s, gs in sorted(by.items())
    }
    return out


def _auroc(games: Sequence[Game], method: str) -> float | None:
    pos: list[float] = []
    neg: list[float] = []
    for g in games:
        for a, s in g.results[method]["suspicion_scores"].items():
            (pos if a == g.truth.mole else neg).append(float(s))
    v = auroc(pos, neg)
    return None if v is None else round(v, 4)


def _reliability(confs: Sequence[float], hits: Sequence[bool]) -> list[dict[str, Any]]:
    rows = []
    edges = RELIABILITY_BINS
    for i in range(len(edges) - 1):
        lo, hi = edges[i], edges[i + 1]
        idx = [j for j, c in enumerate(confs) if lo <= c < hi or (hi == 1.0 and c == 1.0)]
        rows.append(
            {
                "bin": f"{lo:.1f}-{hi:.1f}",
                "games": len(idx),
                "mean_confidence": round(sum(confs[j] for j in idx) / len(idx), 4) if idx else None,
                "accuracy": round(sum(hits[j] for j in idx) / len(idx), 4) if idx else None,
            }
        )
    return rows


def _confusion(games: Sequence[Game], method: str) -> dict[str, dict[str, int]]:
    table: dict[str, dict[str, int]] = {}
    for g in games:
        row = table.setdefault(g.truth.mole, {})
        s = g.results[method]["suggested_mole"]
        row[s] = row.get(s, 0) + 1
    return table
