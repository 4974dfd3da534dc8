"""Which recorded call answers a replayed request, and - when none does - why not.

**The rule.** Each agent's recorded calls (agents are named as they were while recording,
engine.program.wire) are answered at most once. A request of an agent takes the first of:

1. the agent's earliest recorded call not yet answered (its *position*), when the request is
   equal to it under the level tried;
2. else the agent's earliest not-yet-answered recorded call that the request is equal to under
   that level (the call is *reordered*);

trying the level `exact` first and then, in the modes `messages` and `position`, the level
`messages`. When nothing is equal, the request is held against its position: `exact` and
`messages` answer a miss (the position is used up all the same, so the agent's later calls
keep their places), `position` answers with it. A sequential program is matched exactly as
before: its n-th call of an agent meets that agent's n-th recorded call, which it equals.

Why: the proxy numbers a run's steps in the order their answers are journaled, and a program
whose agent has several calls in flight at once (`asyncio.gather`, threads) sends them, and
gets them answered, in an order that is a race. Two tasks of one agent, each a call and a
follow-up, recorded against a llama.cpp server interleave (steps a1 b1 a2 b2); replayed from
the journal, whose answers are instant, task a may be done before task b begins (a1 a2 b1
b2), or task b may start first (b1 b2 a1 a2). By position alone a2 met b1's recording, or b1
met a1's: a miss in `exact` and `messages`, the other task's answer in `position`.

The journal cannot say which calls overlapped - an LlmCall has its latency but no start time,
and steps are completion order - and overlap is not what decides anyway: b2 never overlapped
a1 when recorded (it was sent after b1's answer, which came after a1's), yet it may come
before a1 on replay. What decides is which recorded call the program is making, and an equal
request says so. A call whose recorded request carries an earlier answer (a chat's history, a
tool call's id) can only be equalled once that answer was given, so reordering never runs
ahead of what the program knows and a sequential agent whose requests carry its history is
matched by position exactly as before; equal requests of one agent are answered in recorded
order; and the choice depends on nothing but the requests, in the order they arrive. A
reordered call counts (`reordered` in the replay's report) and otherwise matches as any other.
An agent asking the same recorded requests in another order without overlapping - which the
journal cannot tell from overlap - is reordered too: each request gets the answer recorded
for it.

The mode says what must be equal (vcrpy's discipline: explicit modes, a typo fails loudly):

* `exact` (default): the messages and every other field of the request (model, tools,
  sampling parameters, stream) but the seed, which the recorder journals on its own and a
  replay has no use for (the answer comes from the journal).
* `messages`: the messages only (another model name or temperature still matches).
* `position`: nothing; a call equal to no recorded one gets its position's answer whatever it
  asks. Differences are still counted as divergences of the program's behaviour, they only
  do not stop it.

A miss is a diagnosis, never a bare "not found": the first differing field with both values,
and the nearest recorded call (the one sharing the longest run of leading messages).

**Tool-call ids.** The recorder names a tool call `call_<agent>_<n>_<i>` by the order n in
which it *received* the agent's calls (engine.program.wire), which is not the order they were
journaled in when they overlapped. `recorded_calls` recovers each call's n (`issued`) from
the requests that sent the ids back - a later request continuing the call's conversation
with an assistant message holding its tool calls - so a replay hands every answer the ids the
program saw while recording, whatever order the calls come in now. A call whose ids never
came back gets the lowest n no other call of its agent has, in step order (for a sequential
agent: its own position).
"""

from __future__ import annotations

import hashlib
import json
from collections import deque
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
    ordinal: int  # the agent's n-th call (0-based), in step order
    call: ev.LlmCall
    tools: list[ev.ToolCall]
    #: the n of its tool-call ids (`call_<agent>_<n>_<i>`): the order in which the proxy
    #: received the agent's calls, `ordinal` unless calls of the agent overlapped
    issued: int = -1

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
    issued = _issued(calls)
    return [msgspec.structs.replace(c, issued=issued[c.step]) for c in calls]


def _digest(h: Any, message: dict[str, str]) -> None:
    # canonical JSON objects delimit themselves: the digest of a concatenation names the list
    h.update(wire.canonical(message).encode())


def _echoed(message: dict[str, str], calls: list[RecordedCall]) -> tuple[list[RecordedCall], int]:
    """The calls (of `calls`, all ending where `message` stands in a later request) whose
    tool calls an assistant message may be sending back, and the n its ids carry."""
    try:
        sent = json.loads(message["tool_calls"])
        pairs = [(c["function"]["name"], c["function"]["arguments"]) for c in sent]
        ids = [c["id"] for c in sent]
    except (ValueError, TypeError, KeyError):
        return [], -1
    parts = ids[0].rsplit("_", 2) if ids and isinstance(ids[0], str) else []
    if len(parts) != 3 or not (parts[1].isascii() and parts[1].isdigit()):
        return [], -1
    n = int(parts[1])
    found = [
        c
        for c in calls
        if [(t.tool, t.param) for t in c.tools] == pairs
        and ids == [wire.tool_call_id(c.agent, n, i) for i in range(len(ids))]
    ]
    return found, n


