"""The in-process API (engine.program.client): a wrapped `openai.OpenAI` client journals its
calls, a decorated tool journals its calls and results, a replay answers from the journal,
and do_observation replaces a decorated tool's result in a fork."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from program_helpers import CannedServer

from engine import events as ev
from engine.interventions import DoObservation
from engine.journal import Journal
from engine.program.client import fork_recording, recording, replaying


@pytest.fixture(scope="module")
def canned() -> Iterator[CannedServer]:
    with CannedServer() as s:
        yield s


def program(client: openai.OpenAI, lookup: object) -> str:
    """A two-call program whose tool (not called through OpenAI tool calling) feeds call 2."""
    first = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
    found = lookup(first.choices[0].message.content)  # type: ignore[operator]
    second = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": f"looked up: {found}"}]
    )
    return second.choices[0].message.content or ""


def _run(rec: object, client: openai.OpenAI) -> str:
    @rec.tool  # type: ignore[attr-defined]
    def lookup(text: str) -> str:
        return f"{len(text)} chars"

    return program(rec.wrap(client, agent="scout"), lookup)  # type: ignore[attr-defined]


def test_wrapped_client_and_tool_are_journaled(tmp_path: Path, canned: CannedServer) -> None:
    """Two calls of agent 'scout', the tool's call and result at the first call's step, the
    outcome set by the program in RunEnded."""
    client = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="x", max_retries=0)
    with Journal(tmp_path / "j.db") as j:
        with recording(j, upstream=canned.base_url) as rec:
            _run(rec, client)
            rec.outcome(bad=True)
        events = j.events(rec.run_id)
    calls = [e for e in events if isinstance(e, ev.LlmCall)]
    assert [(c.step, c.agent) for c in calls] == [(0, "scout"), (1, "scout")]
    (call,) = [e for e in events if isinstance(e, ev.ToolCall)]
    (result,) = [e for e in events if isinstance(e, ev.ToolResult)]
    assert (call.step, call.tool, result.step, result.ok) == (0, "lookup", 0, True)
    assert result.output.endswith(" chars")
    end = events[-1]
    assert isinstance(end, ev.RunEnded) and end.outcome == {"bad": True, "calls": 2}


def test_replaying_answers_from_the_journal(tmp_path: Path, canned: CannedServer) -> None:
    """Under `replaying` the same program gets the recorded answers with no server at all."""
    client = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="x", max_retries=0)
    with Journal(tmp_path / "j.db") as j:
        with recording(j, upstream=canned.base_url) as rec:
            recorded = _run(rec, client)
        with replaying(j, rec.run_id) as rep:
            assert _run(rep, client) == recorded
        assert all(c["exact"] for c in rep.session.checks) and len(rep.session.checks) == 2


def test_do_observation_replaces_a_decorated_tools_result(
    tmp_path: Path, canned: CannedServer
) -> None:
    """In a fork with do_observation at call 0 the decorated tool does not run: it returns the
    intervention's text, which the next (live) call carries upstream and the branch journals."""
    client = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="x", max_retries=0)
    with Journal(tmp_path / "j.db") as j:
        with recording(j, upstream=canned.base_url) as rec:
            _run(rec, client)
        before = len(canned.requests)
        with fork_recording(j, rec.run_id, DoObservation(0, "999 chars")) as branch:
            _run(branch, client)
        assert len(canned.requests) == before + 1  # call 0 came from the journal
        assert canned.requests[-1]["messages"][0]["content"] == "looked up: 999 chars"
        own = j.events(branch.run_id)
        results = [e for e in own if isinstance(e, ev.ToolResult)]
        assert results[-1].output == "999 chars" and results[-1].step == 0
