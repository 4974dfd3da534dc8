"""A request longer than the model server's context: the oldest history is left out, not the run.

A run that failed at the first request to overflow would fail at the mole's turn more often
than at anyone else's (its system prompt holds its secret instructions, so its requests are
the longest), and the step a run failed at is public (decision 54)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from llm_helpers import planner_view

from engine import events as ev
from engine.errors import PolicyError, ReplayDivergence
from engine.heist.session import record_heist
from engine.heist.sim import SimPolicy
from engine.journal import Journal
from engine.policies.base import AgentView, Completion, history_length, trim_history
from engine.policies.openai_policy import OpenAIPolicy, is_overflow
from engine.replay import RecordedStep, _view_and_messages, check_requests, recorded_steps
from engine.scenario import stepped_for

ROOT = Path(__file__).resolve().parent.parent

#: smaller than any agent's system prompt alone (~440-510 tokens with SmolLM2's template)
SMALL_CTX = 256


@pytest.fixture(scope="module")
def small_server() -> Iterator[str]:
    """A real llama.cpp server (SmolLM2-135M) whose context holds 256 tokens."""
    from servers import llama_server

    with llama_server(n_ctx=SMALL_CTX) as url:
        yield url


def _history(n: int) -> list[dict[str, str]]:
    return [
        {"role": "user", "content": f"agent{i % 6}: the guard gap is 01:{i:02d}-01:{i + 20:02d}"}
        for i in range(n)
    ]


# ------------------------------------------------------------------ trimming, by itself


def test_trim_history_keeps_the_system_prompt_and_the_turns_prompt() -> None:
    messages = [{"role": "system", "content": "s"}, *_history(4), {"role": "user", "content": "t"}]
    assert history_length(messages) == 4
    assert trim_history(messages, 0) is messages
    assert trim_history(messages, 3) == [messages[0], messages[4], messages[5]]
    assert trim_history(messages, 4) == [messages[0], messages[5]]
    with pytest.raises(ValueError, match="cannot leave out 5 of 6"):
        trim_history(messages, 5)
    assert history_length([{"role": "system", "content": "s"}]) == 0


def test_trim_history_leaves_out_one_message_when_asked_for_one() -> None:
    """The policy's first retry of a short history leaves out one message: the oldest."""
    messages = [{"role": "system", "content": "s"}, *_history(2), {"role": "user", "content": "t"}]
    assert trim_history(messages, 1) == [messages[0], messages[2], messages[3]]
    assert trim_history(messages, -1) is messages


@pytest.mark.parametrize(
    ("body", "overflow"),
    [
        # llama-cpp-python and OpenAI
        (
            {
                "error": {
                    "message": "This model's maximum context length is 256 tokens.",
                    "type": "invalid_request_error",
                    "code": "context_length_exceeded",
                }
            },
            True,
        ),
        # llama.cpp's own server
        (
            {
                "error": {
                    "code": 400,
                    "message": "the request exceeds the available context size, try increasing it",
                    "type": "exceed_context_size_error",
                }
            },
            True,
        ),
        # only the words say it
        ({"error": {"message": "prompt is too long for this model"}}, True),
        ({"error": "Trying to keep 900 tokens when the context length is 512"}, True),
        ({"message": "maximum context exceeded"}, True),
        # not JSON: the words
        (b"context window exceeded", True),
        # other refusals
        ({"error": {"message": "model 'x' not found", "code": "model_not_found"}}, False),
        ({"error": {"message": "temperature must be <= 2"}}, False),
        (b"Bad Request", False),
        ({"error": {"code": 400}}, False),
    ],
)
def test_overflow_replies_are_told_from_other_refusals(body: object, overflow: bool) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    assert is_overflow(raw) is overflow


# ------------------------------------------------------------------ a real small-context server


def test_the_policy_leaves_out_the_oldest_history_until_the_request_fits(
    small_server: str,
) -> None:
    """40 history messages (~20 tokens each) cannot fit 256 tokens; the server refuses, the
    policy leaves out the oldest until it answers, and says how many."""
    messages = [
        {"role": "system", "content": "You are a crew member. Answer in one line."},
        *_history(40),
        {"role": "user", "content": "Reply as planner."},
    ]
    policy = OpenAIPolicy(small_server, max_tokens=4, timeout=120)
    done = policy.decide(planner_view(), messages, seed=1)
    assert 0 < done.dropped < 40
    # what was answered fits, and the step before it (one message more) did not have to
    assert done.prompt_tokens < SMALL_CTX
    assert isinstance(done.text, str)


def test_a_request_that_cannot_fit_fails_in_one_line(small_server: str) -> None:
    """A system prompt longer than the whole context fails the call whatever is left out,
    and says so."""
    messages = [
        {"role": "system", "content": "the plan needs a guard gap. " * 80},
        *_history(3),
        {"role": "user", "content": "Reply as planner."},
    ]
    policy = OpenAIPolicy(small_server, max_tokens=4, timeout=120)
    with pytest.raises(PolicyError, match="even without its 3 history messages") as caught:
        policy.decide(planner_view(), messages, seed=1)
    assert "\n" not in str(caught.value)


