"""engine/detect/reference.py, claim by claim: the public reference view of an agent and the
policy that swaps one agent for it (the survivors of scripts/mutate, killed one at a time)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from engine.detect.reference import ReferenceView, SwapOne, reference_inner
from engine.errors import ConfigError
from engine.heist.config import load_agents_config
from engine.heist.mole import Strategy, instructions
from engine.heist.prompts import render_messages
from engine.heist.session import HeistScenario, record_heist
from engine.heist.sim import SimPolicy, SimReferencePolicy
from engine.journal import Journal
from engine.policies.base import AgentView, ChatLine, Completion, Observation
from engine.policies.openai_policy import OpenAIPolicy
from engine.policies.registry import register_policy, unregister_policy
from engine.state import state_at

SEED = 33  # choose_heist_mole gives this seed the hacker as its mole
MOLE = "hacker"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Journal, str]]:
    with Journal(tmp_path_factory.mktemp("ref") / "j.db") as j:
        rid = record_heist(
            j, SimPolicy(), seed=SEED, rounds=2, mole=MOLE, strategy="FALSE_INFO"
        ).run_id
        yield j, rid


def _scenario(rounds: int = 3) -> HeistScenario:
    return HeistScenario(load_agents_config(None), 5, rounds)


def test_sim_runs_get_the_sim_reference_whatever_the_sim_flavour() -> None:
    """Every `sim...` spec is played by the sim with no secret; a drifted sim's reference is
    the plain one (its drift is the recorded policy's, not the role's)."""
    for spec in ({"name": "sim"}, {"name": "sim-honest"}, {"name": "sim", "drift": 0.5}):
        inner = reference_inner(spec)
        assert isinstance(inner, SimReferencePolicy)
        assert inner.sim.drift == 0.0


def test_other_runs_get_their_own_model_and_settings() -> None:
    """A run on an OpenAI-compatible server is referenced by the same server and model (the
    spec's settings, drift left out); a spec naming no policy is refused, never taken for
    the sim."""
    inner = reference_inner(
        {"name": "openai", "base_url": "http://127.0.0.1:9/v1", "model": "m-r", "drift": 0.2}
    )
    assert isinstance(inner, OpenAIPolicy)
    assert (inner.base_url, inner.model) == ("http://127.0.0.1:9/v1", "m-r")
    with pytest.raises(ConfigError, match="unknown policy"):
        reference_inner({"model": "m-r"})


def test_a_registered_policy_gets_the_spec_without_its_drift() -> None:
    """A policy registered by name is built from the run's spec with every setting but
    `drift` (drift is noise added to the recorded policy, not part of the agent's role)."""
    seen: list[dict[str, Any]] = []

    def factory(spec: dict[str, Any]) -> Any:
        seen.append(dict(spec))
        return _Recording("probe")

    register_policy("probe-ref", factory)
    try:
        inner = reference_inner({"name": "probe-ref", "drift": 0.3, "model": "m-p"})
    finally:
        unregister_policy("probe-ref")
    assert isinstance(inner, _Recording)
    assert seen == [{"name": "probe-ref", "model": "m-p"}]


def test_reference_prompts_are_the_public_config_only() -> None:
    """Each agent's reference prompt names the agent and its role and carries none of any
    strategy's secret instructions; the roles are the crew config's."""
    scenario = _scenario()
    views = ReferenceView(scenario)
    cfg = scenario.config
    assert set(views.prompts) == set(cfg.names) and views.roles == {
        a.name: a.role for a in cfg.agents
    }
    for a in cfg.agents:
        prompt = views.prompts[a.name]
        assert prompt.startswith(f"You are {a.name}, {a.role}, in a crew")
        for strategy in Strategy:
            assert instructions(strategy) not in prompt
    assert views.scenario is scenario


def test_of_swaps_prompt_and_strategy_and_keeps_the_rest() -> None:
    """`of` replaces the system prompt by the agent's public one and unsets the strategy;
    every other field of the view is the one it was handed."""
    scenario = _scenario()
    views = ReferenceView(scenario)
    line = ChatLine(step=0, agent="planner", text="We go at midnight.")
    obs = Observation(step=1, tool="file_reader", param="x", ok=True, output="y")
    secret = AgentView(
        run_id="r1",
        step=7,
        round=1,
        agent="hacker",
        role="whatever",
        system_prompt="SECRET PROMPT",
        agents=scenario.agents,
        transcript=(line,),
        observations=(obs,),
        mole_strategy="FALSE_INFO",
        rounds=3,
    )
    public = views.of(secret)
    assert public.system_prompt == views.prompts["hacker"] != "SECRET PROMPT"
    assert public.mole_strategy is None
    assert (public.run_id, public.step, public.round, public.agent, public.role) == (
        "r1", 7, 1, "hacker", "whatever",
    )  # fmt: skip
    assert public.transcript == (line,) and public.observations == (obs,)
    assert public.rounds == 3


def test_from_state_is_the_acting_agents_public_view(recorded: tuple[Journal, str]) -> None:
    """At s_8 of a six-agent crew the acting agent is the third one (8 mod 6 = 2) in round 1
    (8 // 6): its view holds its public prompt and role, the whole public transcript, its own
    tool results only, no strategy, and the scenario's number of rounds."""
    j, rid = recorded
    state = state_at(j, rid, 8)
    scenario = HeistScenario.from_state(state)
    views = ReferenceView(scenario)
    rv = views.from_state(state, rid)
    agent = scenario.agents[2]
    assert (rv.run_id, rv.step, rv.round, rv.agent) == (rid, 8, 1, agent)
    assert rv.role == scenario.config.agent(agent).role
    assert rv.system_prompt == views.prompts[agent]
    assert rv.agents == scenario.agents
    assert rv.transcript == state.transcript and len(rv.transcript) == 8
    assert rv.observations == state.contexts[agent].observations
    assert rv.mole_strategy is None
    assert rv.rounds == 2


def test_from_state_of_the_mole_has_no_secret(recorded: tuple[Journal, str]) -> None:
    """At s_7 the mole acts (7 mod 6 = 1, the hacker): the state holds its secret, the
    reference view shows none of it (public prompt, no strategy), and its own tool results
    are its own, not another agent's."""
    j, rid = recorded
    state = state_at(j, rid, 7)
    assert state.contexts[MOLE].secret  # the fixture really has a secret to hide
    views = ReferenceView(HeistScenario.from_state(state))
    rv = views.from_state(state, rid)
    assert rv.agent == MOLE and rv.round == 1
    assert state.contexts[MOLE].secret not in rv.system_prompt
    assert rv.system_prompt == views.prompts[MOLE] and rv.mole_strategy is None
    assert rv.observations == state.contexts[MOLE].observations


def test_from_state_before_the_agent_has_a_context(recorded: tuple[Journal, str]) -> None:
    """An agent with no context yet (s_0 holds only the mole's) sees no tool results."""
    j, rid = recorded
    state = state_at(j, rid, 0)
    views = ReferenceView(HeistScenario.from_state(state))
    agent = views.scenario.agents[0]
    assert agent not in state.contexts
    rv = views.from_state(state, rid)
    assert (rv.agent, rv.step, rv.round, rv.observations) == (agent, 0, 0, ())


class _Recording:
    """A policy that answers a fixed text and remembers what it was handed."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.calls: list[tuple[AgentView, list[dict[str, str]], int]] = []

    def decide(self, view: AgentView, messages: list[dict[str, str]], seed: int) -> Completion:
        self.calls.append((view, messages, seed))
        return Completion(text=self.text, model="fixed")


def _view(scenario: HeistScenario, agent: str, prompt: str, strategy: str | None) -> AgentView:
    return AgentView(
        run_id="r",
        step=1,
        round=0,
        agent=agent,
        role="r",
        system_prompt=prompt,
        agents=scenario.agents,
        transcript=(ChatLine(step=0, agent="planner", text="hello"),),
        observations=(),
        mole_strategy=strategy,
        rounds=3,
    )


def test_swap_one_plays_only_its_agent_by_reference() -> None:
    """SwapOne hands every other agent's turn to the run's own policy unchanged (view, messages
    and seed as given) and its agent's turn to the reference model, with the public view and
    the messages rendered from it; its name says whom it swaps."""
    scenario = _scenario()
    views = ReferenceView(scenario)
    base, inner = _Recording("own"), _Recording("reference")
    swap = SwapOne(base, "hacker", views, inner)
    assert swap.name == "reference:hacker"
    other = _view(scenario, "planner", "P", None)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "as recorded"}]
    assert swap.decide(other, msgs, 11).text == "own"
    assert base.calls == [(other, msgs, 11)] and inner.calls == []
    mole = _view(scenario, "hacker", "SECRET", "FALSE_INFO")
    assert swap.decide(mole, msgs, 12).text == "reference"
    ((seen, seen_msgs, seed),) = inner.calls
    assert seed == 12 and len(base.calls) == 1
    assert seen.system_prompt == views.prompts["hacker"] and seen.mole_strategy is None
    assert seen_msgs == render_messages(seen) and seen_msgs[0]["content"] != "SECRET"
