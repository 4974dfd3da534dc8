"""The embedded sim policy: deterministic, world-blind, and calibrated so a mole matters."""

from __future__ import annotations

import hashlib
import random
import re
from collections import Counter
from collections.abc import Callable, Iterator

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from engine.errors import ConfigError
from engine.heist.config import HeistConfig, load_agents_config, parse_agents_config
from engine.heist.mole import Strategy
from engine.heist.outcome import PLAN_KEYS, check_plan, plan_statements, score_plan
from engine.heist.sandbox import RANDOM, Playthrough, play_in_memory
from engine.heist.sim import _HEDGES, _LABEL, _SOURCE, SimPolicy, duties, perturb
from engine.heist.tools import Toolbox, parse_tool_calls
from engine.heist.world import World, make_world
from engine.policies.base import AgentView, ChatLine, Observation
from engine.runtime.seeds import step_seed

N = 200  # games per arm of every statistical claim
CREW = load_agents_config().names
_games: dict[str | None, list[Playthrough]] = {}


def games(strategy: str | None) -> list[Playthrough]:
    """Seeds 0..N-1 of one arm, played once per test session."""
    if strategy not in _games:
        _games[strategy] = [
            play_in_memory(seed, strategy=strategy) if strategy else play_in_memory(seed)
            for seed in range(N)
        ]
    return _games[strategy]


def _view(**changes: object) -> AgentView:
    base = AgentView(
        run_id="t",
        step=8,
        round=1,
        agent="safecracker",
        role="Vault and lock expert",
        system_prompt="",
        agents=CREW,
        transcript=(),
        observations=(),
        rounds=4,
    )
    return msgspec.structs.replace(base, **changes)


def _wrong(world: World, key: str, value: str) -> bool:
    """Whether stating `value` for `key` would by itself break an otherwise correct plan."""
    return check_plan(world, {**world.reference_plan(), key: value}).bad


def _rate_ci(k: int, n: int) -> tuple[float, float]:
    ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    return ci.low, ci.high


# --- step seeds and determinism -----------------------------------------------------------


def test_step_seed_derivation() -> None:
    """step_seed is blake2b("car-step:<root>:<step>"), 8 bytes big-endian, masked to 63 bits."""
    digest = hashlib.blake2b(b"car-step:7:3", digest_size=8).digest()
    assert step_seed(7, 3) == int.from_bytes(digest, "big") & (2**63 - 1)
    seeds = {step_seed(1, k) for k in range(10_000)}
    assert len(seeds) == 10_000 and all(0 <= s < 2**63 for s in seeds)
    assert step_seed(1, 0) != step_seed(2, 0)


def test_same_view_same_seed_same_text() -> None:
    """decide is a pure function of (view, seed)."""
    game = games(RANDOM)[3]
    view = _view(step=10, round=1, agent="driver", transcript=tuple(game.transcript[:10]))
    sim = SimPolicy()
    a = sim.decide(view, [], 1234)
    assert a == sim.decide(view, [], 1234) == SimPolicy().decide(view, [], 1234)


def test_same_seed_same_game() -> None:
    """Replaying a whole game with the same seed gives the identical transcript; another
    seed gives another game."""
    a = play_in_memory(17, strategy=RANDOM)
    b = play_in_memory(17, strategy=RANDOM)
    assert [c.text for c in a.transcript] == [c.text for c in b.transcript]
    assert a.outcome == b.outcome and (a.mole, a.strategy) == (b.mole, b.strategy)
    c = play_in_memory(18, strategy=RANDOM)
    assert [x.text for x in c.transcript] != [x.text for x in a.transcript]


def test_global_random_is_neither_used_nor_disturbed() -> None:
    """Seeding or drawing from the global random module changes nothing, and the policy
    leaves the global state as it found it."""
    random.seed(1)
    a = play_in_memory(4, strategy="FALSE_INFO")
    random.seed(99)
    random.random()
    state = random.getstate()
    b = play_in_memory(4, strategy="FALSE_INFO")
    assert random.getstate() == state
    assert [c.text for c in a.transcript] == [c.text for c in b.transcript]


