"""Play a whole heist in memory, with no journal: for tests, calibration and benchmarks.

This is not the runtime (which records every step); it is the same loop stripped to the domain:
round-robin turns in config order, inline tool calls parsed and run, each result private to the
caller, the outcome scored on the public transcript.
"""

from __future__ import annotations

import random
from typing import NamedTuple

from engine.heist.config import DEFAULT_ROUNDS, HeistConfig, load_agents_config
from engine.heist.mole import Strategy, choose_mole, instructions, parse_strategy
from engine.heist.outcome import Outcome, score_plan
from engine.heist.prompts import render_messages, system_prompt
from engine.heist.sim import SimPolicy
from engine.heist.tools import Toolbox, observation_for, parse_tool_calls
from engine.heist.world import make_world
from engine.policies.base import AgentView, ChatLine, Observation, Policy
from engine.runtime.seeds import step_seed

RANDOM = "random"  # pass as `mole` or `strategy` to have it drawn from the run seed


class Playthrough(NamedTuple):
    transcript: list[ChatLine]
    outcome: Outcome
    mole: str | None
    strategy: Strategy | None


def mole_rng(seed: int) -> random.Random:
    """The random source that picks the mole of run `seed`; the recorder uses the same one, so
    a sandbox game and a recorded heist with the same seed get the same mole."""
    return random.Random(f"mole:{seed}")


def play_in_memory(
    seed: int,
    config: HeistConfig | None = None,
    rounds: int = DEFAULT_ROUNDS,
    mole: str | None = None,
    strategy: Strategy | str | None = None,
    policy: Policy | None = None,
) -> Playthrough:
    """Play heist `seed` (world and step seeds both derive from it).

    With neither `mole` nor `strategy` the crew is honest. Giving either one puts a mole in the
    game; `RANDOM` (or leaving the other one out) draws it from the run seed.
    """
    cfg = config if config is not None else load_agents_config()
    world = make_world(seed)
    toolbox = Toolbox(world)
    pol: Policy = policy if policy is not None else SimPolicy()
    names = cfg.names

    chosen_mole: str | None = None
    chosen_strategy: Strategy | None = None
    if mole is not None or strategy is not None:
        fixed = None if strategy in (None, RANDOM) else _strategy(strategy)
        rng = mole_rng(seed)
        drawn_mole, chosen_strategy = choose_mole(names, rng, fixed)
        chosen_mole = drawn_mole if mole in (None, RANDOM) else cfg.agent(str(mole)).name

    prompts = {
        a.name: system_prompt(
            a,
            cfg,
            instructions(chosen_strategy) if a.name == chosen_mole and chosen_strategy else None,
        )
        for a in cfg.agents
    }
    transcript: list[ChatLine] = []
    observations: dict[str, list[Observation]] = {n: [] for n in names}
    for step in range(rounds * len(names)):
        rnd, turn = divmod(step, len(names))
        agent = cfg.agents[turn]
        secret = chosen_strategy.value if agent.name == chosen_mole and chosen_strategy else None
        view = AgentView(
            run_id=f"sandbox-{seed}",
            step=step,
            round=rnd,
            agent=agent.name,
            role=agent.role,
            system_prompt=prompts[agent.name],
            agents=names,
            transcript=tuple(transcript),
            observations=tuple(observations[agent.name]),
            mole_strategy=secret,
            rounds=rounds,
        )
        completion = pol.decide(view, render_messages(view), step_seed(seed, step))
        transcript.append(ChatLine(step=step, agent=agent.name, text=completion.text))
        for name, param in parse_tool_calls(completion.text):
            observations[agent.name].append(observation_for(toolbox.run(name, param), step))
    return Playthrough(transcript, score_plan(world, transcript), chosen_mole, chosen_strategy)


def _strategy(value: Strategy | str) -> Strategy:
    return value if isinstance(value, Strategy) else parse_strategy(value)