def test_a_heist_that_cannot_fit_does_not_print_the_servers_token_counts(
    small_server: str, tmp_path: Path
) -> None:
    """Every system prompt is longer than 256 tokens: the heist fails at its first step, and
    neither its JSON nor its one-line error repeats the server's message, which counts the
    acting agent's tokens (the mole's prompt is the longest); --reveal on `car show` does."""
    journal = tmp_path / "j.db"
    res = subprocess.run(
        [sys.executable, "-m", "cli", "--journal", str(journal), "heist", "--policy", "openai",
         "--base-url", small_server, "--seed", "3", "--rounds", "1", "--max-tokens", "4",
         "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 1, res.stderr
    data = json.loads(res.stdout)
    assert data["status"] == "failed" and data["steps"] == 0
    assert "longer than its context" in data["error"]
    for text in (data["error"], res.stderr):
        assert "tokens" not in text and "with --reveal" in text
    shown = subprocess.run(
        [sys.executable, "-m", "cli", "--journal", str(journal), "show", data["run_id"],
         "--reveal"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert shown.returncode == 0 and "maximum context length is 256 tokens" in shown.stdout


# ------------------------------------------------------------------ what the journal keeps


class _Trimming:
    """The real sim policy, answering as a server with a small context would be answered:
    from the fourth history message on, the two oldest were left out."""

    name = "sim"

    def __init__(self, dropped: int = 2) -> None:
        self.inner = SimPolicy()
        self.dropped = dropped

    def decide(self, view: AgentView, messages: list[dict[str, str]], seed: int) -> Completion:
        done = self.inner.decide(view, messages, seed)
        if history_length(messages) >= 4:
            return msgspec.structs.replace(done, dropped=self.dropped)
        return done


def test_the_request_sent_is_recorded_and_rebuilt_from_the_state(tmp_path: Path) -> None:
    """The recorded request is the rendered one without the left-out messages, `dropped` says
    how many; the request check rebuilds it from s_k, and it survives the stored form."""
    with Journal(tmp_path / "j.db") as j:
        run = record_heist(j, _Trimming(), seed=7).run_id
        calls = [e for e in j.events(run) if isinstance(e, ev.LlmCall)]
        trimmed = [c for c in calls if c.dropped]
        assert trimmed and all(c.dropped == 2 for c in trimmed)
        assert not any(c.dropped for c in calls[:3])
        steps = list(recorded_steps(j, run))
        scenario = stepped_for(steps[0].state, "the test")
        for step in steps:
            rendered = scenario.messages(scenario.view(step.state, run))
            assert step.call.request == trim_history(rendered, step.call.dropped)
        assert check_requests(j, run).ok
        assert j.verify().ok


def test_a_recorded_call_that_left_out_more_than_the_history_is_a_divergence(
    tmp_path: Path,
) -> None:
    with Journal(tmp_path / "j.db") as j:
        run = record_heist(j, SimPolicy(), seed=7, rounds=1).run_id
        step = list(recorded_steps(j, run))[2]
        scenario = stepped_for(step.state, "the test")
        bad = RecordedStep(
            step.step, step.agent, step.state, msgspec.structs.replace(step.call, dropped=3)
        )
        with pytest.raises(ReplayDivergence, match="left out 3 messages of a history of 2"):
            _view_and_messages(scenario, bad, run)
        # the whole history left out: the system prompt and the turn's prompt
        whole = RecordedStep(
            step.step, step.agent, step.state, msgspec.structs.replace(step.call, dropped=2)
        )
        _, messages = _view_and_messages(scenario, whole, run)
        rendered = scenario.messages(scenario.view(step.state, run))
        assert messages == [rendered[0], rendered[-1]] and len(rendered) == 4


def test_a_policy_that_says_it_left_out_more_than_it_was_given_fails_the_step(
    tmp_path: Path,
) -> None:
    with Journal(tmp_path / "j.db") as j:
        result = record_heist(j, _Trimming(dropped=99), seed=7, rounds=1)
        assert result.status == "failed" and result.steps == 4
        assert "left out 99 of the 4 history messages" in (result.error or "")
        assert j.status(result.run_id) == "failed" and j.verify().ok


def test_fidelity_says_when_the_server_left_out_more_than_was_recorded() -> None:
    """A replay against a server with a smaller context than when recorded is sent less than
    was recorded: its divergence says so rather than blaming the model."""
    from engine.replay import StepMatch, _report

    common = dict(
        agent="hacker", exact=False, normalised=False, recorded="a", new="b",
        recorded_model="m", new_model="m", recorded_fingerprint=None, new_fingerprint=None,
    )  # fmt: skip
    report = _report(
        "r",
        {"name": "openai"},
        2,
        0,
        [StepMatch(step=0, dropped=3, **common), StepMatch(step=1, **common)],  # type: ignore[arg-type]
    )
    first, second = (d["provenance"]["explanation"] for d in report.divergences)
    assert "without 3 more of its oldest history messages" in first
    assert "nondeterminism" in second