def _issued(calls: list[RecordedCall]) -> dict[int, int]:
    """step -> the n of the call's tool-call ids while it was recorded (see the module's
    docstring): read from the later requests that sent them back, else the lowest n free."""
    learned: dict[int, int] = {}
    ends: dict[bytes, list[RecordedCall]] = {}  # digest of a call's messages -> the calls
    for c in calls:
        if c.tools:
            h = hashlib.blake2b(digest_size=16)
            for m in wire.messages_of(c.call.request):
                _digest(h, m)
            ends.setdefault(h.digest(), []).append(c)
    if ends:
        for r in calls:
            messages = wire.messages_of(r.call.request)
            if not any(m.get("role") == "assistant" and "tool_calls" in m for m in messages):
                continue
            h = hashlib.blake2b(digest_size=16)
            for m in messages:
                if m.get("role") == "assistant" and "tool_calls" in m:
                    before = [c for c in ends.get(h.digest(), ()) if c.step < r.step]
                    found, sent_n = _echoed(m, before) if before else ([], -1)
                    # equal calls with equal tool calls: the first whose ids are not known
                    # yet (ids known already are this message's or another call's)
                    echoed = next((c for c in found if learned.get(c.step, sent_n) == sent_n), None)
                    if echoed is not None:
                        learned[echoed.step] = sent_n
                _digest(h, m)
    out: dict[int, int] = {}
    taken: dict[str, set[int]] = {}
    for c in calls:
        known = learned.get(c.step)
        if known is not None and known not in taken.setdefault(c.agent, set()):
            out[c.step] = known
            taken[c.agent].add(known)
    lowest: dict[str, int] = {}  # per agent, no n below it is free
    for c in calls:
        if c.step not in out:
            used = taken.setdefault(c.agent, set())
            free = lowest.get(c.agent, 0)
            while free in used:
                free += 1
            out[c.step] = free
            used.add(free)
            lowest[c.agent] = free + 1
    return out


class Matcher:
    """Hands out a session's recorded calls, one per request, by the rule of the module's
    docstring. Not thread-safe: the proxy's session calls it under its lock."""

    def __init__(self, calls: Sequence[RecordedCall], mode: MatchMode) -> None:
        self.mode = mode
        self.calls = list(calls)
        self.used: set[int] = set()  # steps answered (or missed) already
        self.pending: dict[str, deque[RecordedCall]] = {}
        for c in self.calls:
            self.pending.setdefault(c.agent, deque()).append(c)
        # (level, agent, key) -> the agent's calls equal under that level, in step order;
        # built at the first request its position does not answer
        self._index: dict[tuple[MatchMode, str, str], deque[RecordedCall]] | None = None
        self.reordered = 0

    def _levels(self) -> tuple[MatchMode, ...]:
        if self.mode is MatchMode.EXACT:
            return (MatchMode.EXACT,)
        return (MatchMode.EXACT, MatchMode.MESSAGES)

    @staticmethod
    def _key(request: list[dict[str, str]], level: MatchMode) -> str:
        messages = wire.canonical(wire.messages_of(request))
        if level is MatchMode.MESSAGES:
            return messages
        return messages + "\n" + wire.canonical(wire.params_of(request))

    def _first(self, q: deque[RecordedCall]) -> RecordedCall | None:
        while q and q[0].step in self.used:
            q.popleft()
        return q[0] if q else None

    def _equal(
        self, agent: str, got: list[dict[str, str]], level: MatchMode
    ) -> RecordedCall | None:
        if self._index is None:
            self._index = {}
            for c in self.calls:
                for lv in (MatchMode.EXACT, MatchMode.MESSAGES):
                    k = (lv, c.agent, self._key(c.call.request, lv))
                    self._index.setdefault(k, deque()).append(c)
        q = self._index.get((level, agent, self._key(got, level)))
        return None if q is None else self._first(q)

    def position(self, agent: str) -> RecordedCall | None:
        """The agent's earliest recorded call not yet handed out."""
        q = self.pending.get(agent)
        return None if q is None else self._first(q)

    def claim(self, agent: str, got: list[dict[str, str]]) -> RecordedCall | None:
        """The recorded call that answers (or, when it does not match, diagnoses) a request of
        `agent`; None when every call of the agent was handed out. It is used up."""
        pos = self.position(agent)
        if pos is None:
            return None
        chosen = pos
        for level in self._levels():
            if first_difference(pos.call.request, got, level) is None:
                break
            found = self._equal(agent, got, level)
            if found is not None:
                chosen = found
                self.reordered += 1
                break
        self.used.add(chosen.step)
        return chosen


def _flat(v: Any) -> str:
    text = v if isinstance(v, str) else wire.canonical(v)
    return " ".join(text.split())


def _short(v: Any, n: int = 80) -> str:
    text = _flat(v)
    return repr(text if len(text) <= n else text[: n - 1] + "…")


def _around(a: Any, b: Any, n: int = 80) -> tuple[str, str]:
    """Both values shortly, each cut to the same window around where they first differ: two
    long values that differ past their first `n` characters (a tool call's id late in its
    JSON) would otherwise read as two equal texts."""
    x, y = _flat(a), _flat(b)
    if len(x) <= n and len(y) <= n:
        return repr(x), repr(y)
    i = 0
    while i < min(len(x), len(y)) and x[i] == y[i]:
        i += 1
    start = max(0, i - n // 4)

    def cut(t: str) -> str:
        head = "…" if start else ""
        part = t[start : start + n - len(head)]
        tail = "…" if start + len(part) < len(t) else ""
        return repr(head + (part[: len(part) - 1] if tail and part else part) + tail)

    return cut(x), cut(y)


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
    ra, rb = _around(a, b)
    return f"{field} differs: recorded {ra}, got {rb}"


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
