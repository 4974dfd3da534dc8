"""The contract between attribution estimators and anything that can be re-run forward.

A `ForwardModel` is one failed factual run plus the machinery to re-run it under interventions:
synthetic SCMs implement it here, recorded runs implement it over the journal's forks (the
heist's in engine/heist/forward_model.py). The estimators only ever speak this protocol, so
whatever is validated against an SCM's exact ground truth is the same code that attributes a
recorded run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import Protocol, TypeVar

import msgspec

from engine.errors import ConfigError

#: Called as forward runs complete: (runs done so far, total planned or None when adaptive).
Progress = Callable[[int, int | None], None]

_E = TypeVar("_E", bound=StrEnum)


def parse_enum(cls: type[_E], value: str | _E, what: str) -> _E:
    """The member of `cls` for `value`; a typo fails loudly, naming `what` and the valid values."""
    try:
        return cls(value)
    except ValueError as e:
        valid = ", ".join(repr(m.value) for m in cls)
        raise ConfigError(f"{what} must be one of {valid}, got {value!r}") from e


class ForwardRequest(msgspec.Struct, frozen=True):
    """One forward run: which steps keep their factual action, and the branch's random source.

    Steps in `keep` take their factual action (forced with do_action where the policy would not
    reproduce it). Every other step is re-decided by the unchanged policy. Step j's randomness
    comes only from (branch_seed, j), so two requests with the same branch_seed share random
    numbers step by step (common random numbers): the contrastive run at step k is
    `keep={0..k-1}`, the Shapley value of a coalition S is `keep=S`.
    """

    keep: frozenset[int]
    branch_seed: int


class ForwardModel(Protocol):
    """A failed factual run that can be re-run forward under interventions."""

    @property
    def n_steps(self) -> int: ...

    @property
    def step_agents(self) -> Sequence[str | None]:
        """The agent of each step (None for steps no agent owns), for players="agents"."""
        ...

    @property
    def step_labels(self) -> Sequence[str]:
        """A short human label of each step."""
        ...

    def run_batch(self, requests: Sequence[ForwardRequest]) -> list[bool]:
        """One bool per request, True when that forward run's outcome is bad.

        May execute the requests concurrently; the estimators hand over whole batches so that
        a model backed by an LLM server can keep it busy.
        """
        ...


class PlayersKind(StrEnum):
    """Who the Shapley players are: single steps, or agents (an agent's steps move together)."""

    STEPS = "steps"
    AGENTS = "agents"

    @classmethod
    def parse(cls, value: str | PlayersKind) -> PlayersKind:
        """The enum member for `value`; a typo fails loudly with the valid values."""
        return parse_enum(cls, value, "players")


class Player(msgspec.Struct, frozen=True):
    """A Shapley player: a name and the steps that join or leave a coalition together."""

    name: str
    steps: tuple[int, ...]


def players_of(model: ForwardModel, players: str | PlayersKind) -> list[Player]:
    """The players of `model`: one per step, or one per agent plus one per agent-less step.

    Agents are listed in order of their first step. A step without an agent is its own player,
    named by its label; if that label collides with an agent's name it is prefixed "step ".
    """
    kind = PlayersKind.parse(players)
    labels = list(model.step_labels)
    if kind is PlayersKind.STEPS:
        return [Player(name=labels[j], steps=(j,)) for j in range(model.n_steps)]
    agents = list(model.step_agents)
    agent_names = {a for a in agents if a is not None}
    groups: dict[str, list[int]] = {}
    for j in range(model.n_steps):
        agent = agents[j]
        if agent is not None:
            groups.setdefault(agent, []).append(j)
            continue
        name = labels[j] if labels[j] not in agent_names else f"step {labels[j]}"
        if name in groups:  # two agent-less steps with one label stay separate players
            name = f"{name} #{j}"
        groups[name] = [j]
    return [Player(name=name, steps=tuple(steps)) for name, steps in groups.items()]


def report_progress(progress: Progress | None, done: int, total: int | None) -> None:
    """Call the optional progress callback."""
    if progress is not None:
        progress(done, total)