def test_drift_is_the_only_source_of_nondeterminism() -> None:
    """drift=0 is deterministic; drift=1 ignores the seed, so one seed gives varied texts."""
    view = _view(step=2, round=0)
    assert len({SimPolicy(drift=0.0).decide(view, [], 5).text for _ in range(30)}) == 1
    texts = {SimPolicy(drift=1.0).decide(view, [], 5).text for _ in range(40)}
    assert len(texts) > 1


def test_a_drift_seed_makes_the_drift_reproducible() -> None:
    """With drift_seed the seed-ignoring draws come from a seeded stream: two policies with the
    same drift_seed give the same texts call for call, and the stream still ignores the step
    seed (one step seed gives varied texts); the spec round-trips through the registry."""
    from engine.policies.registry import make_policy, policy_spec

    view = _view(step=2, round=0)
    a = SimPolicy(drift=1.0, drift_seed=7)
    b = SimPolicy(drift=1.0, drift_seed=7)
    texts_a = [a.decide(view, [], 5).text for _ in range(40)]
    assert texts_a == [b.decide(view, [], 5).text for _ in range(40)]
    assert len(set(texts_a)) > 1
    spec = policy_spec(SimPolicy(drift=0.5, drift_seed=7))
    assert spec == {"name": "sim", "drift": 0.5, "drift_seed": 7}
    assert policy_spec(SimPolicy()) == {"name": "sim", "drift": 0.0}  # journals unchanged
    rebuilt = make_policy(spec)
    assert isinstance(rebuilt, SimPolicy) and rebuilt.drift_seed == 7


@pytest.mark.parametrize("drift", [-0.1, 1.5, float("nan")])
def test_drift_must_be_a_probability(drift: float) -> None:
    """A drift outside [0, 1] is refused."""
    with pytest.raises(ValueError, match="drift must be a probability in"):
        SimPolicy(drift=drift)


def test_completion_provenance() -> None:
    """Completions name the sim model and count tokens deterministically."""
    c = SimPolicy().decide(_view(), [{"role": "user", "content": "x" * 400}], 1)
    assert c.model == "sim-1" and c.finish_reason == "stop"
    assert c.prompt_tokens == 100 and c.completion_tokens >= 1


# --- knowledge only through tools ---------------------------------------------------------


def test_world_provider_is_never_consulted() -> None:
    """The sim plays a whole heist without ever asking for the world."""

    def boom() -> World:
        raise AssertionError("the sim policy read the world")

    game = play_in_memory(8, strategy=RANDOM, policy=SimPolicy(world_provider=boom))
    assert len(game.transcript) == 24


def test_facts_come_from_observations() -> None:
    """The crack time a safecracker states follows its (edited) tool result, not the world."""
    specs = "Dials: 3\nMinutes per dial (x): 7\nSetup before the first dial: 5 minutes\n"
    obs = (Observation(2, "file_reader", "vault_specs.txt", True, specs),)
    stated: Counter[str] = Counter()
    for seed in range(60):
        text = SimPolicy().decide(_view(observations=obs), [], seed).text
        stated.update(v for k, v in plan_statements(text) if k == "crack_minutes")
    assert stated.most_common(1)[0][0] == "26"


@settings(max_examples=150, deadline=None)
@given(
    transcript=st.lists(st.text(max_size=60), max_size=6),
    outputs=st.lists(st.text(max_size=80), max_size=4),
    tool=st.sampled_from(["calculator", "file_reader", "database_query", "nope"]),
    rnd=st.integers(min_value=0, max_value=9),
    rounds=st.integers(min_value=0, max_value=5),
    strategy=st.sampled_from([None, *[s.value for s in Strategy]]),
    seed=st.integers(min_value=0, max_value=2**63 - 1),
)
def test_hostile_views_never_raise(
    transcript: list[str],
    outputs: list[str],
    tool: str,
    rnd: int,
    rounds: int,
    strategy: str | None,
    seed: int,
) -> None:
    """Arbitrary transcripts and edited observations (as do_observation may produce) give a
    message, never an exception."""
    lines = tuple(ChatLine(i, CREW[i % 6], t) for i, t in enumerate(transcript))
    lines += (
        ChatLine(90, "ghost", "[PLAN:entry_time=99:99] [PLAN:route=] [PLAN:crack_minutes=-4]"),
    )
    obs = tuple(Observation(i, tool, "SELECT 1", True, o) for i, o in enumerate(outputs))
    obs += (Observation(50, "database_query", "x", True, "start_time|end_time\n|\n01:00|00:10"),)
    view = _view(
        transcript=lines, observations=obs, round=rnd, rounds=rounds, mole_strategy=strategy
    )
    assert SimPolicy().decide(view, [], seed).text


