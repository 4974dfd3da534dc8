"""s_k as a pure fold over the journal's events, with snapshots that make any s_k cheap.

s_k is the state *before* step k: the conversation so far, each agent's private context (its
tool observations; for the mole its secret instructions), the turn cursor and the seeds. What a
policy sees is bounded by the run's context window (the last `context_window` messages and
observations), as an LLM's context is; the full transcript stays in the journal as a projection.
Bounding s_k keeps snapshots small, so reconstruction costs the same at step 10 and step 100,000.
"""

from __future__ import annotations

import zlib
from typing import Any

import msgspec

from engine import events as ev
from engine.errors import InterventionError
from engine.journal import Journal
from engine.policies.base import ChatLine, Observation

# Bump when the fold's meaning or the snapshot encoding changes: older snapshots are then
# ignored and rebuilt.
FOLD_VERSION = 2
# 512 keeps the worst-case fold past a snapshot near 3 ms while snapshots cost ~0.1x of the
# payload on disk (bench/bench_journal.py measures both).
SNAPSHOT_EVERY = 512
DEFAULT_CONTEXT_WINDOW = 48


class AgentContext(msgspec.Struct, frozen=True):
    """One agent's private context."""

    observations: tuple[Observation, ...] = ()
    turns: int = 0
    secret: str | None = None  # the mole's instructions, visible to that agent only
    strategy: str | None = None


class State(msgspec.Struct, frozen=True):
    seq: int = 0  # number of events folded
    step: int = 0  # turn cursor: the next step to act
    scenario: str = ""
    agents: tuple[str, ...] = ()
    rounds: int = 0
    root_seed: int = 0
    policy: dict[str, Any] = msgspec.field(default_factory=dict)
    config: dict[str, Any] = msgspec.field(default_factory=dict)
    context_window: int = DEFAULT_CONTEXT_WINDOW
    transcript: tuple[ChatLine, ...] = ()
    contexts: dict[str, AgentContext] = msgspec.field(default_factory=dict)
    seeds: tuple[tuple[int, int], ...] = ()  # (step, seed) of the steps in the window
    interventions: tuple[dict[str, Any], ...] = ()
    status: str = "new"
    n_messages: int = 0
    n_tool_calls: int = 0
    n_tool_failures: int = 0

    @property
    def acting_agent(self) -> str | None:
        return self.agents[self.step % len(self.agents)] if self.agents else None

    @property
    def round(self) -> int:
        return self.step // len(self.agents) if self.agents else 0


_replace = msgspec.structs.replace


def _tail(items: tuple[Any, ...], n: int) -> tuple[Any, ...]:
    return items[-n:] if len(items) > n else items


def apply(state: State, event: ev.Event) -> State:
    """The fold's single step: the state after `event`. Pure; never mutates `state`."""
    seq = state.seq + 1
    step = state.step
    if event.step is not None and event.step + 1 > step and not isinstance(event, ev.Intervention):
        step = event.step + 1
    match event:
        case ev.RunStarted():
            return _replace(
                state,
                seq=seq,
                scenario=event.scenario,
                agents=tuple(event.agents),
                rounds=event.rounds,
                root_seed=event.root_seed,
                policy=dict(event.policy),
                config=dict(event.config),
                context_window=event.context_window or DEFAULT_CONTEXT_WINDOW,
                status="recording",
            )
        case ev.MoleAssigned() if event.none:
            return _replace(state, seq=seq)  # a game without a mole: nobody has a secret
        case ev.MoleAssigned():
            ctx = state.contexts.get(event.agent, AgentContext())
            contexts = dict(state.contexts)
            contexts[event.agent] = _replace(
                ctx, secret=event.instructions, strategy=event.strategy
            )
            return _replace(state, seq=seq, contexts=contexts)
        case ev.LlmCall() | ev.FoldLlmCall():
            ctx = state.contexts.get(event.agent, AgentContext())
            contexts = dict(state.contexts)
            contexts[event.agent] = _replace(ctx, turns=ctx.turns + 1)
            seeds = _tail((*state.seeds, (event.step or 0, event.seed)), state.context_window)
            return _replace(state, seq=seq, step=step, contexts=contexts, seeds=seeds)
        case ev.ToolCall():
            return _replace(state, seq=seq, step=step, n_tool_calls=state.n_tool_calls + 1)
        case ev.ToolResult():
            ctx = state.contexts.get(event.agent, AgentContext())
            obs = Observation(
                step=event.step or 0,
                tool=event.tool,
                param=event.param,
                ok=event.ok,
                output=event.output if event.ok else (event.error or ""),
            )
            contexts = dict(state.contexts)
            contexts[event.agent] = _replace(
                ctx, observations=_tail((*ctx.observations, obs), state.context_window)
            )
            return _replace(
                state,
                seq=seq,
                step=step,
                contexts=contexts,
                n_tool_failures=state.n_tool_failures + (0 if event.ok else 1),
            )
        case ev.ChatMessage():
            line = ChatLine(step=event.step or 0, agent=event.agent, text=event.text)
            return _replace(
                state,
                seq=seq,
                step=step,
                transcript=_tail((*state.transcript, line), state.context_window),
                n_messages=state.n_messages + 1,
            )
        case ev.Intervention():
            record = {"op": event.op, "at": event.at, "value": event.value}
            transcript = state.transcript
            if event.op == "context":
                transcript = _tail(
                    tuple(edit_transcript(transcript, event.value, event.at)),
                    state.context_window,
                )
            return _replace(
                state,
                seq=seq,
                transcript=transcript,
                interventions=(*state.interventions, record),
            )
        case ev.Control():
            status = {"pause": "paused", "resume": "recording", "stop": "stopping"}.get(
                event.action, state.status
            )
            return _replace(state, seq=seq, status=status)
        case ev.RunEnded():
            return _replace(state, seq=seq, status=event.status)
        case _:
            return _replace(state, seq=seq, step=step)


