"""The contract between the runtime and every policy (sim, openai, ...).

At step k the runtime renders the acting agent's view of s_k into an `AgentView` (structured) and
into chat `messages` (what an LLM would be sent). The policy returns a `Completion`; the runtime's
recorder journals the request, seed and completion before any tool runs.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from engine.errors import PolicyError


class ChatLine(msgspec.Struct, frozen=True):
    """One public chat message of the conversation so far."""

    step: int
    agent: str
    text: str


class Observation(msgspec.Struct, frozen=True):
    """One tool result, private to the agent that called the tool."""

    step: int
    tool: str
    param: str
    ok: bool
    output: str


class AgentView(msgspec.Struct, frozen=True):
    """What the acting agent sees at step k: a projection of s_k."""

    run_id: str
    step: int
    round: int
    agent: str
    role: str
    system_prompt: str  # includes the secret mole instructions when this agent is the mole
    agents: tuple[str, ...]
    transcript: tuple[ChatLine, ...]  # public messages, oldest first (bounded window)
    observations: tuple[Observation, ...]  # this agent's own tool results, oldest first
    mole_strategy: str | None = None  # set only in the mole's own view
    rounds: int = 0  # total rounds planned for the run


class Completion(msgspec.Struct, frozen=True):
    """A policy's answer: the action text plus the provenance an LLM server reports."""

    text: str
    model: str
    finish_reason: str = "stop"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    system_fingerprint: str | None = None
    #: the oldest messages of the history left out of the request that was answered
    #: (`trim_history`): a model server refused the whole as longer than its context
    dropped: int = 0


def trim_history(messages: list[dict[str, str]], dropped: int) -> list[dict[str, str]]:
    """`messages` without the `dropped` oldest of its history: the first message (the system
    prompt) and the last (the turn's prompt) always stay, so at most len - 2 can go."""
    if dropped <= 0:
        return messages
    if dropped > len(messages) - 2:
        raise ValueError(f"cannot leave out {dropped} of {len(messages)} messages")
    return [messages[0], *messages[1 + dropped :]]


def history_length(messages: list[dict[str, str]]) -> int:
    """How many messages `trim_history` may leave out of `messages`."""
    return max(0, len(messages) - 2)


class PolicyCancelled(PolicyError):
    """A policy call was aborted on request (Ctrl-C, a stop from the dashboard): the run is
    stopped, not failed."""


class Policy(Protocol):
    """Maps (view, messages, seed) to a Completion. Must be deterministic given the seed
    whenever the underlying model is (the sim policy always is, unless its drift knob is set)."""

    name: str

    def decide(self, view: AgentView, messages: list[dict[str, str]], seed: int) -> Completion: ...