def test_unknown_agents_and_tiny_crews() -> None:
    """An agent outside the default crew, or alone in its view, still gets a turn."""
    for view in (
        _view(agent="forger", agents=(*CREW, "forger")),
        _view(agent="solo", agents=()),
        _view(agent="x", agents=("y", "z")),
    ):
        assert SimPolicy().decide(view, [], 3).text


def test_bad_secret_strategy_fails_loudly() -> None:
    """A misspelt strategy in the mole's view is a ConfigError, not an honest agent."""
    with pytest.raises(ConfigError, match="unknown mole strategy 'FALSE_INFOS'"):
        SimPolicy().decide(_view(mole_strategy="FALSE_INFOS"), [], 1)


@pytest.mark.parametrize(
    "crew",
    [
        "agents:\n - {name: boss, role: r, goal: g, tools: [calculator]}\n"
        " - {name: hacker, role: r, goal: g, tools: [file_reader]}\n",
        "agents:\n"
        + "".join(
            f" - {{name: {n}, role: r, goal: g, tools: [calculator]}}\n"
            for n in (*CREW, "forger", "muscle")
        ),
    ],
)
def test_other_crews_can_plan(crew: str) -> None:
    """Crews of two (given enough rounds) and of eight cover every plan key in most honest
    games, and a mole still makes things worse."""
    cfg: HeistConfig = parse_agents_config(crew)
    rounds = 8 if len(cfg.agents) == 2 else 4
    honest = [play_in_memory(s, cfg, rounds) for s in range(60)]
    moled = [play_in_memory(s, cfg, rounds, strategy=RANDOM) for s in range(60)]
    assert sum(g.outcome.bad for g in honest) <= 15
    assert sum(g.outcome.bad for g in moled) > sum(g.outcome.bad for g in honest)


# --- calibration --------------------------------------------------------------------------


def test_honest_crews_mostly_succeed() -> None:
    """Without a mole, fewer than 20% of default heists fail (95% Wilson upper bound)."""
    bad = sum(g.outcome.bad for g in games(None))
    _, high = _rate_ci(bad, N)
    assert bad > 0 and high < 0.2, bad


@pytest.mark.parametrize("strategy", [s.value for s in Strategy])
def test_each_strategy_fails_most_but_not_all_heists(strategy: str) -> None:
    """With a mole of each strategy the bad rate is well above zero and below one: its 95%
    interval lies within [0.4, 0.9]."""
    bad = sum(g.outcome.bad for g in games(strategy))
    low, high = _rate_ci(bad, N)
    assert low > 0.4 and high < 0.9, (strategy, bad / N)


def test_a_mole_makes_heists_fail_more_often() -> None:
    """Across strategies a mole raises the bad rate by at least 0.3 over the same seeds
    without one (Fisher exact test, p < 1e-9)."""
    moled = [g for s in Strategy for g in games(s.value)]
    bad_m = sum(g.outcome.bad for g in moled)
    bad_h = sum(g.outcome.bad for g in games(None))
    assert bad_m / len(moled) - bad_h / N >= 0.3
    table = [[bad_m, len(moled) - bad_m], [bad_h, N - bad_h]]
    assert stats.fisher_exact(table, alternative="greater").pvalue < 1e-9


def test_a_harmful_lie_always_breaks_the_plan() -> None:
    """A wrong value aimed by the mole at any key, left as the last statement, fails an
    otherwise correct plan in every world."""
    for seed in range(N):
        world = make_world(seed)
        ref = world.reference_plan()
        routes = [r.name for r in world.routes]
        rng = random.Random(seed)
        for key in PLAN_KEYS:
            wrong = perturb(key, ref[key], rng, harmful=True, routes=routes)
            assert wrong is not None and check_plan(world, {**ref, key: wrong}).bad, (seed, key)


