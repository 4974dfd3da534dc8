"""Which recorded call answers a replayed request, and - when none does - why not.

A request is matched by position: the n-th call of an agent answers from that agent's n-th
recorded call (agents are named as they were while recording, engine.program.wire). The match
mode says what must then be equal (vcrpy's discipline: explicit modes, a typo fails loudly):

* `exact` (default): the messages and every other field of the request (model, tools,
  sampling parameters, stream) but the seed, which the recorder journals on its own and a
  replay has no use for (the answer comes from the journal).
* `messages`: the messages only (another model name or temperature still matches).
* `position`: nothing; the n-th call gets the n-th answer whatever it asks. Differences are
  still counted as divergences of the program's behaviour, they only do not stop it.

A miss is a diagnosis, never a bare "not found": the first differing field with both values,
and the nearest recorded call (the one sharing the longest run of leading messages).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Any

import msgspec

from engine import events as ev
from engine.errors import ConfigError
from engine.journal import Journal
from engine.program import wire


class MatchMode(StrEnum):
    EXACT = "exact"
    MESSAGES = "messages"
    POSITION = "position"

    @classmethod
    def parse(cls, value: str | MatchMode) -> MatchMode:
        try:
            return cls(value)
        except ValueError as e:
            valid = ", ".join(repr(m.value) for m in cls)
            raise ConfigError(f"match mode must be one of {valid}, got {value!r}") from e


class RecordedCall(msgspec.Struct, frozen=True):
    """One journaled chat completion of a recorded program."""

    step: int
    agent: str
    ordinal: int  # the agent's n-th call (0-based)
    call: ev.LlmCall
    tools: list[ev.ToolCall]

    @property
    def key(self) -> tuple[str, int]:
        return (self.agent, self.ordinal)

    def answer(self) -> wire.Answer:
        return wire.answer_from_events(self.call, self.tools)


def recorded_calls(journal: Journal, run_id: str, stop: int | None = None) -> list[RecordedCall]:
    """Every call of the run's history (through its parents), in step order."""
    calls: list[RecordedCall] = []
    ordinals: dict[str, int] = {}
    tools: dict[int, list[ev.ToolCall]] = {}
    for stored in journal.read(run_id, 0, stop):
        e = stored.event
        if isinstance(e, ev.LlmCall) and e.step is not None:
            n = ordinals.get(e.agent, 0)
            ordinals[e.agent] = n + 1
            tools[e.step] = []
            calls.append(RecordedCall(e.step, e.agent, n, e, tools[e.step]))
        elif isinstance(e, ev.ToolCall) and e.step is not None and e.step in tools:
            tools[e.step].append(e)
    return calls


def _short(v: Any, n: int = 80) -> str:
    text = v if isinstance(v, str) else wire.canonical(v)
    text = " ".join(text.split())
    return repr(text if len(text) <= n else text[: n - 1] + "…")


def first_difference(
    recorded: list[dict[str, str]], got: list[dict[str, str]], mode: MatchMode
) -> tuple[str, Any, Any] | None:
    """(field, recorded value, requested value) of the first difference, None when equal
    under `mode`. Fields are named like `messages[2].content` or `params.temperature`."""
    if mode is MatchMode.POSITION:
        return None
    rm, gm = wire.messages_of(recorded), wire.messages_of(got)
    for i in range(max(len(rm), len(gm))):
        a = rm[i] if i < len(rm) else None
        b = gm[i] if i < len(gm) else None
        if a == b:
            continue
        if a is None or b is None:
            return (f"messages[{i}]", a, b)
        keys = sorted(set(a) | set(b), key=lambda k: (k not in ("role", "content"), k))
        for k in keys:
            if a.get(k) != b.get(k):
                return (f"messages[{i}].{k}", a.get(k), b.get(k))
    if mode is MatchMode.MESSAGES:
        return None
    rp, gp = wire.params_of(recorded), wire.params_of(got)
    for k in sorted(set(rp) | set(gp)):
        if rp.get(k) != gp.get(k):
            return (f"params.{k}", rp.get(k), gp.get(k))
    return None


def _message(m: Any) -> Any:
    """A whole message, shortly: its role and the start of its content (or its keys)."""
    if not isinstance(m, dict):
        return m
    text = m.get("content") or ", ".join(k for k in m if k != "role")
    return f"{m.get('role')}: {text}"


def describe(diff: tuple[str, Any, Any]) -> str:
    field, a, b = diff
    a, b = _message(a), _message(b)
    if a is None:
        return f"{field} is new (got {_short(b)}; the recording has none)"
    if b is None:
        return f"{field} is missing (recorded {_short(a)})"
    return f"{field} differs: recorded {_short(a)}, got {_short(b)}"


def _leading_equal(a: list[dict[str, str]], b: list[dict[str, str]]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def nearest(
    calls: Sequence[RecordedCall], got: list[dict[str, str]], agent: str
) -> RecordedCall | None:
    """The recorded call most like a request: the longest run of equal leading messages, then
    the same agent, then the same number of messages."""
    gm = wire.messages_of(got)
    best: tuple[tuple[int, int, int], RecordedCall] | None = None
    for c in calls:
        rm = wire.messages_of(c.call.request)
        score = (_leading_equal(rm, gm), int(c.agent == agent), -abs(len(rm) - len(gm)))
        if best is None or score > best[0]:
            best = (score, c)
    return None if best is None else best[1]


def diagnosis(
    calls: Sequence[RecordedCall],
    agent: str,
    ordinal: int,
    got: list[dict[str, str]],
    mode: MatchMode,
    expected: RecordedCall | None,
) -> str:
    """One line saying why a request found no recorded answer."""
    if expected is None:
        n = sum(1 for c in calls if c.agent == agent)
        head = (
            f"call {ordinal} of agent {agent!r} has no recorded counterpart "
            f"(the run recorded {n} calls of {agent!r}"
            + (f"; agents recorded: {', '.join(sorted({c.agent for c in calls}))}" if not n else "")
            + ")"
        )
    else:
        diff = first_difference(expected.call.request, got, mode)
        assert diff is not None
        head = (
            f"call {ordinal} of agent {agent!r} (recorded step {expected.step}) does not match "
            f"({mode.value}): {describe(diff)}"
        )
    near = nearest(calls, got, agent)
    if near is None:
        return head + "; the run recorded no calls"
    if near is expected:
        return head + f"; nearest recorded call: step {near.step} (this one)"
    nd = first_difference(near.call.request, got, mode)
    tail = "identical under this mode" if nd is None else describe(nd)
    return head + f"; nearest recorded call: step {near.step} (agent {near.agent!r}, {tail})"


def normalised(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """Messages with whitespace- and case-insensitive contents."""
    return [
        {k: (" ".join(v.split()).casefold() if k == "content" else v) for k, v in m.items()}
        for m in messages
    ]
