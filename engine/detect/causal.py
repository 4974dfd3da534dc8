"""The causal detector: whose replacement — that agent only — by its public reference policy
saves the heist?

For each agent A: fork the run at A's first step, play A by its public reference policy
(engine/detect/reference.py) and every other agent by the run's own policy, run the branch to
its end, score it with the outcome rule. Over forward runs with fresh branch seeds this
estimates P(bad | A replaced); the agent whose replacement lowers it most is the suspect, and
its score is 1 - P(bad | A replaced), with a Wilson interval.

Sequential rule (racing): every agent still in the race gets `batch` more runs per round, the
i-th run of every agent sharing branch seed i (common random numbers). From `k_min` runs on,
an agent leaves the race once its bad rate exceeds the current best agent's by a Newcombe
interval (at `level`) wholly above zero; the race stops when one agent is left — separated from
all others at the stated level — or when every agent in it reached `k_max`. Each comparison is
at `level` and the rule looks after every round, so the overall error rate of "separated" can
exceed 1 - level (several comparisons, sequential looks); detect-eval measures what it is in
practice.

This reads no secret. Other agents keep the run's own policy and context in the forward runs —
the crew as it really is, which is what re-running it means — but A's own view is rebuilt from
the public config. Every forward run is a journaled branch (op "reference"); a later
`car fidelity`/`car fork` of such a branch replays it with the run's own policy throughout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from engine import events as ev
from engine.detect.reference import ReferenceView, SwapOne, reference_inner
from engine.detect.stats import newcombe, wilson
from engine.errors import EngineError, PolicyError
from engine.executors.base import Executor, ExecutorOptions, make_executor
from engine.heist import HeistScenario
from engine.heist.session import SCENARIO as HEIST
from engine.interventions import (
    BranchResult,
    ParentInfo,
    branch_base,
    branch_seed_for,
    parent_info,
    policy_for,
    policy_spec_at,
)
from engine.journal import Journal
from engine.otel.imported import IMPORTED_SCENARIO, not_rerunnable
from engine.public import PublicRun, public_error
from engine.runtime.episode import Overrides, run_episode
from engine.runtime.recorder import DEFAULT_GROUP_MS, Recorder
from engine.runtime.seeds import branch_stream, step_seed

OP = "reference"
K_MAX = 20
K_MIN = 4
BATCH = 2
LEVEL = 0.95


def needs_a_heist(view: PublicRun, method: str) -> None:
    """The causal and replay detectors re-run a heist's crew with an agent played by its public
    configuration: any other run is refused in one line, before anything is read or written,
    saying which detectors do read it."""
    if view.scenario == HEIST:
        return
    needs = (
        f"the {method} detector re-runs a heist's crew with one agent played by its public "
        "configuration, so it needs a heist"
    )
    if view.scenario == IMPORTED_SCENARIO:
        raise not_rerunnable(view.run_id, needs)
    raise EngineError(
        f"run {view.run_id!r} is a {view.scenario!r} run, not a heist; {needs}; the rules and "
        "llm detectors (`car detect --method rules`, `llm` or `rules+llm`) read any run"
    )


def first_steps(view: PublicRun) -> dict[str, int]:
    """Each agent's first step: its first message, else its place in the turn order."""
    first: dict[str, int] = {}
    for m in view.messages:
        first.setdefault(m.agent, m.step)
    return {a: first.get(a, i) for i, a in enumerate(view.agents)}


def reference_label(agent: str) -> str:
    return f"detect: {agent} by reference"


def reference_job(journal: Journal, parent: ParentInfo, arg: tuple[str, int, int]) -> BranchResult:
    """reference_branch as an executor job (engine/executors): arg is (agent, k, branch seed)."""
    agent, k, branch_seed = arg
    return reference_branch(journal, parent, agent, k, branch_seed)


def reference_branch(
    journal: Journal, parent: ParentInfo, agent: str, k: int, branch_seed: int
) -> BranchResult:
    """One forward run: fork at k, `agent` by its public reference policy from k on."""
    base = branch_base(journal, parent, k)
    s_k = base.state
    scenario = HeistScenario.from_state(s_k)
    stream = branch_stream(s_k.root_seed, branch_seed)  # not the public branch seed alone
    spec = policy_spec_at(s_k)
    own = policy_for(spec)
    swap = SwapOne(own, agent, ReferenceView(scenario), reference_inner(spec))
    child = journal.fork(parent.run_id, base.fork_seq, label=reference_label(agent))
    recorder = Recorder(journal, child, s_k, base.fork_seq, group_ms=DEFAULT_GROUP_MS)
    recorder.append(
        [
            ev.Intervention(
                step=k,
                op=OP,
                at=k,
                value={"agent": agent, "policy": spec.get("name")},
                branch_seed=branch_seed,
            )
        ]
    )
    try:
        r = run_episode(
            recorder,
            scenario,
            own,
            lambda j: step_seed(stream, j),
            list(base.prefix),
            overrides=Overrides(policy_from=(k, swap)),
            server=spec.get("base_url"),
        )
    except PolicyError as e:
        return BranchResult(child, "failed", None, public_error(str(e)))
    bad = r.outcome.get("bad") if r.status == "completed" else None
    return BranchResult(
        r.run_id, r.status, None if bad is None else bool(bad), public_error(r.error)
    )


