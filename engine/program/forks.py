"""Forks and forward runs of recorded programs (the "program" scenario's `fork` and
`forward_model`, engine.program.scenario): many branches, each one execution of the program
journaled as a child run (engine.program.session.fork_branch), scored by its outcome.

Branches are independent processes that spend their time waiting on the model server, so they
run in threads (`concurrency` at once). A branch is named by the same deterministic key as a
heist branch (engine.interventions.branch_key), so `car attribute RUN -- CMD` with the same seed
reads back the branches an earlier attribution made instead of running them again.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Sequence
from typing import Any

from engine.attribution.base import ForwardRequest
from engine.errors import EngineError, InterventionError
from engine.interventions import (
    BranchResult,
    DoResample,
    ForkReport,
    Intervention,
    branch_key,
    branch_label,
    branch_seed_for,
)
from engine.journal import Journal
from engine.program.matching import MatchMode
from engine.program.session import (
    ProgramInfo,
    ProgramRun,
    branch_upstream,
    fork_branch,
    program_info,
)

Progress = Callable[[int, int], None]


def _ended(info: ProgramInfo) -> None:
    if info.status in ("recording", "paused"):
        raise InterventionError(f"run {info.run_id!r} is still recording; fork it once it ended")
    if not info.calls:
        raise InterventionError(f"run {info.run_id!r} made no calls to fork at")


def _result(run: ProgramRun, reused: bool = False) -> BranchResult:
    bad = run.bad if run.status == "completed" else None
    return BranchResult(run.run_id or "", run.status, bad, run.error, reused=reused)


def _check_live(info: ProgramInfo, upstream: str | None) -> None:
    up = branch_upstream(info, upstream)
    if up is not None:
        up.check()


def fork_program(
    journal: Journal,
    run_id: str,
    iv: Intervention,
    n: int,
    cmd: Sequence[str],
    *,
    seed: int = 0,
    concurrency: int = 1,
    upstream: str | None = None,
    match: MatchMode = MatchMode.EXACT,
    progress: Progress | None = None,
) -> ForkReport:
    """N branches of one intervention at call k; the outcome distribution (Wilson 95%)."""
    if n < 1:
        raise InterventionError(f"the number of branches must be at least 1, got {n}")
    info = program_info(journal, run_id)
    _ended(info)
    _check_live(info, upstream)
    seeds = [branch_seed_for(seed, i) for i in range(n)]

    def one(bs: int) -> BranchResult:
        label = branch_label(iv, branch_key(info.run_id, iv, bs, None, None))
        return _result(
            fork_branch(journal, info, iv, bs, cmd, upstream=upstream, label=label, match=match)
        )

    branches = _run_all(one, seeds, concurrency, progress)
    return ForkReport.of(info.run_id, iv, branches, info.outcome.get("bad"))


def _run_all(
    one: Callable[[Any], BranchResult],
    items: Sequence[Any],
    concurrency: int,
    progress: Progress | None,
) -> list[BranchResult]:
    from engine.workers import check

    results: list[BranchResult | None] = [None] * len(items)
    done = 0
    if concurrency <= 1:
        for i, it in enumerate(items):
            check()  # a stop request (Ctrl-C) ends the command between branches
            results[i] = one(it)
            done += 1
            if progress:
                progress(done, len(items))
    else:
        with cf.ThreadPoolExecutor(max_workers=concurrency) as pool:
            futures = {pool.submit(one, it): i for i, it in enumerate(items)}
            for fut in cf.as_completed(futures):
                results[futures[fut]] = fut.result()
                done += 1
                if progress:
                    progress(done, len(items))
    return [r for r in results if r is not None]


class ProgramForwardModel:
    """Forward runs of one recorded, failed program: branch k re-draws call k live (calls
    before it from the journal, kept calls after it from the journal too), the program's
    outcome says whether it is bad. The estimators' protocol (engine.attribution.base)."""

    def __init__(
        self,
        journal: Journal,
        run_id: str,
        cmd: Sequence[str],
        *,
        upstream: str | None = None,
        concurrency: int = 1,
        reuse: bool = True,
        match: MatchMode = MatchMode.EXACT,
    ) -> None:
        self.journal = journal
        self.info = program_info(journal, run_id)
        _ended(self.info)
        if self.info.status != "completed":
            raise InterventionError(
                f"run {self.info.run_id!r} is {self.info.status}; attribution needs a completed run"
            )
        if not self.info.outcome.get("bad"):
            raise InterventionError(
                f"run {self.info.run_id!r} did not fail (its outcome is good); attribution "
                "explains a bad outcome"
            )
        _check_live(self.info, upstream)
        self.cmd = list(cmd)
        self.upstream = upstream
        self.concurrency = concurrency
        self.match = match
        self.created = 0
        self.reused = 0
        self.forward_runs = 0
        self._existing: dict[str, str] = {}
        if reuse:
            for child in journal.children(self.info.run_id):
                if "#" in child.label:
                    self._existing.setdefault(child.label, child.run_id)

    def __enter__(self) -> ProgramForwardModel:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        # branches run in threads of each batch: nothing outlives a batch
        return None

    def executor_stats(self) -> None:
        """No executor: a program's branches are subprocesses of this command."""
        return None

    @property
    def run_id(self) -> str:
        return self.info.run_id

    @property
    def n_steps(self) -> int:
        return len(self.info.calls)

    @property
    def step_agents(self) -> Sequence[str | None]:
        return [c.agent for c in self.info.calls]

    @property
    def step_labels(self) -> Sequence[str]:
        return [f"{c.step}:{c.agent}" for c in self.info.calls]

    def message(self, k: int) -> str:
        c = self.info.calls[k]
        text = c.call.response
        if c.tools:
            text += " " + " ".join(f"[{t.tool} {t.param}]" for t in c.tools)
        return text.strip()

    def _branch(self, req: ForwardRequest) -> bool:
        from engine.workers import check

        check()
        free = [j for j in range(self.n_steps) if j not in req.keep]
        if not free:
            return bool(self.info.outcome.get("bad"))
        k0 = free[0]
        keep = frozenset(j for j in req.keep if j > k0)
        iv = DoResample(k0)
        label = branch_label(
            iv,
            branch_key(
                self.info.run_id,
                iv,
                req.branch_seed,
                {j: "" for j in keep} if keep else None,
                None,
            ),
        )
        found = self._existing.get(label)
        if found is not None:
            last = self.journal.last_event(found)
            outcome = getattr(last.event, "outcome", None) if last else None
            if isinstance(outcome, dict) and outcome.get("bad") is not None:
                self.reused += 1
                return bool(outcome["bad"])
        run = fork_branch(
            self.journal,
            self.info,
            iv,
            req.branch_seed,
            self.cmd,
            upstream=self.upstream,
            label=label,
            keep=keep,
            match=self.match,
        )
        self.created += 1
        if run.status != "completed" or run.bad is None:
            raise EngineError(f"a forward run failed ({run.status}): {run.error}")
        return run.bad

    def run_batch(self, requests: Sequence[ForwardRequest]) -> list[bool]:
        self.forward_runs += len(requests)
        if self.concurrency <= 1:
            return [self._branch(r) for r in requests]
        with cf.ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            return list(pool.map(self._branch, requests))
