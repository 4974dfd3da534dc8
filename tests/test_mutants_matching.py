"""Which recorded call answers a replayed request, in this process: the matcher's rule (position,
then an equal unanswered call, level by level), the tool-call ids recovered from a journal's
later requests, and a miss's values shown around where they differ.

The recorded programs' own tests run `car record` and `car replay` as processes; these hold
the same rules against calls journaled here, in a real SQLite journal."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine import events as ev
from engine.journal import Journal
from engine.program import wire
from engine.program.matching import Matcher, MatchMode, RecordedCall, describe, recorded_calls

SYS = {"role": "system", "content": "You solve."}


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def _request(messages: list[dict[str, Any]], temperature: float = 0.5) -> list[dict[str, str]]:
    body = {"model": "m", "messages": messages, "temperature": temperature}
    return wire.request_entries(body, "derived")


def _asked(agent: str, n: int, tools: list[tuple[str, str]]) -> dict[str, Any]:
    """The assistant message a program sends back: the tool calls it was answered with."""
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": wire.tool_call_id(agent, n, i),
                "type": "function",
                "function": {"name": name, "arguments": args},
            }
            for i, (name, args) in enumerate(tools)
        ],
    }


Call = tuple[str, list[dict[str, Any]], float, list[tuple[str, str]]]


def _journal(tmp: Path, calls: list[Call]) -> list[RecordedCall]:
    """A run whose step k is the k-th call (agent, messages, temperature, tool calls
    answered), journaled; its recorded calls as a replay reads them."""
    with Journal(tmp / "j.db") as j:
        run = j.create_run("program")
        head = 0
        for step, (agent, messages, temperature, tools) in enumerate(calls):
            events: list[ev.Event] = [
                ev.LlmCall(
                    step=step,
                    agent=agent,
                    request=_request(messages, temperature),
                    seed=step,
                    model="m",
                    response=f"answer {step}",
                    finish_reason="tool_calls" if tools else "stop",
                )
            ]
            events += [ev.ToolCall(step=step, agent=agent, tool=t, param=p) for t, p in tools]
            head = j.append(run, events, head)
        return recorded_calls(j, run)


def _plain(tmp: Path, calls: list[tuple[str, str, float]]) -> list[RecordedCall]:
    """Calls of one user message each: (agent, text, temperature)."""
    return _journal(tmp, [(a, [SYS, _user(text)], t, []) for a, text, t in calls])


def _claims(m: Matcher, asks: list[tuple[str, str, float]]) -> list[int | None]:
    out = []
    for agent, text, temperature in asks:
        got = m.claim(agent, _request([SYS, _user(text)], temperature))
        out.append(None if got is None else got.step)
    return out


# ------------------------------------------------------------------ the matcher's rule


@pytest.mark.parametrize("mode", list(MatchMode))
def test_requests_in_another_order_each_get_their_own_recording(
    tmp_path: Path, mode: MatchMode
) -> None:
    calls = _plain(
        tmp_path,
        [("s", "a1", 0.5), ("s", "b1", 0.5), ("s", "a2", 0.5), ("s", "b2", 0.5), ("t", "a1", 0.5)],
    )
    m = Matcher(calls, mode)
    assert m.reordered == 0
    assert m.position("s") is calls[0] and m.position("t") is calls[4]
    # b1 and b2 before a1 and a2: each takes the equal call, later ones keep their places
    assert _claims(m, [("s", "b1", 0.5), ("s", "b2", 0.5)]) == [1, 3]
    assert m.reordered == 2
    assert m.position("s") is calls[0]
    assert _claims(m, [("s", "a1", 0.5), ("s", "a2", 0.5)]) == [0, 2]
    assert m.reordered == 2
    # every call of s was handed out; an agent never recorded has none
    assert m.position("s") is None
    assert _claims(m, [("s", "a1", 0.5), ("u", "a1", 0.5)]) == [None, None]
    # t asks what s was recorded asking: its own call, never another agent's
    assert _claims(m, [("t", "a1", 0.5)]) == [4]


def test_a_miss_uses_up_its_position_and_the_next_request_meets_the_next(
    tmp_path: Path,
) -> None:
    calls = _plain(tmp_path, [("s", "one", 0.5), ("s", "two", 0.5), ("s", "three", 0.5)])
    m = Matcher(calls, MatchMode.EXACT)
    # equal to nothing: its position is the answer to diagnose, and it is used up
    assert _claims(m, [("s", "nothing like it", 0.5)]) == [0]
    # equal to the call used up: the position (a miss again), not the used call
    assert _claims(m, [("s", "one", 0.5)]) == [1]
    assert _claims(m, [("s", "three", 0.5)]) == [2]
    assert m.reordered == 0


def test_equal_recorded_requests_are_answered_in_recorded_order(tmp_path: Path) -> None:
    calls = _plain(tmp_path, [("s", "p", 0.5), ("s", "q", 0.5), ("s", "r", 0.5), ("s", "q", 0.5)])
    m = Matcher(calls, MatchMode.EXACT)
    assert _claims(m, [("s", "q", 0.5), ("s", "q", 0.5), ("s", "p", 0.5), ("s", "r", 0.5)]) == [
        1,
        3,
        0,
        2,
    ]
    assert m.reordered == 2


def test_the_mode_says_which_level_may_reorder(tmp_path: Path) -> None:
    """Another temperature: `exact` holds the request against its position (a miss), the
    other modes take the call whose messages it equals; a call equal in every field is
    preferred to one equal in its messages only."""
    recorded = [("s", "a", 0.5), ("s", "b", 0.9), ("s", "b", 0.5)]
    calls = _plain(tmp_path, recorded)
    exact = Matcher(calls, MatchMode.EXACT)
    assert _claims(exact, [("s", "b", 0.7)]) == [0] and exact.reordered == 0
    for mode in (MatchMode.MESSAGES, MatchMode.POSITION):
        m = Matcher(calls, mode)
        assert _claims(m, [("s", "b", 0.7)]) == [1] and m.reordered == 1
        m = Matcher(calls, mode)
        assert _claims(m, [("s", "b", 0.5)]) == [2] and m.reordered == 1
        # equal in its messages to its position: the position, not reordered
        m = Matcher(calls, mode)
        assert _claims(m, [("s", "a", 0.1)]) == [0] and m.reordered == 0
    exact = Matcher(calls, MatchMode.EXACT)
    assert _claims(exact, [("s", "b", 0.5)]) == [2] and exact.reordered == 1


# ------------------------------------------------------------------ tool-call ids


def test_tool_call_ids_are_recovered_from_the_requests_that_sent_them_back(
    tmp_path: Path,
) -> None:
    """Two tasks of agent s overlapped: task b's call arrived first (its ids carry 0), task
    a's second (1), but a's answer was journaled first. Their follow-ups send the ids back;
    the follow-ups, whose ids never came back, get the lowest n left."""
    a, b = [SYS, _user("task a")], [SYS, _user("task b")]
    calls = _journal(
        tmp_path,
        [
            ("s", a, 0.5, [("calc", "1+1")]),
            ("s", b, 0.5, [("calc", "2+2")]),
            ("s", [*b, _asked("s", 0, [("calc", "2+2")]), _tool("call_s_0_0", "4")], 0.5, []),
            ("s", [*a, _asked("s", 1, [("calc", "1+1")]), _tool("call_s_1_0", "2")], 0.5, []),
            ("t", [SYS, _user("other")], 0.5, []),
        ],
    )
    assert [(c.agent, c.ordinal, c.issued) for c in calls] == [
        ("s", 0, 1),
        ("s", 1, 0),
        ("s", 2, 2),
        ("s", 3, 3),
        ("t", 0, 0),
    ]
    assert [t.param for t in calls[0].tools] == ["1+1"] and calls[2].tools == []


def _tool(call_id: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def test_equal_calls_learn_their_ids_in_the_order_they_were_sent_back(tmp_path: Path) -> None:
    same = [SYS, _user("same")]
    calls = _journal(
        tmp_path,
        [
            ("s", same, 0.5, [("calc", "1+1")]),
            ("s", same, 0.5, [("calc", "1+1")]),
            ("s", [*same, _asked("s", 1, [("calc", "1+1")]), _tool("call_s_1_0", "2")], 0.5, []),
            ("s", [*same, _asked("s", 0, [("calc", "1+1")]), _tool("call_s_0_0", "2")], 0.5, []),
        ],
    )
    assert [c.issued for c in calls] == [1, 0, 2, 3]


def _with_id(call_id: object) -> dict[str, Any]:
    """An assistant message sending back calc("1+1") under `call_id`."""
    call = {"id": call_id, "function": {"name": "calc", "arguments": "1+1"}}
    return {"role": "assistant", "tool_calls": [call]}


@pytest.mark.parametrize(
    ("sent", "why"),
    [
        (_asked("s", 5, [("calc", "9+9")]), "other tool calls"),
        (_asked("s", 5, [("calc", "1+1"), ("calc", "1+1")]), "more tool calls"),
        (_asked("x", 5, [("calc", "1+1")]), "another agent's ids"),
        (_with_id("call_s_x_0"), "no number in the id"),
        (_with_id("call_s_\uff15_0"), "a number that is not ASCII"),
        (_with_id("s_5"), "an id of two parts"),
        (_with_id(5), "an id that is no text"),
        ({"role": "assistant", "tool_calls": [{"function": {"name": "calc"}}]}, "no id"),
        ({"role": "assistant", "tool_calls": "not json"}, "not JSON"),
        ({"role": "assistant", "tool_calls": []}, "no tool call"),
        ({"role": "user", "tool_calls": _asked("s", 5, [("calc", "1+1")])["tool_calls"]}, "user"),
    ],
)
def test_ids_sent_back_that_name_no_call_teach_nothing(
    tmp_path: Path, sent: dict[str, Any], why: str
) -> None:
    first = [SYS, _user("first")]
    calls = _journal(
        tmp_path,
        [
            ("s", first, 0.5, [("calc", "1+1")]),
            ("s", [*first, sent, _tool("call_s_5_0", "2")], 0.5, []),
        ],
    )
    assert [c.issued for c in calls] == [0, 1], why


def test_ids_are_learned_from_a_later_request_only_and_an_n_taken_is_not_given_twice(
    tmp_path: Path,
) -> None:
    """Step 0's request holds tool calls with step 1's request before them: step 1 was not
    answered yet, so they are not its ids. Steps 2 and 3 both claim n 7 for calls of s: the
    first keeps it, the second gets the lowest n free."""
    x, y, z = [SYS, _user("x")], [SYS, _user("y")], [SYS, _user("z")]
    calls = _journal(
        tmp_path,
        [
            ("s", [*x, _asked("s", 5, [("calc", "1+1")]), _tool("call_s_5_0", "2")], 0.5, []),
            ("s", x, 0.5, [("calc", "1+1")]),
            ("s", y, 0.5, [("calc", "3+3")]),
            ("s", z, 0.5, [("calc", "3+3")]),
            ("s", [*y, _asked("s", 7, [("calc", "3+3")]), _tool("call_s_7_0", "6")], 0.5, []),
            ("s", [*z, _asked("s", 7, [("calc", "3+3")]), _tool("call_s_7_0", "6")], 0.5, []),
        ],
    )
    assert [c.issued for c in calls] == [0, 1, 7, 2, 3, 4]


def test_a_request_that_sends_back_two_answers_teaches_both(tmp_path: Path) -> None:
    """One conversation carrying two answered calls of s (the second asked after the
    first's tool result): both calls learn their n from it."""
    one = [SYS, _user("go")]
    two = [*one, _asked("s", 3, [("calc", "1+1")]), _tool("call_s_3_0", "2")]
    calls = _journal(
        tmp_path,
        [
            ("s", one, 0.5, [("calc", "1+1")]),
            ("s", two, 0.5, [("calc", "2+2")]),
            ("s", [*two, _asked("s", 4, [("calc", "2+2")]), _tool("call_s_4_0", "4")], 0.5, []),
        ],
    )
    assert [c.issued for c in calls] == [3, 4, 0]
    # the recorded messages as the journal keeps them: the tool calls in canonical JSON
    assert json.loads(wire.messages_of(calls[1].call.request)[2]["tool_calls"])[0]["id"] == (
        "call_s_3_0"
    )


# ------------------------------------------------------------------ a miss's values


def test_a_long_miss_is_cut_to_the_same_window_around_the_first_difference() -> None:
    def shown(a: str, b: str) -> tuple[str, str]:
        text = describe(("f", a, b))
        assert text.startswith("f differs: recorded ")
        left, right = text.removeprefix("f differs: recorded ").split(", got ")
        return left, right

    # both at most 80 characters: whole
    assert shown("a" * 80, "a" * 79 + "b") == (repr("a" * 80), repr("a" * 79 + "b"))
    # a difference at the start of long values: their first 79 characters and an ellipsis
    x, y = "X" + "c" * 200, "Y" + "c" * 200
    assert shown(x, y) == (repr(x[:79] + "…"), repr(y[:79] + "…"))
    # a difference at 100 of 201: from 20 before it, 78 characters between two ellipses
    x, y = "a" * 100 + "X" + "b" * 100, "a" * 100 + "Y" + "b" * 100
    assert shown(x, y) == (repr("…" + x[80:158] + "…"), repr("…" + y[80:158] + "…"))
    # near the end: no ellipsis after it
    x, y = "a" * 100 + "X" + "b" * 10, "a" * 100 + "Y" + "b" * 10
    assert shown(x, y) == (repr("…" + x[80:]), repr("…" + y[80:]))
    # a difference at 20 starts at 0; at 21 at 1
    x, y = "a" * 20 + "X" + "b" * 100, "a" * 20 + "Y" + "b" * 100
    assert shown(x, y) == (repr(x[:79] + "…"), repr(y[:79] + "…"))
    x, y = "a" * 21 + "X" + "b" * 100, "a" * 21 + "Y" + "b" * 100
    assert shown(x, y) == (repr("…" + x[1:79] + "…"), repr("…" + y[1:79] + "…"))
    # one value a prefix of the other: they differ where the short one ends
    x, y = "abc", "abc" + "d" * 100
    assert shown(x, y) == (repr(x), repr(y[:79] + "…"))
    x, y = "e" * 90, "e" * 90 + "f" * 100
    assert shown(x, y) == (repr("…" + x[70:]), repr("…" + y[70:148] + "…"))
    # whitespace runs read as one space
    assert shown("a  b\n c", "a b c!") == (repr("a b c"), repr("a b c!"))


def test_a_message_new_or_missing_is_named_whole() -> None:
    message = {"role": "user", "content": "hello"}
    assert describe(("messages[3]", None, message)) == (
        "messages[3] is new (got 'user: hello'; the recording has none)"
    )
    assert describe(("messages[3]", message, None)) == (
        "messages[3] is missing (recorded 'user: hello')"
    )
    assert describe(("messages[1]", {"role": "assistant", "tool_calls": "[]"}, message)) == (
        "messages[1] differs: recorded 'assistant: tool_calls', got 'user: hello'"
    )


def test_a_call_whose_ids_never_came_back_gets_the_lowest_n_left(tmp_path: Path) -> None:
    """Step 0's ids came back with n 0; step 1's never did: it gets 1, the lowest n no other
    call of s has, and step 2 the next."""
    x = [SYS, _user("x")]
    calls = _journal(
        tmp_path,
        [
            ("s", x, 0.5, [("calc", "1+1")]),
            ("s", [SYS, _user("y")], 0.5, []),
            ("s", [*x, _asked("s", 0, [("calc", "1+1")]), _tool("call_s_0_0", "2")], 0.5, []),
        ],
    )
    assert [c.issued for c in calls] == [0, 1, 2]


def test_only_an_assistant_message_after_a_calls_messages_sends_its_ids_back(
    tmp_path: Path,
) -> None:
    """A later request holds the tool calls of step 0 twice where they name nothing: in a
    user message right after step 0's messages, and in an assistant message after messages
    no call was sent. Neither teaches step 0 its n."""
    first = [SYS, _user("first")]
    echoed = _asked("s", 5, [("calc", "1+1")])
    calls = _journal(
        tmp_path,
        [
            ("s", first, 0.5, [("calc", "1+1")]),
            (
                "s",
                [*first, {**echoed, "role": "user"}, _user("elsewhere"), echoed],
                0.5,
                [],
            ),
        ],
    )
    assert [c.issued for c in calls] == [0, 1]
