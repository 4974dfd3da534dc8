"""The mole draw, its strategies, and the verdict on the user's accusation."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from scipy import stats

from engine.errors import ConfigError
from engine.heist.config import load_agents_config
from engine.heist.controller import HeistController, Verdict, accuse
from engine.heist.mole import Strategy, choose_mole, instructions, parse_strategy

CREW = ("planner", "hacker", "safecracker", "intel", "driver", "lookout")


@pytest.mark.parametrize(
    ("suspect", "verdict"),
    [
        ("intel", Verdict.SUCCESS),
        (" intel ", Verdict.SUCCESS),
        ("hacker", Verdict.FAILURE),
        ("lookout", Verdict.FAILURE),
        (None, Verdict.BUSTED),
        ("", Verdict.BUSTED),
        ("   ", Verdict.BUSTED),
    ],
)
def test_verdicts(suspect: str | None, verdict: Verdict) -> None:
    """SUCCESS names the mole, FAILURE a wrong agent, BUSTED nobody."""
    assert accuse("intel", suspect, CREW) is verdict


@pytest.mark.parametrize(
    ("mole", "suspect", "message"),
    [
        ("intel", "zorro", "unknown suspect 'zorro'; agents are: planner, hacker"),
        ("intel", "Intel", "unknown suspect 'Intel'"),
        ("zorro", "intel", "mole 'zorro' is not in the crew"),
    ],
)
def test_unknown_names(mole: str, suspect: str, message: str) -> None:
    """Naming an agent outside the crew is a ConfigError, not a silent FAILURE."""
    with pytest.raises(ConfigError, match=message):
        accuse(mole, suspect, CREW)


def test_controller_reveals_after_verdict() -> None:
    """The controller judges accusations and reveals the mole and its strategy."""
    ctl = HeistController(CREW, "driver", Strategy.SUBTLE_DELAYS)
    assert ctl.accuse("driver") is Verdict.SUCCESS
    assert ctl.accuse("planner") is Verdict.FAILURE
    assert ctl.accuse(None) is Verdict.BUSTED
    assert ctl.reveal() == ("driver", Strategy.SUBTLE_DELAYS)
    with pytest.raises(ConfigError, match="mole 'ghost' is not in the crew"):
        HeistController(CREW, "ghost", Strategy.FALSE_INFO)


@pytest.mark.parametrize(
    ("name", "strategy"),
    [
        ("TIMING_ERRORS", Strategy.TIMING_ERRORS),
        ("false_info", Strategy.FALSE_INFO),
        ("coordination-chaos", Strategy.COORDINATION_CHAOS),
        (" SUBTLE_DELAYS ", Strategy.SUBTLE_DELAYS),
        ("Wrong_Tools", Strategy.WRONG_TOOLS),
    ],
)
def test_parse_strategy(name: str, strategy: Strategy) -> None:
    """Strategy names parse case-insensitively, with - or _."""
    assert parse_strategy(name) is strategy


@pytest.mark.parametrize("name", ["FALSE_INFOS", "", "timing", "chaos", "None"])
def test_parse_strategy_typo_fails_loudly(name: str) -> None:
    """A misspelt strategy fails and lists every valid one."""
    with pytest.raises(
        ConfigError,
        match=r"unknown mole strategy .*; valid strategies: TIMING_ERRORS, FALSE_INFO, "
        "COORDINATION_CHAOS, SUBTLE_DELAYS, WRONG_TOOLS",
    ):
        parse_strategy(name)


def test_instructions_are_distinct_and_secret() -> None:
    """Each strategy has its own secret instruction text naming it."""
    texts = {s: instructions(s) for s in Strategy}
    assert len(set(texts.values())) == 5
    for s, text in texts.items():
        assert text.startswith("SECRET: you are the mole.") and s.value in text


def test_choose_mole_is_seeded() -> None:
    """The same random source picks the same mole and strategy."""
    a = choose_mole(CREW, random.Random(3))
    assert a == choose_mole(CREW, random.Random(3))
    assert choose_mole(CREW, random.Random(3), Strategy.WRONG_TOOLS)[1] is Strategy.WRONG_TOOLS


def test_choose_mole_accepts_specs() -> None:
    """Agents may be names or AgentSpecs; the chosen element is returned as given."""
    specs = load_agents_config().agents
    mole, _ = choose_mole(specs, random.Random(0))
    assert mole in specs


def test_choose_mole_is_uniform() -> None:
    """Over 3000 draws every agent and every strategy is equally likely (chi-square, p > 0.001)."""
    rng = random.Random(2024)
    draws = [choose_mole(CREW, rng) for _ in range(3000)]
    agents = Counter(m for m, _ in draws)
    strategies = Counter(s for _, s in draws)
    assert set(agents) == set(CREW) and set(strategies) == set(Strategy)
    assert stats.chisquare(list(agents.values())).pvalue > 0.001
    assert stats.chisquare(list(strategies.values())).pvalue > 0.001


def test_choose_mole_empty_crew() -> None:
    """An empty crew has no mole to choose."""
    with pytest.raises(ConfigError, match="the crew is empty"):
        choose_mole([], random.Random(0))
