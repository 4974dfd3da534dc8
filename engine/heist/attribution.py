"""Attribution of a recorded heist: run an estimator over HeistForwardModel, rank the steps
(or agents) with the message each step said, and report the forward runs spent."""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.attribution.base import PlayersKind, Progress
from engine.attribution.contrastive import ContrastiveMode, contrastive
from engine.attribution.shapley import shapley
from engine.errors import ConfigError
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
    with HeistForwardModel(journal, run_id, concurrency=concurrency, reuse=reuse) as model:
        out = _attribute(model, method, kind, k, budget, seed, half_width, all_steps, progress)
    out["branches_added"] = model.created
    out["branches_reused"] = model.reused
    return out


def _attribute(
    model: HeistForwardModel,
    method: str,
    kind: PlayersKind,
    k: int | None,
    budget: int,
    seed: int,
    half_width: float,
    all_steps: bool,
    progress: Progress | None,
) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {"run_id": model.parent.run_id, "method": method, "seed": seed}
    if method == "contrastive":
        res = contrastive(
            model,
            rng=rng,
            mode=ContrastiveMode.FIXED if k is not None else ContrastiveMode.ADAPTIVE,
            k=k or 100,
            target_half_width=half_width,
            all_steps=all_steps,
            progress=progress,
        )
        data = res.to_dict()
        rows = [
            {
                "step": s["step"],
                "agent": s["agent"],
                "message": model.message(s["step"]),
                "effect": s["effect"],
                "ci": s["ci"],
                "n": s["n"],
                "rescues": s["excludes_zero"],
            }
            for s in sorted(data["steps"], key=lambda s: (s["effect"], s["step"]))
        ]
        out.update(
            {
                "mode": data["mode"],
                "locus": data["locus"],
                "locus_agent": None if data["locus"] is None else model.step_agents[data["locus"]],
                "locus_message": None if data["locus"] is None else model.message(data["locus"]),
                "ranked": rows,
                "forward_runs": data["forward_runs"],
                "all_steps": data["all_steps"],
                "first_estimated": min((s["step"] for s in data["steps"]), default=None),
                "detail": data,
            }
        )
        return out
    res_s = shapley(model, rng=rng, players=kind, budget=budget, progress=progress)
    data = res_s.to_dict()
    rows = []
    for v in sorted(data["values"], key=lambda v: -v["phi"]):
        first = v["steps"][0]
        rows.append(
            {
                "player": v["player"],
                "steps": v["steps"],
                "agent": model.step_agents[first],
                "message": model.message(first) if kind is PlayersKind.STEPS else None,
                "phi": v["phi"],
                "ci": v["ci"],
            }
        )
    out.update(
        {
            "players": kind.value,
            "ranked": rows,
            "efficiency": data["efficiency"],
            "permutations": data["permutations"],
            "partial": data["partial"],
            "forward_runs": data["forward_runs"],
            "budget": budget,
            "detail": data,
        }
    )
    return out