@dataclass
class CausalResult:
    agents: list[str]
    first_step: dict[str, int]
    bad: dict[str, int]
    n: dict[str, int]
    failed: int
    forward_runs: int
    separated: bool
    level: float
    sequential: bool
    warnings: list[str] = field(default_factory=list)
    executor: dict[str, Any] | None = None

    def rate(self, a: str) -> float | None:
        return self.bad[a] / self.n[a] if self.n[a] else None

    def interval(self, a: str) -> tuple[float, float]:
        return wilson(self.bad[a], self.n[a], self.level)

    @property
    def scores(self) -> dict[str, float]:
        """1 - P(bad | agent replaced): high when replacing the agent saves the run."""
        return {a: 1.0 - (self.bad[a] / self.n[a] if self.n[a] else 1.0) for a in self.agents}

    def extra(self) -> dict[str, Any]:
        return {
            "forward_runs": self.forward_runs,
            "separated": self.separated,
            "sequential": self.sequential,
            "level": self.level,
            "executor": self.executor,
            "causal": {
                a: {
                    "first_step": self.first_step[a],
                    "runs": self.n[a],
                    "bad": self.bad[a],
                    "p_bad_replaced": None if self.rate(a) is None else round(self.rate(a), 4),  # type: ignore[arg-type]
                    "p_bad_ci": [round(x, 4) for x in self.interval(a)],
                }
                for a in self.agents
            },
            # the interval of each agent's score (1 - P(bad | replaced))
            "intervals": {
                a: [round(1 - self.interval(a)[1], 4), round(1 - self.interval(a)[0], 4)]
                for a in self.agents
            },
        }


def causal_scores(
    journal: Journal,
    view: PublicRun,
    *,
    k_max: int = K_MAX,
    k_min: int | None = None,
    batch: int = BATCH,
    level: float = LEVEL,
    sequential: bool = True,
    seed: int = 0,
    concurrency: int = 1,
    progress: Any = None,
    executor: ExecutorOptions | Executor | None = None,
) -> CausalResult:
    """Race the agents' reference swaps (module docstring); `sequential=False` spends
    `k_max` forward runs on every agent. `k_min` defaults to K_MIN, or to `k_max` when that
    is smaller: a cap of 2 runs per agent is a cap, not a contradiction of a default."""
    needs_a_heist(view, "causal")
    if k_min is None:
        k_min = min(K_MIN, k_max)
    if not 1 <= k_min <= k_max:
        raise EngineError(f"causal detection needs 1 <= k_min <= k_max, got {k_min}, {k_max}")
    if not 0.5 < level < 1.0:
        raise EngineError(f"causal detection level must be in (0.5, 1), got {level}")
    parent = parent_info(journal, view.run_id)
    if parent.status != "completed":
        raise EngineError(
            f"run {view.run_id!r} is {parent.status}; the causal detector needs a completed run"
        )
    agents = list(view.agents)
    first = first_steps(view)
    bad = dict.fromkeys(agents, 0)
    n = dict.fromkeys(agents, 0)
    tried = dict.fromkeys(agents, 0)  # the next branch-seed index of each agent
    failed = 0
    runs = 0
    active = list(agents)
    total = k_max * len(agents)
    separated = False
    last_error: str | None = None

    runner = make_executor(
        executor, journal, parent, concurrency=concurrency,
        mode="threads" if concurrency > 1 else "inline",
    )  # fmt: skip
    labels = {reference_label(a) for a in agents}
    try:
        while active:
            size = batch if sequential else k_max
            todo: list[tuple[str, int]] = []
            for a in active:
                for _ in range(min(size, k_max - tried[a])):
                    todo.append((a, tried[a]))
                    tried[a] += 1
            if not todo:
                break
            got: dict[int, BranchResult] = {}
            jobs = [(a, first[a], branch_seed_for(seed, i)) for a, i in todo]
            runner.map(journal, parent, reference_job, jobs, got.__setitem__, labels=labels)
            # in the order they were asked for, whatever order they finished in
            for j, (a, _) in enumerate(todo):
                r = got[j]
                runs += 1
                if r.bad is None:
                    failed += 1
                    last_error = r.error
                else:
                    n[a] += 1
                    bad[a] += int(r.bad)
                if progress is not None:
                    progress(runs, total)
            if all(n[a] == 0 for a in agents) and failed >= len(todo):
                raise EngineError(f"every forward run failed: {last_error}")
            active = [a for a in active if tried[a] < k_max]
            if not sequential or not all(n[a] >= k_min or tried[a] >= k_max for a in agents):
                continue
            best, out = _race(agents, bad, n, level)
            if best is not None and len(out) == len(agents) - 1:
                separated = True
                break
            active = [a for a in active if a not in out]
            if best is not None and best not in active and tried[best] < k_max:
                active.append(best)
    except BaseException:
        runner.close(interrupted=True)
        raise
    runner.close()
    stats = runner.stats()
    result = CausalResult(agents, first, bad, n, failed, runs, separated, level, sequential)
    result.executor = msgspec.to_builtins(stats)
    if stats.retried:
        result.warnings.append(f"{stats.retried} forward runs lost their worker and were run again")
    if not sequential:
        best, out = _race(agents, bad, n, level)
        result.separated = best is not None and len(out) == len(agents) - 1
    if failed:
        result.warnings.append(f"{failed} forward runs failed and were not scored")
    if not result.separated:
        result.warnings.append(
            f"no agent's replacement was separated from the others at level {level} within "
            f"{k_max} runs per agent"
        )
    return result


def _race(
    agents: list[str], bad: dict[str, int], n: dict[str, int], level: float
) -> tuple[str | None, set[str]]:
    """The agent whose replacement has the lowest bad rate so far, and the agents out of the
    race: those whose bad rate exceeds the best's by a Newcombe interval wholly above zero."""
    scored = [a for a in agents if n[a] > 0]
    if not scored:
        return None, set()
    best = min(scored, key=lambda a: bad[a] / n[a])
    return best, {
        a for a in scored if a != best and newcombe(bad[a], n[a], bad[best], n[best], level)[0] > 0
    }
