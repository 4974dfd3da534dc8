"""The five do() operations, applied by forking a run at step k and running the branch forward.

A branch is a child run: its parent pointer shares the prefix (steps < k) without copying it; its
first own event is the Intervention; from there the policy re-decides every later step with the
branch's seed, tools run against the same recorded world, and the same rule scores the outcome.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import hashlib
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec

from engine import events as ev
from engine.errors import ConfigError, EngineError, InterventionError, PolicyError
from engine.heist.session import HeistScenario
from engine.journal import Journal
from engine.policies.base import ChatLine, Policy
from engine.policies.registry import POLICY_NAMES, make_policy
from engine.policies.sim import step_seed
from engine.projections import conversation
from engine.runtime.episode import EpisodeResult, Overrides, run_episode
from engine.runtime.recorder import DEFAULT_GROUP_MS, Recorder
from engine.state import State, edit_transcript, state_at_seq, step_seq


class DoResample(msgspec.Struct, frozen=True, tag="resample"):
    """Redraw a_k from the unchanged policy (the null intervention)."""

    k: int


class DoAction(msgspec.Struct, frozen=True, tag="action"):
    """Force a_k to the given message text."""

    k: int
    action: str


class DoObservation(msgspec.Struct, frozen=True, tag="observation"):
    """Keep a_k, replace the result of its (first) tool call with `observation`."""

    k: int
    observation: str


class DoContext(msgspec.Struct, frozen=True, tag="context"):
    """Edit the conversation at k: {"step": j, "text": t} replaces step j's message (empty
    text deletes it); {"text": t} adds a message from the "context" pseudo-agent."""

    k: int
    edit: dict[str, Any]


class DoPolicy(msgspec.Struct, frozen=True, tag="policy"):
    """Swap the policy from step k on (a policy spec such as {"name": "sim-honest"})."""

    k: int
    policy: dict[str, Any]


Intervention = DoResample | DoAction | DoObservation | DoContext | DoPolicy
OPS = ("resample", "action", "observation", "context", "policy")


def op_name(iv: Intervention) -> str:
    return type(iv).__struct_config__.tag  # type: ignore[return-value]


def iv_value(iv: Intervention) -> Any:
    match iv:
        case DoAction():
            return iv.action
        case DoObservation():
            return iv.observation
        case DoContext():
            return iv.edit
        case DoPolicy():
            return iv.policy
        case _:
            return None


def parse_intervention(op: str, k: int, value: str | None) -> Intervention:
    """Build an intervention from CLI-style text; errors name the op and what it needs."""
    if op not in OPS:
        raise InterventionError(f"unknown operation {op!r}; expected one of: {', '.join(OPS)}")
    if op == "resample":
        if value:
            raise InterventionError("do_resample takes no --value")
        return DoResample(k)
    if value is None or value == "":
        raise InterventionError(f"do_{op} needs --value or --value-file")
    if op == "action":
        return DoAction(k, value)
    if op == "observation":
        return DoObservation(k, value)
    if op == "context":
        text = value.strip()
        if text.startswith("{"):
            try:
                edit = json.loads(text)
            except json.JSONDecodeError as e:
                raise InterventionError(f"do_context value is not valid JSON: {e}") from e
            if not isinstance(edit, dict) or not isinstance(edit.get("text"), str):
                raise InterventionError(
                    'do_context JSON must look like {"step": 3, "text": "..."} or {"text": "..."}'
                )
            if "step" in edit and not isinstance(edit["step"], int):
                raise InterventionError(
                    f"do_context 'step' must be an integer, got {edit['step']!r}"
                )
            return DoContext(k, edit)
        return DoContext(k, {"text": value})
    name, _, rest = value.partition(":")
    if name not in POLICY_NAMES:
        raise InterventionError(
            f"unknown policy {name!r} for do_policy; expected one of: {', '.join(POLICY_NAMES)}"
        )
    spec: dict[str, Any] = {"name": name}
    for part in filter(None, rest.split(",")):
        key, _, val = part.partition("=")
        spec[key.strip()] = val.strip()
    return DoPolicy(k, spec)


def branch_seed_for(seed: int, index: int) -> int:
    """The seed of branch `index` of a fork made with `seed` (63 bits, stable across runs)."""
    h = hashlib.blake2b(f"branch:{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") >> 1


class ParentInfo(msgspec.Struct, frozen=True):
    run_id: str
    steps: int
    status: str
    actions: dict[int, str]  # recorded action text per step
    tool_steps: frozenset[int]
    outcome: dict[str, Any]


def parent_info(journal: Journal, run_id: str) -> ParentInfo:
    """What validating and running interventions needs to know about the parent run."""
    info = journal.run(run_id)
    actions: dict[int, str] = {}
    tool_steps: set[int] = set()
    outcome: dict[str, Any] = {}
    for stored in journal.read(info.run_id):
        e = stored.event
        if isinstance(e, ev.ChatMessage) and e.step is not None:
            actions[e.step] = e.text
        elif isinstance(e, ev.ToolCall) and e.step is not None:
            tool_steps.add(e.step)
        elif isinstance(e, ev.RunEnded):
            outcome = dict(e.outcome)
    return ParentInfo(
        run_id=info.run_id,
        steps=journal.steps(info.run_id),
        status=journal.status(info.run_id),
        actions=actions,
        tool_steps=frozenset(tool_steps),
        outcome=outcome,
    )


def validate(parent: ParentInfo, iv: Intervention) -> None:
    if parent.status in ("recording", "paused"):
        raise InterventionError(
            f"run {parent.run_id!r} is still recording; fork it once it has ended"
        )
    if parent.steps == 0:
        raise InterventionError(f"run {parent.run_id!r} has no steps to fork")
    if not 0 <= iv.k < parent.steps:
        raise InterventionError(
            f"step {iv.k} is out of range: run {parent.run_id!r} has steps 0..{parent.steps - 1}"
        )
    if isinstance(iv, DoObservation) and iv.k not in parent.tool_steps:
        raise InterventionError(
            f"do_observation needs a step with a tool call; step {iv.k} of run "
            f"{parent.run_id!r} made none (steps with tool calls: "
            f"{', '.join(map(str, sorted(parent.tool_steps))) or 'none'})"
        )
    if isinstance(iv, DoContext) and "step" in iv.edit and not 0 <= iv.edit["step"] < iv.k:
        raise InterventionError(
            f"do_context can only edit an earlier step's message (0..{iv.k - 1}), "
            f"got step {iv.edit['step']}"
        )
    if isinstance(iv, DoPolicy):
        try:
            policy_for(iv.policy)
        except ConfigError as e:
            raise InterventionError(str(e)) from e


class BranchBase(msgspec.Struct, frozen=True):
    """What every branch forked at one step shares: where it forks, s_k, the conversation."""

    fork_seq: int
    state: State
    prefix: tuple[ChatLine, ...]


_bases: OrderedDict[tuple[str, str, int], BranchBase] = OrderedDict()
_policies: dict[str, Policy] = {}
_cache_lock = threading.Lock()


def branch_base(journal: Journal, parent: ParentInfo, k: int) -> BranchBase:
    """s_k and the prefix conversation of `parent`, computed once per process and cached:
    an ended run's history before k never changes, and branches by the hundred share it."""
    key = (journal.url, parent.run_id, k)
    with _cache_lock:
        hit = _bases.get(key)
        if hit is not None:
            _bases.move_to_end(key)
            return hit
    fork_seq = step_seq(journal, parent.run_id, k)
    base = BranchBase(
        fork_seq=fork_seq,
        state=state_at_seq(journal, parent.run_id, fork_seq),
        prefix=tuple(conversation(journal, parent.run_id, fork_seq)),
    )
    with _cache_lock:
        _bases[key] = base
        while len(_bases) > 256:
            _bases.popitem(last=False)
    return base


