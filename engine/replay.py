"""Replay: rebuild every s_k from the journal, check it against what the policy saw, and
re-execute each step under teacher forcing to measure fidelity (the action-match rate).

Teacher forcing: step k is re-decided from s_k as *recorded*, with the recorded seed; the new
action is compared with the recorded one and then discarded, so one divergence never cascades.
"""

from __future__ import annotations

import concurrent.futures as cf
import difflib
from collections.abc import Callable, Iterator
from typing import Any

import msgspec

from engine import events as ev
from engine.errors import InterventionError, ReplayDivergence
from engine.journal import Journal
from engine.policies.base import AgentView, Policy, history_length, trim_history
from engine.policies.registry import make_policy
from engine.runtime.episode import FORCED_MODEL
from engine.scenario import SteppedScenario, stepped_for
from engine.state import State, apply
from engine.workers import POLL, STOP, check


class RecordedStep(msgspec.Struct, frozen=True):
    step: int
    agent: str
    state: State  # s_k, rebuilt by the fold
    call: ev.LlmCall


def recorded_steps(journal: Journal, run_id: str) -> Iterator[RecordedStep]:
    """Each step's rebuilt s_k with its recorded LLM call, in one pass over the history. A stop
    request (Ctrl-C) is honoured between two events: the pass over a long run takes seconds."""
    s = State()
    for stored in journal.read(run_id):
        check()
        e = stored.event
        if isinstance(e, ev.LlmCall) and e.step is not None:
            yield RecordedStep(e.step, e.agent, s, e)
        s = apply(s, e)


def _view_and_messages(
    scenario: SteppedScenario, step: RecordedStep, run_id: str
) -> tuple[AgentView, list[dict[str, str]]]:
    """The acting agent's view and the request it was sent, rebuilt from s_k: the rendered
    messages without the oldest ones the recorded call says were left out (`trim_history`)."""
    view = scenario.view(step.state, run_id)
    messages = scenario.messages(view)
    if step.call.dropped:
        if step.call.dropped > history_length(messages):
            raise ReplayDivergence(
                f"run {run_id!r} step {step.step}: the recorded call left out"
                f" {step.call.dropped} messages of a history of {history_length(messages)}"
            )
        messages = trim_history(messages, step.call.dropped)
    return view, messages


class RequestCheck(msgspec.Struct, frozen=True):
    run_id: str
    steps_checked: int
    first_divergence: dict[str, Any] | None

    @property
    def ok(self) -> bool:
        return self.first_divergence is None


def check_requests(journal: Journal, run_id: str) -> RequestCheck:
    """Rebuild the conversation each policy was sent and compare it with the recorded request.

    Reports the first step where they differ, with the first differing message."""
    info = journal.run(run_id)
    scenario: SteppedScenario | None = None
    n = 0
    for step in recorded_steps(journal, info.run_id):
        if scenario is None:
            scenario = stepped_for(step.state, "the request check")
        _, messages = _view_and_messages(scenario, step, info.run_id)
        n += 1
        if messages != step.call.request:
            return RequestCheck(info.run_id, n, _request_diff(step, messages))
    return RequestCheck(info.run_id, n, None)


def _request_diff(step: RecordedStep, rebuilt: list[dict[str, str]]) -> dict[str, Any]:
    recorded = step.call.request
    for i in range(max(len(recorded), len(rebuilt))):
        a = recorded[i] if i < len(recorded) else None
        b = rebuilt[i] if i < len(rebuilt) else None
        if a != b:
            return {
                "step": step.step,
                "agent": step.agent,
                "message_index": i,
                "recorded": a,
                "rebuilt": b,
                "fields": sorted(
                    k for k in set(a or {}) | set(b or {}) if (a or {}).get(k) != (b or {}).get(k)
                ),
            }
    return {"step": step.step, "agent": step.agent, "message_index": None}


# ------------------------------------------------------------------ fidelity


def normalise(text: str) -> str:
    """Whitespace- and case-insensitive form of a message."""
    return " ".join(text.split()).casefold()


def _tool_calls(scenario: SteppedScenario, text: str) -> list[tuple[str, str]]:
    return [(name, " ".join(param.split())) for name, param in scenario.tool_calls(text)]


def short_diff(a: str, b: str, width: int = 240) -> str:
    """A compact word-level diff: [-removed-] {+added+}."""
    sm = difflib.SequenceMatcher(a=a.split(), b=b.split(), autojunk=False)
    parts: list[str] = []
    for op, i1, i2, j1, j2 in sm.get_opcodes():
        if op == "equal":
            words = a.split()[i1:i2]
            parts.append(" ".join(words) if len(words) <= 6 else f"{words[0]} … {words[-1]}")
        if op in ("replace", "delete"):
            parts.append("[-" + " ".join(a.split()[i1:i2]) + "-]")
        if op in ("replace", "insert"):
            parts.append("{+" + " ".join(b.split()[j1:j2]) + "+}")
    text = " ".join(parts)
    return text if len(text) <= width else text[: width - 1] + "…"


