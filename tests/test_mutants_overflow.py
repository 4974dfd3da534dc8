"""A request longer than the server's context, against a scripted local server that refuses
more than a set number of messages as real servers do (llama.cpp's and OpenAI's bodies): how
much history the policy leaves out at each try, what it sends, and when it gives up.

test_context_overflow.py checks the same against a real small-context llama.cpp server; the
mutation runs leave that server out, so the arithmetic is pinned here."""

from __future__ import annotations

from typing import Any

import pytest
from llm_helpers import completion, planner_view, scripted_server

from engine.errors import PolicyError
from engine.policies.openai_policy import OpenAIPolicy, is_overflow

LLAMA_CPP = {
    "error": {
        "code": 400,
        "message": "the request exceeds the available context size, try increasing it",
        "type": "exceed_context_size_error",
    }
}
OPENAI = {
    "error": {
        "message": "This model's maximum context length is 256 tokens.",
        "type": "invalid_request_error",
        "code": "context_length_exceeded",
    }
}


def _messages(history: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "You plan."},
        *({"role": "user", "content": f"line {i}"} for i in range(history)),
        {"role": "user", "content": "Reply as planner."},
    ]


def _fits(most: int, status: int = 400, body: dict[str, Any] = LLAMA_CPP) -> Any:
    """A server that refuses a request of more than `most` messages."""

    def reply(request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        n = len(request["messages"])
        if n > most:
            return status, body
        return 200, completion(f"{n} messages", usage={"prompt_tokens": n, "completion_tokens": 1})

    return reply


def test_the_history_is_left_out_a_quarter_of_what_is_left_at_a_time() -> None:
    """40 history messages, a server that takes 11 messages: 10, 8, 6, 4 and 3 of them are
    left out in turn (a quarter of what is left, rounded up), the oldest first."""
    messages = _messages(40)
    with scripted_server(_fits(11)) as srv:
        done = OpenAIPolicy(srv.url, max_retries=0, timeout=30).decide(
            planner_view(), messages, seed=4
        )
    assert [len(r["messages"]) for r in srv.requests] == [42, 32, 24, 18, 14, 11]
    assert done.dropped == 31 and done.text == "11 messages" and done.prompt_tokens == 11
    assert srv.requests[-1]["messages"] == [messages[0], *messages[32:]]
    assert {r["seed"] for r in srv.requests} == {4}


@pytest.mark.parametrize(
    ("status", "body"), [(400, LLAMA_CPP), (400, OPENAI), (413, {"message": "context window"})]
)
def test_each_way_of_saying_too_long_is_answered_with_less_history(
    status: int, body: dict[str, Any]
) -> None:
    with scripted_server(_fits(3, status, body)) as srv:
        done = OpenAIPolicy(srv.url, max_retries=0, timeout=30).decide(
            planner_view(), _messages(2), 1
        )
    assert [len(r["messages"]) for r in srv.requests] == [4, 3]
    assert done.dropped == 1


def test_a_request_that_fits_is_sent_whole_once() -> None:
    messages = _messages(5)
    with scripted_server(_fits(7)) as srv:
        done = OpenAIPolicy(srv.url, max_retries=2, timeout=30).decide(planner_view(), messages, 1)
    assert srv.requests == [srv.requests[0]] and srv.requests[0]["messages"] == messages
    assert done.dropped == 0 and done.text == "7 messages"


def test_a_request_that_never_fits_fails_once_the_history_is_gone() -> None:
    with scripted_server(_fits(1)) as srv:
        policy = OpenAIPolicy(srv.url, max_retries=2, timeout=30)
        with pytest.raises(PolicyError) as caught:
            policy.decide(planner_view(), _messages(3), 1)
    assert [len(r["messages"]) for r in srv.requests] == [5, 4, 3, 2]
    assert str(caught.value) == (
        f"LLM server {srv.url!r} refused the request as longer than its context even without"
        " its 3 history messages: answered HTTP 400: the request exceeds the available context"
        " size, try increasing it"
    )


def test_without_history_a_refusal_is_final_at_once() -> None:
    with (
        scripted_server(_fits(1)) as srv,
        pytest.raises(PolicyError, match="even without its 0 history messages"),
    ):
        OpenAIPolicy(srv.url, timeout=30).decide(planner_view(), _messages(0), 1)
    assert len(srv.requests) == 1


@pytest.mark.parametrize(
    ("status", "body", "sent"),
    [
        # not about the context: no message is left out, nothing is retried
        (400, {"error": {"message": "temperature must be <= 2"}}, 1),
        # the words, but not a refusal of the request: a server error, retried as one
        (500, {"error": {"message": "context length exceeded"}}, 2),
        (422, {"error": {"code": "context_length_exceeded"}}, 1),
    ],
)
def test_other_refusals_are_not_answered_with_less_history(
    status: int, body: dict[str, Any], sent: int
) -> None:
    with scripted_server(_fits(0, status, body)) as srv:
        policy = OpenAIPolicy(srv.url, max_retries=1, timeout=30)
        with pytest.raises(PolicyError, match=f"answered HTTP {status}") as caught:
            policy.decide(planner_view(), _messages(4), 1)
    assert [len(r["messages"]) for r in srv.requests] == [6] * sent
    assert "history" not in str(caught.value)


@pytest.mark.parametrize(
    ("raw", "overflow"),
    [
        # the code alone, or the type alone, says it (the message says nothing of the context)
        (b'{"error": {"code": "context_length_exceeded", "message": "bad request"}}', True),
        (b'{"error": {"type": "exceed_context_size_error", "message": "bad request"}}', True),
        (b'{"error": {"code": "other", "type": "other", "message": "bad request"}}', False),
        # a body that is no JSON and no UTF-8: its words all the same
        (b"\xff\xfe context length exceeded \xff", True),
        (b"\xff\xfe bad request \xff", False),
        # only the first 4096 characters are searched: the words ending at 4096 are found,
        # the words ending one further are not
        (b"x" * 4082 + b"context length", True),
        (b"x" * 4083 + b"context length", False),
        (b'{"message": "' + b"x" * 4082 + b'context length"}', True),
        (b'{"message": "' + b"x" * 4083 + b'context length"}', False),
    ],
)
def test_what_is_read_as_too_long(raw: bytes, overflow: bool) -> None:
    assert is_overflow(raw) is overflow


def test_the_request_carries_the_policys_settings_and_the_seed() -> None:
    messages = _messages(1)
    with scripted_server(_fits(9)) as srv:
        OpenAIPolicy(srv.url, "mini", temperature=0.3, max_tokens=7, timeout=30).decide(
            planner_view(), messages, seed=12
        )
    (sent,) = srv.requests
    assert sent == {
        "model": "mini",
        "messages": messages,
        "seed": 12,
        "temperature": 0.3,
        "max_tokens": 7,
        "stream": False,
    }