def policy_spec_at(state: State) -> dict[str, Any]:
    """The spec of the policy deciding at this state: the run's own, unless an earlier
    do_policy on this branch's history swapped it."""
    swapped = [iv for iv in state.interventions if iv["op"] == "policy"]
    return dict(swapped[-1]["value"]) if swapped else dict(state.policy)


def policy_for(spec: dict[str, Any]) -> Policy:
    """One policy object per spec and process: policies are stateless given (view, seed), and
    building an HTTP client per branch costs more CPU than a whole sim branch."""
    key = json.dumps(spec, sort_keys=True, default=str)
    with _cache_lock:
        pol = _policies.get(key)
        if pol is None:
            pol = _policies[key] = make_policy(spec)
        return pol


def run_branch(
    journal: Journal,
    parent: ParentInfo,
    iv: Intervention,
    branch_seed: int,
    *,
    keep: Mapping[int, str] | None = None,
    policy_override: dict[str, Any] | None = None,
    label: str = "",
) -> EpisodeResult:
    """Fork `parent` at iv.k, apply `iv`, and run the branch to its end.

    `keep` forces the recorded action at later steps too (used by Shapley coalitions)."""
    validate(parent, iv)
    k = iv.k
    base = branch_base(journal, parent, k)
    s_k = base.state
    scenario = HeistScenario.from_state(s_k)
    spec = policy_spec_at(s_k)
    if policy_override:
        spec.update(policy_override)
    policy = policy_for(spec)
    prefix = list(base.prefix)
    child = journal.fork(parent.run_id, base.fork_seq, label=label or f"do_{op_name(iv)}@{k}")
    opening = ev.Intervention(
        step=k, op=op_name(iv), at=k, value=iv_value(iv), branch_seed=branch_seed
    )
    recorder = Recorder(journal, child, s_k, base.fork_seq, group_ms=DEFAULT_GROUP_MS)
    recorder.append([opening])
    overrides = Overrides(forced_actions=dict(keep or {}))
    match iv:
        case DoAction():
            overrides.forced_actions[k] = iv.action
        case DoObservation():
            overrides.forced_actions[k] = parent.actions[k]
            overrides.observations[k] = iv.observation
        case DoPolicy():
            overrides.policy_from = (k, policy_for(iv.policy))
        case DoContext():
            prefix = edit_transcript(prefix, iv.edit, iv.k)
        case _:
            pass
    return run_episode(
        recorder,
        scenario,
        policy,
        lambda j: step_seed(branch_seed, j),
        prefix,
        overrides=overrides,
        server=spec.get("base_url"),
    )


