"""The step loop: from any s_k, let agents take turns until the run ends.

Recording a new run and running a forked branch forward are the same loop; a branch only differs
in where it starts (s_k rebuilt from the journal) and in what it forces (an action, an
observation, a policy). Every model call, tool call, tool result and message of a step goes to
the recorder as one atomic append before the next step begins."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine import events as ev
from engine.errors import PolicyError, interrupt_behind
from engine.journal import ConcurrencyError, Journal
from engine.logging import bind, get_logger, unbind
from engine.policies.base import (
    AgentView,
    ChatLine,
    Completion,
    Policy,
    PolicyCancelled,
    history_length,
    trim_history,
)
from engine.runtime.clock import Clock, SystemClock
from engine.runtime.control import ControlChannel
from engine.runtime.recorder import Recorder
from engine.scenario import SteppedScenario
from engine.state import State, fold

log = get_logger("car.runtime")

FORCED_MODEL = "do_action"


@dataclass
class Overrides:
    """What a forward run does differently from the plain policy (the do() operations)."""

    forced_actions: dict[int, str] = field(default_factory=dict)
    observations: dict[int, str] = field(default_factory=dict)
    policy_from: tuple[int, Policy] | None = None


@dataclass
class EpisodeResult:
    run_id: str
    status: str
    steps: int
    outcome: dict[str, Any]
    error: str | None = None
    state: State | None = None


StepCallback = Callable[[int, str, list[ev.Event]], None]


def run_episode(
    recorder: Recorder,
    scenario: SteppedScenario,
    policy: Policy,
    seed_for_step: Callable[[int], int],
    transcript: list[ChatLine],
    *,
    overrides: Overrides | None = None,
    control: ControlChannel | None = None,
    clock: Clock | None = None,
    on_step: StepCallback | None = None,
    server: str | None = None,
) -> EpisodeResult:
    """Run from the recorder's current state to the end; returns the closed run's result.

    `transcript` is the full public conversation before the current step (the state only keeps
    a window); the outcome is scored on it."""
    ov = overrides or Overrides()
    clk = clock or SystemClock()
    full = list(transcript)
    bind(run_id=recorder.run_id)
    try:
        # the opening (RunStarted, an Intervention) is committed before the first model call,
        # so a run that fails or is killed at its first step still shows what it was
        recorder.flush()
        result = _loop(recorder, scenario, policy, seed_for_step, full, ov, control, clk,
                       on_step, server)  # fmt: skip
        # whatever ended the loop (the last step, a stop, a failure), every whole step
        # recorded so far reaches the journal
        recorder.flush()
        return result
    except BaseException as e:
        close_after(recorder, e)
        raise
    finally:
        unbind("run_id", "step")


def _loop(
    recorder: Recorder,
    scenario: SteppedScenario,
    policy: Policy,
    seed_for_step: Callable[[int], int],
    full: list[ChatLine],
    ov: Overrides,
    control: ControlChannel | None,
    clk: Clock,
    on_step: StepCallback | None,
    server: str | None,
) -> EpisodeResult:
    state = recorder.state
    while state.step < scenario.total_steps:
        k = state.step
        bind(step=k)
        if control is not None and _handle_control(recorder, control) == "stop":
            return _stopped(recorder, k)
        active = policy
        if ov.policy_from is not None and k >= ov.policy_from[0]:
            active = ov.policy_from[1]
        view = scenario.view(state, recorder.run_id)
        messages = scenario.messages(view)
        seed = seed_for_step(k)
        forced = ov.forced_actions.get(k)
        t0 = clk.monotonic()
        if forced is not None:
            completion = Completion(text=forced, model=FORCED_MODEL, finish_reason="forced")
        else:
            try:
                completion = active.decide(view, messages, seed)
                if not 0 <= completion.dropped <= history_length(messages):
                    raise PolicyError(
                        f"policy {active.name!r} says it left out {completion.dropped} of the"
                        f" {history_length(messages)} history messages it was given"
                    )
            except PolicyCancelled as e:
                # an aborted call is no step: the run stops where the last whole step ended
                if control is None or _handle_control(recorder, control) != "stop":
                    recorder.append([ev.Control(action="stop", reason=str(e))])
                return _stopped(recorder, k)
            except PolicyError as e:
                latency_ms = (clk.monotonic() - t0) * 1000.0
                _fail_step(recorder, view, messages, seed, active, str(e), server, latency_ms)
                log.error("policy failed", error=str(e))
                return EpisodeResult(
                    recorder.run_id, "failed", k, {}, error=str(e), state=recorder.state
                )
        latency_ms = (clk.monotonic() - t0) * 1000.0
        events = _step_events(scenario, view, messages, seed, completion, latency_ms, ov, k, server)
        state = recorder.append(events)
        full.append(ChatLine(step=k, agent=view.agent, text=completion.text))
        log.debug("step recorded", agent=view.agent, events=len(events))
        if on_step is not None:
            # a step is shown only once it is committed, so a kill never takes back what the
            # user already saw
            recorder.flush()
            on_step(k, view.agent, events)
    outcome = scenario.outcome(full)
    recorder.append([ev.RunEnded(status="completed", outcome=outcome)])
    return EpisodeResult(recorder.run_id, "completed", state.step, outcome, state=recorder.state)


def _stopped(recorder: Recorder, k: int) -> EpisodeResult:
    recorder.append([ev.RunEnded(status="stopped")])
    log.info("run stopped by request")
    return EpisodeResult(recorder.run_id, "stopped", k, {}, state=recorder.state)


def close_after(recorder: Recorder, exc: BaseException) -> None:
    """Close the run after an unexpected exception (a bug, Ctrl-C at a bad moment, a journal
    fault), so no run stays `recording` behind a process that gave up on it. The pending group
    is kept if it commits; if it cannot (it may be what failed), only the closing is written."""
    if recorder.state.status in ("completed", "stopped", "failed"):
        try:  # the run was already closed; only its last group may still be pending
            recorder.flush()
        except Exception as e:
            log.error("could not commit the closed run", error=str(e))
        return
    if isinstance(exc, SystemExit) or interrupt_behind(exc) is not None:
        end = ev.RunEnded(status="stopped")
    else:
        message = " ".join(f"{type(exc).__name__}: {exc}".split())[:500]
        end = ev.RunEnded(status="failed", error=f"internal error: {message}")
    try:
        recorder.append([end])
        recorder.flush()
        return
    except ConcurrencyError:
        pass  # the group had committed before its append raised (Ctrl-C during the COMMIT)
    except Exception as e:  # the journal itself may be what failed; the original error wins
        log.error("could not close the run with its pending steps", error=str(e))
    try:
        # at the run's head as stored: an interrupt that came after the group's commit (during
        # the commit itself, say) leaves the group written and the recorder's head behind it;
        # this process holds the run's lease, so nobody else wrote there
        head = recorder.journal.head(recorder.run_id)
        recorder.head = recorder.journal.append(recorder.run_id, [end], head)
        recorder.drop_pending()  # written before, or given up: closed either way
    except Exception as e:
        log.error("could not close the run", error=str(e))


def start_run(
    journal: Journal,
    scenario: str,
    opening: Sequence[ev.Event],
    *,
    label: str = "",
    group_ms: float = 0.0,
) -> Recorder:
    """A new run with its opening events, written in one transaction (it exists with them or
    not at all), and the recorder that goes on writing it. Whatever ends this before the
    recorder is handed over, a Ctrl-C coming out of that COMMIT included, closes the run if it
    was created: it never stays open with nobody writing it."""
    run_id = journal.new_run_id()
    try:
        journal.create_run(scenario, label=label, run_id=run_id, events=opening)
        return Recorder(
            journal, run_id, fold(opening), len(opening), group_ms=group_ms, leased=True
        )
    except BaseException as e:
        _close_created(journal, run_id, e)
        raise


def _close_created(journal: Journal, run_id: str, exc: BaseException) -> None:
    """Close a run whose creation an interrupt broke into: its transaction may have committed
    before the exception came out of it (a Ctrl-C during COMMIT), and then it would stay open
    with nobody writing it. Nothing to do when the run was not created."""
    try:
        if journal.status(run_id) != "recording":
            return
        state = fold(journal.events(run_id))
        recorder = Recorder(journal, run_id, state, state.seq, leased=True)
    except Exception:  # not created (UnknownRun), or the journal itself is what failed
        return
    close_after(recorder, exc)


def _step_events(
    scenario: SteppedScenario,
    view: AgentView,
    messages: list[dict[str, str]],
    seed: int,
    completion: Completion,
    latency_ms: float,
    ov: Overrides,
    k: int,
    server: str | None,
) -> list[ev.Event]:
    agent = view.agent
    events: list[ev.Event] = [_llm_call(view, messages, seed, completion, latency_ms, server)]
    replaced = ov.observations.get(k)
    for i, (tool, param) in enumerate(scenario.tool_calls(completion.text)):
        events.append(ev.ToolCall(step=k, agent=agent, tool=tool, param=param))
        if replaced is not None and i == 0:
            events.append(
                ev.ToolResult(step=k, agent=agent, tool=tool, param=param, ok=True, output=replaced)
            )
            continue
        result = scenario.run_tool(tool, param)
        events.append(
            ev.ToolResult(
                step=k,
                agent=agent,
                tool=tool,
                param=param,
                ok=result.ok,
                output=result.output,
                error=result.error,
            )
        )
    events.append(ev.ChatMessage(step=k, agent=agent, text=completion.text))
    return events


def _fail_step(
    recorder: Recorder,
    view: AgentView,
    messages: list[dict[str, str]],
    seed: int,
    policy: Policy,
    error: str,
    server: str | None,
    latency_ms: float = 0.0,
) -> None:
    """Journal the request that failed and close the run as failed: nothing is lost."""
    model = str(getattr(policy, "model", policy.name))
    failed = Completion(text="", model=model, finish_reason="error")
    recorder.append(
        [
            _llm_call(view, messages, seed, failed, latency_ms, server),
            ev.RunEnded(status="failed", error=error),
        ]
    )


def _llm_call(
    view: AgentView,
    messages: list[dict[str, str]],
    seed: int,
    completion: Completion,
    latency_ms: float,
    server: str | None,
) -> ev.LlmCall:
    return ev.LlmCall(
        step=view.step,
        agent=view.agent,
        # what was sent: a server that refused the whole as too long for its context was
        # sent the history without its oldest messages (the policy says how many)
        request=trim_history(messages, completion.dropped),
        seed=seed,
        model=completion.model,
        response=completion.text,
        finish_reason=completion.finish_reason,
        prompt_tokens=completion.prompt_tokens,
        completion_tokens=completion.completion_tokens,
        system_fingerprint=completion.system_fingerprint,
        latency_ms=round(latency_ms, 3),
        server=server,
        dropped=completion.dropped,
    )


def _handle_control(recorder: Recorder, control: ControlChannel) -> str | None:
    """Journal pending control requests; block while paused. Returns "stop" to stop."""
    requests = control.take()
    paused = False
    while True:
        for action, reason in requests:
            recorder.flush()
            if action == "pause" and not paused:
                recorder.append([ev.Control(action="pause", reason=reason)])
                paused = True
            elif action == "resume" and paused:
                recorder.append([ev.Control(action="resume", reason=reason)])
                paused = False
            elif action == "stop":
                recorder.append([ev.Control(action="stop", reason=reason)])
                return "stop"
        if not paused:
            return None
        recorder.flush()  # a paused run shows its pause in the journal while it waits
        requests = control.wait(timeout=0.5)
