"""Branches of any scenario: forks and the attribution estimators' forward runs, through the
Scenario protocol (engine.scenario), and what the core's step loop gives a stepped scenario.

`fork` and `attribute` are what `car fork`, `car attribute` and the server call: they look the
run's scenario up and hand the work to its `fork` / `forward_model`, so the heist and a recorded
program are forked and attributed by one path. `SteppedForks` is the implementation of those two
members for a scenario the core's loop drives (the heist): each branch is forked at s_k, the
intervention applied, and the loop runs it to its end (engine.interventions).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from engine.errors import ConfigError, EngineError, InterventionError
from engine.executors.base import ExecutorOptions
from engine.interventions import (
    BranchRunner,
    BranchSpec,
    DoResample,
    ForkReport,
    Intervention,
    ParentInfo,
    check_override,
    fork_many,
    parent_info,
)
from engine.journal import Journal
from engine.scenario import ClosingForwardModel, Progress, Rerun, scenario_of_run

METHODS = ("contrastive", "shapley")


def fork(
    journal: Journal,
    run_id: str,
    iv: Intervention,
    n: int,
    *,
    seed: int = 0,
    rerun: Rerun | None = None,
    progress: Progress | None = None,
) -> ForkReport:
    """N branches of one intervention on run `run_id`, whatever its scenario."""
    scenario = scenario_of_run(journal, run_id)
    return scenario.fork(
        journal, run_id, iv, n, seed=seed, rerun=rerun or Rerun(), progress=progress
    )


def attribute(
    journal: Journal,
    run_id: str,
    *,
    method: str,
    players: str = "steps",
    k: int | None = None,
    budget: int = 2000,
    seed: int = 0,
    half_width: float = 0.1,
    all_steps: bool = False,
    rerun: Rerun | None = None,
    progress: Progress | None = None,
    settle: int = 1,
) -> dict[str, Any]:
    """Attribute failed run `run_id` to its steps (or agents), whatever its scenario; plain
    data for the CLI and the server. `settle`: contrastive scans at most until the locus is
    settled (engine/attribution/contrastive.py, `settle_contrastive`).

    One forward model (and its workers) serves the whole attribution; with `rerun.reuse` (the
    default) forward runs that an earlier attribution of this run with the same seed already
    made are read back from their branches instead of adding new ones."""
    from engine.attribution.base import PlayersKind
    from engine.attribution.report import attribution_report

    if method not in METHODS:
        raise ConfigError(f"unknown method {method!r}; expected one of: {', '.join(METHODS)}")
    if method == "contrastive" and players != "steps":
        raise ConfigError("--players applies to --method shapley only")
    kind = PlayersKind.parse(players)
    scenario = scenario_of_run(journal, run_id)
    with scenario.forward_model(journal, run_id, rerun or Rerun()) as model:
        out = attribution_report(
            model,
            journal.run(run_id).run_id,
            method,
            kind,
            k,
            budget,
            seed,
            half_width,
            all_steps,
            progress,
            settle,
        )
        stats = model.executor_stats()
    out["branches_added"] = model.created
    out["branches_reused"] = model.reused
    if stats is not None:
        # a forward run that failed (on Ray: lost twice with its worker) ended the command
        # with an error, so what is reported was run in full
        out["executor"] = stats
    return out


def refuse_command(scenario: str, rerun: Rerun) -> None:
    """A stepped scenario re-runs from the journal alone: a program command is a mistake."""
    if rerun.command:
        raise ConfigError(
            f"this is a {scenario!r} run, not a recorded program; `-- CMD` is only for runs "
            "made by car record"
        )


class SteppedForks:
    """`Scenario.fork` and `Scenario.forward_model` for a scenario the core's step loop drives:
    a base class of such scenarios (the heist's HeistScenario is one)."""

    name: str

    def fork(
        self,
        journal: Journal,
        run_id: str,
        iv: Intervention,
        n: int,
        *,
        seed: int = 0,
        rerun: Rerun = Rerun(),
        progress: Progress | None = None,
    ) -> ForkReport:
        refuse_command(self.name, rerun)
        return fork_many(
            journal,
            run_id,
            iv,
            n,
            seed=seed,
            concurrency=rerun.concurrency,
            progress=progress,
            policy_override=rerun.policy_override,
            executor=rerun.executor,
        )

    def forward_model(
        self,
        journal: Journal,
        run_id: str,
        rerun: Rerun = Rerun(),
    ) -> ClosingForwardModel:
        refuse_command(self.name, rerun)
        parent = parent_info(journal, run_id)
        override = rerun.policy_override
        if override:
            # --base-url etc. checked before any branch runs, against the policy in force at
            # every step a forward run may fork at: the recorded one, or after a do_policy in
            # the run's own history (a branch's), the policy it swapped in; they go to the
            # branches whose policy takes them, refused when none does
            override = check_override(journal, parent, override, where_taken=True)
        return BranchForwardModel(
            journal,
            run_id,
            concurrency=rerun.concurrency,
            policy_override=override,
            reuse=rerun.reuse,
            executor=rerun.executor,
            parent=parent,
        )


class BranchForwardModel:
    """Forward runs of one recorded, failed run of a stepped scenario, each a journaled branch.

    Request (keep S, branch seed b): fork the run at the first step k0 not in S (the prefix
    before k0 is shared with the parent, never copied), re-decide k0 with do_resample, force
    the recorded action at every later step of S (do_action), and let the policy re-decide the
    rest with seeds drawn from (b, j). The branch's scored outcome is the answer.

    One branch runner serves every batch (its worker pool lives as long as the model; close it
    or use the model as a context manager). Branches are named by a deterministic key, so the
    same request (keep set, branch seed) made again, in this command or a later one, reads the
    earlier branch's outcome back instead of adding a branch (`reuse=False` always runs)."""

    def __init__(
        self,
        journal: Journal,
        run_id: str,
        *,
        concurrency: int = 1,
        policy_override: dict[str, Any] | None = None,
        reuse: bool = True,
        executor: ExecutorOptions | None = None,
        parent: ParentInfo | None = None,
    ) -> None:
        """`parent`: the run's ParentInfo when the caller has read it already."""
        self.parent: ParentInfo = parent or parent_info(journal, run_id)
        if self.parent.status != "completed":
            raise InterventionError(
                f"run {self.parent.run_id!r} is {self.parent.status}; attribution needs a "
                "completed run"
            )
        if not self.parent.outcome.get("bad"):
            raise InterventionError(
                f"run {self.parent.run_id!r} did not fail (its outcome is ok); attribution "
                "explains a bad outcome"
            )
        self._agents = [self.parent.agents.get(k) for k in range(self.parent.steps)]
        self.forward_runs = 0
        self.runner = BranchRunner(
            journal,
            self.parent,
            concurrency=concurrency,
            policy_override=policy_override,
            reuse=reuse,
            executor=executor,
        )

    def __enter__(self) -> BranchForwardModel:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        self.runner.close(interrupted=exc_type is not None)

    def close(self) -> None:
        self.runner.close()

    @property
    def run_id(self) -> str:
        return self.parent.run_id

    @property
    def reused(self) -> int:
        return self.runner.reused

    @property
    def created(self) -> int:
        return self.runner.created

    def executor_stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = msgspec.to_builtins(self.runner.executor.stats())
        return stats

    @property
    def n_steps(self) -> int:
        return self.parent.steps

    @property
    def step_agents(self) -> Sequence[str | None]:
        return self._agents

    @property
    def step_labels(self) -> Sequence[str]:
        return [f"{k}:{a}" for k, a in enumerate(self._agents)]

    def message(self, k: int) -> str:
        return self.parent.actions.get(k, "")

    def run_batch(self, requests: Sequence[Any]) -> list[bool]:
        results: list[bool | None] = [None] * len(requests)
        specs: list[BranchSpec] = []
        where: list[int] = []
        for i, req in enumerate(requests):
            free = [j for j in range(self.n_steps) if j not in req.keep]
            if not free:
                # every step factual: the recorded run itself, whose outcome is deterministic
                results[i] = bool(self.parent.outcome.get("bad"))
                continue
            k0 = free[0]
            keep = {j: self.parent.actions[j] for j in req.keep if j > k0}
            specs.append(BranchSpec(DoResample(k0), req.branch_seed, keep or None))
            where.append(i)
        branches = self.runner.run(specs)
        self.forward_runs += len(branches)
        for i, b in zip(where, branches, strict=True):
            if b.bad is None:
                raise EngineError(f"a forward run failed ({b.status}): {b.error}")
            results[i] = b.bad
        return [bool(r) for r in results]


__all__ = ["METHODS", "BranchForwardModel", "SteppedForks", "attribute", "fork"]