# ------------------------------------------------------------------ many branches


class BranchResult(msgspec.Struct, frozen=True):
    run_id: str
    status: str
    bad: bool | None
    error: str | None = None


class ForkReport(msgspec.Struct, frozen=True):
    parent: str
    at: int
    op: str
    value: Any
    branches: list[BranchResult]
    bad: int
    scored: int
    bad_rate: float | None
    ci: tuple[float, float] | None
    factual_bad: bool | None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = msgspec.to_builtins(self)
        d["ci"] = list(self.ci) if self.ci is not None else None
        return d


def wilson(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval (scipy), sensible at 0 and n successes."""
    from scipy.stats import binomtest

    if n == 0:
        return (0.0, 1.0)
    ci = binomtest(successes, n).proportion_ci(confidence_level=confidence, method="wilson")
    return (float(ci.low), float(ci.high))


Progress = Callable[[int, int], None]


def _branch_job(
    target: str,
    parent: ParentInfo,
    iv: Intervention,
    branch_seed: int,
    keep: dict[int, str] | None,
    policy_override: dict[str, Any] | None,
) -> BranchResult:
    j = _worker_journals.get(target)
    if j is None:
        # one journal per worker process: opening checks the schema, which is not free
        j = _worker_journals[target] = Journal(target)
    return _branch_in(j, parent, iv, branch_seed, keep, policy_override)


_worker_journals: dict[str, Journal] = {}


def _branch_in(
    j: Journal,
    parent: ParentInfo,
    iv: Intervention,
    branch_seed: int,
    keep: dict[int, str] | None,
    policy_override: dict[str, Any] | None,
) -> BranchResult:
    try:
        r = run_branch(j, parent, iv, branch_seed, keep=keep, policy_override=policy_override)
    except PolicyError as e:
        return BranchResult("", "failed", None, str(e))
    bad = r.outcome.get("bad") if r.status == "completed" else None
    return BranchResult(r.run_id, r.status, None if bad is None else bool(bad), r.error)


class BranchSpec(msgspec.Struct, frozen=True):
    iv: Intervention
    branch_seed: int
    keep: dict[int, str] | None = None


def run_branches(
    journal: Journal,
    parent: ParentInfo,
    specs: Sequence[BranchSpec],
    *,
    concurrency: int = 1,
    progress: Progress | None = None,
    policy_override: dict[str, Any] | None = None,
) -> list[BranchResult]:
    """Run independent branches; in processes for the sim policy, as bounded asyncio tasks
    (threads waiting on the server) for an OpenAI-compatible one. Results keep spec order."""
    for s in specs:
        validate(parent, s.iv)
    total = len(specs)
    results: list[BranchResult | None] = [None] * total
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    policy_name = _policy_name(journal, parent.run_id, policy_override)
    if concurrency <= 1 or total <= 1:
        for i, s in enumerate(specs):
            results[i] = _branch_in(journal, parent, s.iv, s.branch_seed, s.keep, policy_override)
            tick()
    elif policy_name.startswith("sim") and journal.is_sqlite:
        target = str(journal.path)
        with cf.ProcessPoolExecutor(max_workers=min(concurrency, os.cpu_count() or 1)) as pool:
            futures = {
                pool.submit(
                    _branch_job, target, parent, s.iv, s.branch_seed, s.keep, policy_override
                ): i
                for i, s in enumerate(specs)
            }
            for fut in cf.as_completed(futures):
                results[futures[fut]] = fut.result()
                tick()
    else:

        async def main() -> None:
            # an executor as wide as the bound: asyncio's default pool (cpus + 4 threads) would
            # silently cap concurrency below what was asked for
            loop = asyncio.get_running_loop()
            sem = asyncio.Semaphore(concurrency)
            with cf.ThreadPoolExecutor(max_workers=concurrency) as pool:

                async def one(i: int, s: BranchSpec) -> None:
                    async with sem:
                        results[i] = await loop.run_in_executor(
                            pool,
                            _branch_in,
                            journal,
                            parent,
                            s.iv,
                            s.branch_seed,
                            s.keep,
                            policy_override,
                        )
                        tick()

                await asyncio.gather(*(one(i, s) for i, s in enumerate(specs)))

        asyncio.run(main())
    return [r for r in results if r is not None]


def _policy_name(journal: Journal, run_id: str, override: dict[str, Any] | None) -> str:
    if override and "name" in override:
        return str(override["name"])
    first = next(journal.read(run_id, 0, 1), None)
    if first is None or not isinstance(first.event, ev.RunStarted):
        raise EngineError(f"run {run_id!r} has no RunStarted event")
    return str(first.event.policy.get("name", ""))


def fork_many(
    journal: Journal,
    run_id: str,
    iv: Intervention,
    n: int,
    *,
    seed: int = 0,
    concurrency: int = 1,
    progress: Progress | None = None,
    policy_override: dict[str, Any] | None = None,
) -> ForkReport:
    """N branches of one intervention; the outcome distribution with a Wilson 95% interval."""
    if n < 1:
        raise InterventionError(f"-n must be at least 1, got {n}")
    parent = parent_info(journal, run_id)
    specs = [BranchSpec(iv, branch_seed_for(seed, i)) for i in range(n)]
    branches = run_branches(
        journal,
        parent,
        specs,
        concurrency=concurrency,
        progress=progress,
        policy_override=policy_override,
    )
    scored = [b for b in branches if b.bad is not None]
    bad = sum(1 for b in scored if b.bad)
    return ForkReport(
        parent=parent.run_id,
        at=iv.k,
        op=op_name(iv),
        value=iv_value(iv),
        branches=branches,
        bad=bad,
        scored=len(scored),
        bad_rate=bad / len(scored) if scored else None,
        ci=wilson(bad, len(scored)) if scored else None,
        factual_bad=parent.outcome.get("bad"),
    )
