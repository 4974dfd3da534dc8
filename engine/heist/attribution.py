"""Attribution of a recorded heist: run an estimator over HeistForwardModel, rank the steps
(or agents) with the message each step said, and report the forward runs spent."""

from __future__ import annotations

from typing import Any

import msgspec

from engine.attribution.base import PlayersKind, Progress
from engine.attribution.report import attribution_report
from engine.errors import ConfigError
from engine.executors.base import ExecutorOptions
from engine.heist.forward_model import HeistForwardModel
from engine.journal import Journal

METHODS = ("contrastive", "shapley")


def attribute_run(
    journal: Journal,
    run_id: str,
    *,
    method: str,
    players: str = "steps",
    k: int | None = None,
    budget: int = 2000,
    seed: int = 0,
    concurrency: int = 1,
    half_width: float = 0.1,
    all_steps: bool = False,
    reuse: bool = True,
    progress: Progress | None = None,
    executor: ExecutorOptions | None = None,
) -> dict[str, Any]:
    """Attribute a failed heist to its steps (or agents); plain data for the CLI.

    One worker pool serves the whole attribution; with `reuse` (the default) forward runs
    that an earlier attribution of this run with the same seed already made are read back
    from their branches instead of adding new ones."""
    if method not in METHODS:
        raise ConfigError(f"unknown method {method!r}; expected one of: {', '.join(METHODS)}")
    if method == "contrastive" and players != "steps":
        raise ConfigError("--players applies to --method shapley only")
    kind = PlayersKind.parse(players)
    with HeistForwardModel(
        journal, run_id, concurrency=concurrency, reuse=reuse, executor=executor
    ) as model:
        out = attribution_report(
            model,
            model.parent.run_id,
            method,
            kind,
            k,
            budget,
            seed,
            half_width,
            all_steps,
            progress,
        )
        stats = model.runner.executor.stats()
    out["branches_added"] = model.created
    out["branches_reused"] = model.reused
    # forward runs re-run after their worker was lost, and those lost twice (not scored)
    out["executor"] = msgspec.to_builtins(stats)
    out["forward_runs_failed"] = stats.lost
    return out