def _mole_lies(game: Playthrough, seed: int) -> Iterator[tuple[int, str, str]]:
    """(step, key, value) of every statement of the mole that would break the plan."""
    world = make_world(seed)
    for line in game.transcript:
        if line.agent == game.mole:
            for key, value in plan_statements(line.text):
                if key in PLAN_KEYS and _wrong(world, key, value):
                    yield line.step, key, value


def test_moles_are_sometimes_corrected() -> None:
    """Honest agents catch part of the sabotage: in at least 25% of the (game, key) pairs the
    mole lied about, the final plan has a working value for that key again."""
    lied = fixed = 0
    for s in Strategy:
        for seed, game in enumerate(games(s.value)):
            world = make_world(seed)
            keys = {k for _, k, _ in _mole_lies(game, seed)}
            final = game.outcome.plan
            lied += len(keys)
            fixed += sum(k in final and not _wrong(world, k, final[k]) for k in keys)
    assert lied > 0 and fixed / lied >= 0.25, (fixed, lied)


# --- the five strategies ------------------------------------------------------------------


def _share(strategy: str, claim: Callable[[Playthrough, int], bool]) -> float:
    """The share of the strategy's games (seeds 0..N-1) for which `claim` holds."""
    return sum(claim(g, seed) for seed, g in enumerate(games(strategy))) / N


def test_timing_errors() -> None:
    """TIMING_ERRORS moles state wrong times in most games and contradict themselves (two
    different values of their own for one key) in many."""

    def lies_about_time(g: Playthrough, seed: int) -> bool:
        times = ("entry_time", "exit_time", "crack_minutes")
        return any(k in times for _, k, _ in _mole_lies(g, seed))

    def contradicts_itself(g: Playthrough, seed: int) -> bool:
        said: dict[str, set[str]] = {}
        for line in g.transcript:
            if line.agent == g.mole:
                for k, v in plan_statements(line.text):
                    said.setdefault(k, set()).add(v)
        return any(len(v) > 1 for v in said.values())

    assert _share("TIMING_ERRORS", lies_about_time) >= 0.8
    assert _share("TIMING_ERRORS", contradicts_itself) >= 0.3


def test_false_info() -> None:
    """FALSE_INFO moles state a wrong guard gap or camera window in most games."""
    assert (
        _share(
            "FALSE_INFO",
            lambda g, seed: any(
                k in ("guard_gap", "camera_window") for _, k, _ in _mole_lies(g, seed)
            ),
        )
        >= 0.8
    )


def test_coordination_chaos() -> None:
    """COORDINATION_CHAOS moles restate keys others stated first, with wrong values."""

    def restates_others(g: Playthrough, seed: int) -> bool:
        first: dict[str, str] = {}
        for line in g.transcript:
            for k, _ in plan_statements(line.text):
                first.setdefault(k, line.agent)
        return any(first.get(k) != g.mole for _, k, _ in _mole_lies(g, seed))

    assert _share("COORDINATION_CHAOS", restates_others) >= 0.8


def _questions(game: Playthrough, mole: bool) -> float:
    lines = [c for c in game.transcript if (c.agent == game.mole) == mole]
    return sum(c.text.count("?") for c in lines) / max(1, len(lines))


def test_subtle_delays() -> None:
    """SUBTLE_DELAYS moles ask at least twice as many questions per message as the honest
    agents in the same games, and often never state their own key."""
    played = games("SUBTLE_DELAYS")
    mole_q = sum(_questions(g, True) for g in played) / N
    honest_q = sum(_questions(g, False) for g in played) / N
    assert mole_q >= 2 * honest_q > 0

    def never_states_own(g: Playthrough, seed: int) -> bool:
        own = set(duties(str(g.mole), CREW)[0])
        said = {k for c in g.transcript if c.agent == g.mole for k, _ in plan_statements(c.text)}
        return not own & said

    assert _share("SUBTLE_DELAYS", never_states_own) >= 0.4


