"""Attribution results as plain data, for any scenario's forward model: the ranked steps (or
players) with their intervals, in the one shape the CLI prints and `--json` emits."""

from __future__ import annotations

import hashlib
from typing import Any, Protocol

import msgspec

from engine.attribution.base import ForwardModel, PlayersKind, Progress
from engine.attribution.contrastive import (
    ContrastiveMode,
    Settling,
    locus_settling,
    settle_contrastive,
)
from engine.attribution.pcg import SeedStream
from engine.errors import ConfigError


class ReportedModel(ForwardModel, Protocol):
    """A forward model that can also name each step's agent and message for the report."""

    def message(self, k: int) -> str:
        """The text the acting agent sent at step k (shown beside its effect)."""
        ...


def attribution_report(
    model: ReportedModel,
    run_id: str,
    method: str,
    kind: PlayersKind,
    k: int | None,
    budget: int,
    seed: int,
    half_width: float,
    all_steps: bool,
    progress: Progress | None,
    settle: int = 1,
) -> dict[str, Any]:
    """The attribution of one run as plain data (what the CLI prints and `--json` emits):
    contrastive effects per step with the locus, or Shapley values per player. `settle`:
    contrastive scans at most until the locus is settled (`settle_contrastive`; 1: one scan
    at 95%)."""
    if not 0 <= seed < 2**63:
        raise ConfigError(f"seed must lie within 0..{2**63 - 1}, got {seed!r}")
    if settle != 1 and method != "contrastive":
        raise ConfigError("settling applies to the contrastive method only")
    out: dict[str, Any] = {"run_id": run_id, "method": method, "seed": seed}
    if method == "contrastive":
        res, scans = settle_contrastive(
            model,
            # np.random.default_rng(seed)'s draws, without importing numpy; a later scan's
            # from a seed of its own
            lambda i: SeedStream(seed if i == 0 else scan_seed(seed, i)),
            rounds=settle,
            mode=ContrastiveMode.FIXED if k is not None else ContrastiveMode.ADAPTIVE,
            k=k or 100,
            target_half_width=half_width,
            all_steps=all_steps,
            progress=progress,
        )
        data = res.to_dict()
        settling = locus_settling(res)
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
                # every scan's, when settling made more than one
                "forward_runs": sum(s.forward_runs for s in scans),
                "all_steps": data["all_steps"],
                "first_estimated": min((s["step"] for s in data["steps"]), default=None),
                # whether every later step's interval excludes an effect as strong as the
                # locus's (None: no locus); the later steps that do not, and what would settle
                # them: a --half-width (adaptive) or -K (fixed), with the runs per step it takes
                "locus_settled": None if settling is None else settling.settled,
                "not_excluded": [] if settling is None else list(settling.not_excluded),
                "to_settle": _to_settle(settling),
                "detail": data,
            }
        )
        if settle > 1:
            out["settle"] = {
                "rounds": settle,
                "confidence": 0.95,
                "confidence_each": data["confidence"],
                "scans": [msgspec.to_builtins(s) for s in scans],
            }
        return out
    import numpy as np

    from engine.attribution.shapley import shapley

    rng = np.random.default_rng(seed)
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


def scan_seed(seed: int, scan: int) -> int:
    """The forward-run seed of a settling attribution's scan `scan` >= 1 (scan 0 draws from
    `seed` itself): 63 bits of a hash, a stream of its own."""
    h = hashlib.blake2b(f"settle:{seed}:{scan}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") >> 1


def _to_settle(settling: Settling | None) -> dict[str, Any] | None:
    """What would settle an unsettled locus, as plain data (None when settled or out of reach)."""
    if settling is None or settling.settled or settling.runs_per_step is None:
        return None
    if settling.half_width is not None:
        return {"half_width": settling.half_width, "runs_per_step": settling.runs_per_step}
    return {"runs": settling.runs_per_step, "runs_per_step": settling.runs_per_step}