CONTEXT_AGENT = "context"


def edit_transcript(lines: Any, edit: Any, at: int) -> list[ChatLine]:
    """Apply a do_context edit to a conversation.

    `{"step": j, "text": t}` replaces the message of step j (an empty text deletes it);
    `{"text": t}` adds a message from the "context" pseudo-agent just before step `at`."""
    out = list(lines)
    if not isinstance(edit, dict) or not isinstance(edit.get("text"), str):
        return out
    target = edit.get("step")
    if target is None:
        out.append(ChatLine(step=at, agent=CONTEXT_AGENT, text=edit["text"]))
        return out
    edited: list[ChatLine] = []
    for line in out:
        if line.step == target and line.agent != CONTEXT_AGENT:
            if edit["text"]:
                edited.append(ChatLine(step=line.step, agent=line.agent, text=edit["text"]))
        else:
            edited.append(line)
    return edited


def fold(events: Any, state: State | None = None) -> State:
    """Plain fold: the state after all `events`, starting from `state` (or the empty state)."""
    s = state if state is not None else State()
    for e in events:
        s = apply(s, e)
    return s


_state_encoder = msgspec.msgpack.Encoder()
_state_decoder = msgspec.msgpack.Decoder(State)


def encode_state(state: State) -> bytes:
    # level 1: the window repeats the run's vocabulary, so even fast compression shrinks it
    # several-fold, and decompressing costs far less than the fold it replaces
    return zlib.compress(_state_encoder.encode(state), 1)


def decode_state(data: bytes) -> State:
    return _state_decoder.decode(zlib.decompress(data))


def state_at_seq(journal: Journal, run_id: str, seq: int, *, snapshots: bool = True) -> State:
    """The state after the first `seq` events of the run's history.

    Starts from the nearest snapshot and folds the rest, writing the snapshots it crosses so the
    next reconstruction is cheap."""
    base = State()
    if snapshots:
        snap = journal.nearest_snapshot(run_id, seq, FOLD_VERSION)
        if snap is not None:
            base = decode_state(snap[1])
    s = base
    for event in journal.read_for_fold(run_id, base.seq, seq):
        s = apply(s, event)
        if snapshots and s.seq % SNAPSHOT_EVERY == 0:
            journal.put_snapshot(run_id, s.seq, FOLD_VERSION, encode_state(s))
    return s


def step_seq(journal: Journal, run_id: str, k: int) -> int:
    """The seq where step k begins in the run's history (its head if k is one past the end)."""
    n = journal.steps(run_id)
    if k < 0 or k > n:
        raise InterventionError(f"step {k} is out of range: run {run_id!r} has steps 0..{n - 1}")
    start = journal.step_start(run_id, k)
    if start is None:
        return _end_of_steps(journal, run_id)
    return start


def _end_of_steps(journal: Journal, run_id: str) -> int:
    """Seq just after the last step's events (before a trailing RunEnded, if any)."""
    last = journal.last_stepped(run_id)
    return 0 if last is None else last[1] + 1


def state_at(journal: Journal, run_id: str, k: int, *, snapshots: bool = True) -> State:
    """s_k: the state before step k of the run (or branch) `run_id`."""
    return state_at_seq(journal, run_id, step_seq(journal, run_id, k), snapshots=snapshots)


def shown_state(journal: Journal, run_id: str, k: int) -> State:
    """s_k as `car state` shows it: at k one past the last step, the run's whole history (its
    RunEnded too, once it has one), so that an ended run says how it ended; else `state_at`."""
    if k == journal.steps(run_id):
        return state_at_seq(journal, run_id, journal.head(run_id))
    return state_at(journal, run_id, k)


def next_agent(state: State) -> str | None:
    """The agent whose turn is next, None once the run has ended (or before it began)."""
    return state.acting_agent if state.status in ("recording", "paused") else None


def build_snapshots(journal: Journal, run_id: str) -> int:
    """Fold the whole run once, storing every SNAPSHOT_EVERY-th state; returns the head."""
    head = journal.head(run_id)
    state_at_seq(journal, run_id, head)
    return head