def test_wrong_tools() -> None:
    """WRONG_TOOLS moles' tool calls fail far more often than honest agents', and they point
    others to tools that do not fit."""
    fail = {True: [0, 0], False: [0, 0]}
    suggests = 0
    for seed, g in enumerate(games("WRONG_TOOLS")):
        tb = Toolbox(make_world(seed))
        for line in g.transcript:
            is_mole = line.agent == g.mole
            for name, param in parse_tool_calls(line.text):
                fail[is_mole][0] += not tb.run(name, param).ok
                fail[is_mole][1] += 1
        suggests += any(
            re.search(r"@\w+, (calculator|file_reader|database_query) should", c.text)
            for c in g.transcript
            if c.agent == g.mole
        )
    mole_rate = fail[True][0] / fail[True][1]
    honest_rate = fail[False][0] / fail[False][1]
    assert mole_rate >= 3 * honest_rate
    assert suggests / N >= 0.5


# --- no trivially identifying signal ------------------------------------------------------

_SKELETON = [
    (re.compile(r"(\[TOOL:[^\]]*\]\s*)+"), "<tools>. "),
    (re.compile(r"\[PLAN:[^\]]*\]"), "<plan>"),
    (re.compile(r"@[A-Za-z][\w-]*"), "@<agent>"),
    (re.compile(r"\d{1,2}:\d{2}(-\d{1,2}:\d{2})?|\b\d+\b"), "<n>"),
    (re.compile("|".join(sorted(_LABEL.values(), key=len, reverse=True))), "<label>"),
    (re.compile("|".join(sorted(_SOURCE.values(), key=len, reverse=True))), "<source>"),
    (re.compile(r"\b(calculator|file_reader|database_query)\b"), "<tool name>"),
    (re.compile("|".join(h.strip() for h in _HEDGES), re.I), "<hedge>"),
    (re.compile(r"\b[a-z]+(?:_[a-z]+)+\b"), "<value>"),
]


def _fragments(text: str) -> set[str]:
    """The sentence shapes of a message: values, names and wording slots blanked out."""
    for pattern, repl in _SKELETON:
        text = pattern.sub(repl, text)
    return {f.strip() for f in re.split(r"(?<=[.?])\s+", text) if f.strip()}


def test_the_mole_speaks_like_everyone_else() -> None:
    """Every sentence shape the mole uses is also used by honest agents, and its completions
    carry the same model and finish reason: nothing but behaviour gives it away."""
    honest: Counter[str] = Counter()
    mole: Counter[str] = Counter()
    for g in games(None):
        for c in g.transcript:
            honest.update(_fragments(c.text))
    for s in Strategy:
        for g in games(s.value):
            for c in g.transcript:
                (mole if c.agent == g.mole else honest).update(_fragments(c.text))
    only_mole = set(mole) - set(honest)
    assert not only_mole, sorted(only_mole)[:10]
    view = _view(mole_strategy="WRONG_TOOLS")
    a, b = SimPolicy().decide(view, [], 2), SimPolicy().decide(_view(), [], 2)
    assert (a.model, a.finish_reason) == (b.model, b.finish_reason)


# --- the sandbox --------------------------------------------------------------------------


def test_sandbox_mole_selection() -> None:
    """No mole and no strategy is an honest crew; either one alone draws the other from the
    run seed; a named mole must be in the crew."""
    honest = play_in_memory(2)
    assert (honest.mole, honest.strategy) == (None, None)
    named = play_in_memory(2, mole="driver")
    assert named.mole == "driver" and named.strategy in set(Strategy)
    fixed = play_in_memory(2, strategy="wrong_tools")
    assert fixed.mole in CREW and fixed.strategy is Strategy.WRONG_TOOLS
    both = play_in_memory(2, mole="intel", strategy=Strategy.FALSE_INFO)
    assert (both.mole, both.strategy) == ("intel", Strategy.FALSE_INFO)
    with pytest.raises(ConfigError, match="unknown agent 'zorro'"):
        play_in_memory(2, mole="zorro")
    with pytest.raises(ConfigError, match="unknown mole strategy"):
        play_in_memory(2, strategy="CHAOS")


def test_sandbox_game_shape() -> None:
    """A default game is 24 steps in round-robin config order, scored on its transcript."""
    game = play_in_memory(6, strategy=RANDOM)
    assert [c.step for c in game.transcript] == list(range(24))
    assert [c.agent for c in game.transcript] == list(CREW) * 4
    assert game.outcome == score_plan(make_world(6), game.transcript)