class StepMatch(msgspec.Struct, frozen=True):
    step: int
    agent: str
    exact: bool
    normalised: bool
    recorded: str
    new: str
    recorded_model: str
    new_model: str
    recorded_fingerprint: str | None
    new_fingerprint: str | None
    #: the spec of the policy that decided this step (a do_policy branch swapped it)
    policy: dict[str, Any] = msgspec.field(default_factory=dict)
    #: history messages the re-executed call left out beyond the recorded request: the
    #: server refused what was sent as longer than its context (a smaller one than then)
    dropped: int = 0


class FidelityReport(msgspec.Struct, frozen=True):
    run_id: str
    policy: dict[str, Any]
    steps: int
    skipped: int  # forced or failed steps: nothing to re-execute
    action_match_rate: float | None
    exact_match_rate: float | None
    per_agent: dict[str, dict[str, float | int]]
    per_step: list[dict[str, Any]]
    divergences: list[dict[str, Any]]
    #: do_policy swaps in the run's history: [{"step": k, "policy": spec}], from step k on
    policy_swaps: list[dict[str, Any]] = msgspec.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)  # type: ignore[no-any-return]


def fidelity(
    journal: Journal,
    run_id: str,
    *,
    policy_override: dict[str, Any] | None = None,
    concurrency: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> FidelityReport:
    """Re-execute every recorded step with its recorded seed and context; compare actions."""
    info = journal.run(run_id)
    steps = list(recorded_steps(journal, info.run_id))
    if not steps:
        raise InterventionError(f"run {info.run_id!r} has no recorded steps to replay")
    first_state = steps[0].state
    scenario = stepped_for(first_state, "car fidelity")
    spec = dict(first_state.policy)
    # one pass rebuilds every request; the policy must see exactly what it saw when
    # recording, anything else is not a replay, so say where the journal and the rebuild part
    todo: list[tuple[RecordedStep, AgentView, list[dict[str, str]]]] = []
    for step in steps:
        check()
        view, messages = _view_and_messages(scenario, step, info.run_id)
        if messages != step.call.request:
            raise ReplayDivergence(
                f"run {info.run_id!r} step {step.step}: rebuilt request differs from the "
                f"recorded one ({_request_diff(step, messages)})"
            )
        if step.call.model != FORCED_MODEL and step.call.finish_reason != "error":
            todo.append((step, view, messages))
    skipped = len(steps) - len(todo)
    taken: dict[str, dict[str, Any]] = {}
    if policy_override:
        # --base-url etc. apply to the policies that decided the re-executed steps and take
        # them: the recorded one, or after a do_policy in the run's history the one it swapped
        # in (a mixed branch's server steps go to the URL, its sim steps replay as they were);
        # refused when none of them takes them
        from engine.interventions import override_options, steps_text

        deciders: dict[str, list[int]] = {}
        for step, _, _ in todo:
            deciders.setdefault(str(_spec_at(step, spec).get("name", "")), []).append(step.step)
        refused: list[str] = []
        for name, ks in deciders.items():
            try:
                taken[name] = override_options(name, policy_override)
            except InterventionError as e:
                refused.append(f"{e} (the policy that decided {steps_text(ks)})")
        own = str(spec.get("name", ""))
        if not deciders or set(deciders) == {own}:
            taken[own] = override_options(own, policy_override)  # refused in its own words
        if not taken:
            raise InterventionError(f"run {info.run_id}: " + "; ".join(refused))
        spec.update(taken.get(own, {}))
    policy = make_policy(spec)

    def one(item: tuple[RecordedStep, AgentView, list[dict[str, str]]]) -> StepMatch:
        step, view, messages = item
        step_policy, step_spec = _policy_at(step, policy, spec, taken)
        new = step_policy.decide(view, messages, step.call.seed)
        rec = step.call.response
        exact = new.text == rec
        # normalised: same words up to whitespace and case, and the same parsed tool calls
        norm = exact or (
            normalise(new.text) == normalise(rec)
            and _tool_calls(scenario, new.text) == _tool_calls(scenario, rec)
        )
        return StepMatch(
            step=step.step,
            agent=step.agent,
            exact=exact,
            normalised=norm,
            recorded=rec,
            new=new.text,
            recorded_model=step.call.model,
            new_model=new.model,
            recorded_fingerprint=step.call.system_fingerprint,
            new_fingerprint=new.system_fingerprint,
            policy=step_spec,
            dropped=new.dropped,
        )

    matches: list[StepMatch | None] = [None] * len(todo)
    if concurrency > 1 or not str(spec.get("name", "")).startswith("sim"):
        # threads, polled: a stop request (Ctrl-C) is honoured between steps even while a
        # server is slow, and nothing waits for a call that hangs
        pool = cf.ThreadPoolExecutor(max_workers=concurrency)
        try:
            futures = {pool.submit(one, item): i for i, item in enumerate(todo)}
            pending = set(futures)
            while pending:
                finished, pending = cf.wait(pending, timeout=POLL, return_when=cf.FIRST_COMPLETED)
                for fut in finished:
                    matches[futures[fut]] = fut.result()
                check()
                if progress:
                    progress(len(todo) - len(pending), len(todo))
        finally:
            pool.shutdown(wait=not STOP.is_set(), cancel_futures=True)
    else:
        for i, item in enumerate(todo):
            check()
            matches[i] = one(item)
            if progress:
                progress(i + 1, len(todo))
    done = [m for m in matches if m is not None]
    swaps = [
        {"step": iv["at"], "policy": dict(iv["value"])}
        for iv in steps[-1].state.interventions
        if iv["op"] == "policy"
    ]
    return _report(info.run_id, spec, len(steps), skipped, done, swaps)


def _spec_at(step: RecordedStep, default_spec: dict[str, Any]) -> dict[str, Any]:
    """The spec of the policy that decided this step: a do_policy branch swapped it from its
    fork step on."""
    from engine.interventions import policy_spec_at

    if not any(iv["op"] == "policy" for iv in step.state.interventions):
        return default_spec
    return policy_spec_at(step.state)


def _policy_at(
    step: RecordedStep,
    default: Policy,
    default_spec: dict[str, Any],
    taken: dict[str, dict[str, Any]] | None = None,
) -> tuple[Policy, dict[str, Any]]:
    """The policy that decided this step, and its spec; a swapped-in one with the overrides
    its kind took (`taken`, by policy name: `default` has its own already)."""
    from engine.interventions import policy_for

    spec = _spec_at(step, default_spec)
    if spec is default_spec:
        return default, default_spec
    spec = {**spec, **(taken or {}).get(str(spec.get("name", "")), {})}
    return policy_for(spec), spec


def _report(
    run_id: str,
    spec: dict[str, Any],
    n_steps: int,
    skipped: int,
    matches: list[StepMatch],
    swaps: list[dict[str, Any]] | None = None,
) -> FidelityReport:
    per_agent: dict[str, dict[str, float | int]] = {}
    for m in matches:
        a = per_agent.setdefault(m.agent, {"steps": 0, "exact": 0, "normalised": 0})
        a["steps"] += 1
        a["exact"] += int(m.exact)
        a["normalised"] += int(m.normalised)
    for a in per_agent.values():
        a["exact_match_rate"] = a["exact"] / a["steps"]
        a["action_match_rate"] = a["normalised"] / a["steps"]
    n = len(matches)
    divergences = [
        {
            "step": m.step,
            "agent": m.agent,
            "normalised_match": m.normalised,
            "recorded": m.recorded,
            "new": m.new,
            "diff": short_diff(m.recorded, m.new),
            "provenance": {
                "recorded_model": m.recorded_model,
                "new_model": m.new_model,
                "recorded_fingerprint": m.recorded_fingerprint,
                "new_fingerprint": m.new_fingerprint,
                "server": (m.policy or spec).get("base_url"),
                "explanation": _explain(m, m.policy or spec),
            },
        }
        for m in matches
        if not m.exact
    ]
    return FidelityReport(
        run_id=run_id,
        policy=spec,
        steps=n_steps,
        skipped=skipped,
        action_match_rate=(sum(m.normalised for m in matches) / n) if n else None,
        exact_match_rate=(sum(m.exact for m in matches) / n) if n else None,
        per_agent=per_agent,
        per_step=[
            {"step": m.step, "agent": m.agent, "exact": m.exact, "normalised": m.normalised}
            for m in matches
        ],
        divergences=divergences,
        policy_swaps=list(swaps or []),
    )


def _explain(m: StepMatch, spec: dict[str, Any]) -> str:
    if m.dropped:
        return (
            f"the server refused the recorded request as longer than its context: it was sent"
            f" without {m.dropped} more of its oldest history messages"
        )
    if m.recorded_model != m.new_model:
        return f"model changed: {m.recorded_model!r} -> {m.new_model!r}"
    if m.recorded_fingerprint != m.new_fingerprint:
        return f"server fingerprint changed: {m.recorded_fingerprint!r} -> {m.new_fingerprint!r}"
    if spec.get("name", "").startswith("sim") and float(spec.get("drift", 0) or 0) > 0:
        return f"sim drift knob is {spec.get('drift')}: the policy ignores the seed sometimes"
    if m.normalised:
        return "only whitespace or letter case differ"
    return "same model and fingerprint: nondeterminism in the model or server"
