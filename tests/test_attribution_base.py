"""The estimators' shared contract: who the Shapley players are (steps, or agents with the
agent-less steps on their own, names kept apart), and the enum parsing behind every option."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from engine.attribution import ForwardRequest
from engine.attribution.base import Player, PlayersKind, parse_enum, players_of, report_progress
from engine.attribution.contrastive import ContrastiveMode
from engine.errors import ConfigError


class Labelled:
    """A forward model reduced to what players_of reads: labels and agents."""

    def __init__(self, labels: Sequence[str], agents: Sequence[str | None]) -> None:
        self.step_labels = list(labels)
        self.step_agents = list(agents)
        self.n_steps = len(labels)

    def run_batch(self, requests: Sequence[ForwardRequest]) -> list[bool]:
        return [True for _ in requests]


def test_steps_are_players_one_each_named_by_label() -> None:
    """players='steps': one player per step, named by its label, whatever the agents."""
    model = Labelled(["a", "b", "a"], ["x", "x", None])
    assert players_of(model, "steps") == [Player("a", (0,)), Player("b", (1,)), Player("a", (2,))]
    assert players_of(model, PlayersKind.STEPS) == players_of(model, "steps")


def test_agents_group_their_steps_in_order_of_first_step() -> None:
    """players='agents': an agent's steps form one player, listed at its first step; a step
    without an agent is its own player named by its label."""
    model = Labelled(["plan", "look", "cut", "go"], ["b", None, "a", "b"])
    assert players_of(model, "agents") == [
        Player("b", (0, 3)),
        Player("look", (1,)),
        Player("a", (2,)),
    ]


def test_agentless_names_never_collide() -> None:
    """An agent-less step whose label is an agent's name is called "step <label>"; two
    agent-less steps with one label stay two players, the later one suffixed "#<step>"."""
    model = Labelled(["x", "bob", "x", "bob"], [None, None, "bob", None])
    assert players_of(model, "agents") == [
        Player("x", (0,)),
        Player("step bob", (1,)),
        Player("bob", (2,)),
        Player("step bob #3", (3,)),
    ]
    twice = Labelled(["y", "y", "y"], [None, None, None])
    assert [p.name for p in players_of(twice, "agents")] == ["y", "y #1", "y #2"]


def test_parse_enum_names_the_option_and_the_valid_values() -> None:
    """A typo is a ConfigError naming what was parsed, every valid value and the bad one;
    a member or its value parses to the member."""
    assert parse_enum(PlayersKind, "agents", "players") is PlayersKind.AGENTS
    assert parse_enum(PlayersKind, PlayersKind.STEPS, "players") is PlayersKind.STEPS
    with pytest.raises(ConfigError, match=r"^players must be one of 'steps', 'agents', got 'x'$"):
        parse_enum(PlayersKind, "x", "players")
    with pytest.raises(
        ConfigError, match=r"^contrastive mode must be one of 'fixed', 'adaptive', got 'Fixed'$"
    ):
        ContrastiveMode.parse("Fixed")
    with pytest.raises(ConfigError, match=r"^players must be one of 'steps', 'agents', got 'a'$"):
        players_of(Labelled(["s"], [None]), "a")


def test_report_progress_calls_back_only_when_given() -> None:
    """The progress callback receives (done, total) as given; no callback is no call."""
    calls: list[tuple[int, int | None]] = []
    report_progress(lambda d, t: calls.append((d, t)), 3, None)
    report_progress(lambda d, t: calls.append((d, t)), 5, 9)
    report_progress(None, 7, 9)
    assert calls == [(3, None), (5, 9)]
