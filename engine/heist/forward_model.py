"""A recorded heist as a ForwardModel: every forward run is a real journaled branch.

Request (keep S, branch seed b): fork the run at the first step k0 not in S (the prefix before
k0 is shared with the parent, never copied), re-decide k0 with do_resample, force the recorded
action at every later step of S (do_action), and let the policy re-decide the rest with seeds
drawn from (b, j). The rule-based outcome of the branch is the answer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine import events as ev
from engine.attribution.base import ForwardRequest
from engine.errors import EngineError, InterventionError
from engine.interventions import BranchRunner, BranchSpec, DoResample, ParentInfo, parent_info
from engine.journal import Journal


class HeistForwardModel:
    """Forward runs of one recorded, failed heist, executed as journaled branches.

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
    ) -> None:
        self.journal = journal
        self.parent: ParentInfo = parent_info(journal, run_id)
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
        self.concurrency = concurrency
        self.policy_override = policy_override
        first = next(journal.read(self.parent.run_id, 0, 1), None)
        if first is None or not isinstance(first.event, ev.RunStarted):
            raise EngineError(f"run {self.parent.run_id!r} has no RunStarted event")
        crew = first.event.agents
        self._agents = [crew[k % len(crew)] for k in range(self.parent.steps)]
        self.forward_runs = 0
        self.runner = BranchRunner(
            journal,
            self.parent,
            concurrency=concurrency,
            policy_override=policy_override,
            reuse=reuse,
        )

    def __enter__(self) -> HeistForwardModel:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        self.runner.close(interrupted=exc_type is not None)

    def close(self) -> None:
        self.runner.close()

    @property
    def reused(self) -> int:
        """Forward runs answered by a branch made earlier (same key), not run again."""
        return self.runner.reused

    @property
    def created(self) -> int:
        """Branches this model added to the journal."""
        return self.runner.created

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

    def run_batch(self, requests: Sequence[ForwardRequest]) -> list[bool]:
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
