"""A heist session: the scenario the runtime plays, recording a new heist, and the accusation.

Everything a later replay needs is journaled in RunStarted (the crew config, the world seed,
rounds, policy spec) and MoleAssigned (secret), so a branch rebuilds the same scenario from the
journal alone."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from engine import events as ev
from engine.branching import SteppedForks
from engine.errors import ConfigError, JournalError
from engine.heist.config import HeistConfig, load_agents_config
from engine.heist.controller import accuse
from engine.heist.mole import Strategy, choose_mole, instructions, parse_strategy
from engine.heist.outcome import score_plan
from engine.heist.prompts import render_messages, system_prompt
from engine.heist.tools import Toolbox, parse_tool_calls
from engine.heist.world import World, make_world
from engine.journal import Journal
from engine.policies.base import AgentView, ChatLine, Policy
from engine.runtime.clock import Clock
from engine.runtime.control import ControlChannel
from engine.runtime.episode import EpisodeResult, StepCallback
from engine.runtime.record import record_run, run_started
from engine.runtime.recorder import DEFAULT_GROUP_MS
from engine.state import DEFAULT_CONTEXT_WINDOW, State
from engine.version import engine_version

DEFAULT_ROUNDS = 4
SCENARIO = "heist"


#: scenarios rebuilt from a RunStarted, by its crew, world seed and rounds (`from_state`)
_built: dict[bytes, HeistScenario] = {}


class HeistScenario(SteppedForks):
    """The heist as an `engine.scenario.SteppedScenario`: views, prompts, tools and the outcome
    rule; its forks and forward runs are the core loop's (engine.branching.SteppedForks).
    Registered as "heist" (engine.scenario.BUILTIN_SCENARIOS); `from_state` is its factory."""

    name = SCENARIO

    def __init__(self, config: HeistConfig, world_seed: int, rounds: int) -> None:
        if rounds < 1:
            raise ConfigError(f"rounds must be at least 1, got {rounds!r}")
        self.config = config
        self.world_seed = world_seed
        self.rounds = rounds
        self.world: World = make_world(world_seed)
        self.toolbox = Toolbox(self.world)
        self.agents = config.names
        self.total_steps = rounds * len(self.agents)

    def run_config(self) -> dict[str, Any]:
        """The journaled form of this scenario (RunStarted.config)."""
        return {
            "crew": msgspec.to_builtins(self.config),
            "world_seed": self.world_seed,
            "rounds": self.rounds,
        }

    @classmethod
    def from_state(cls, state: State) -> HeistScenario:
        """Rebuild the scenario of a recorded run from its folded RunStarted (once per
        process and RunStarted: every branch of a run rebuilds the same one, and a scenario
        is a frozen value - its world, its crew and a toolbox over files that never change)."""
        if state.scenario != SCENARIO:
            raise JournalError(f"run is a {state.scenario!r} run, not a heist")
        cfg = state.config
        key = msgspec.msgpack.encode([cfg.get("crew"), cfg.get("world_seed"), cfg.get("rounds")])
        hit = _built.get(key)
        if hit is not None and hit.toolbox.ready():
            return hit
        config = msgspec.convert(cfg["crew"], HeistConfig)
        scenario = cls(config, int(cfg["world_seed"]), int(cfg["rounds"]))
        if len(_built) >= 64:
            _built.clear()
        _built[key] = scenario
        return scenario

    def view(self, state: State, run_id: str) -> AgentView:
        agent = self.agents[state.step % len(self.agents)]
        ctx = state.contexts.get(agent)
        secret = ctx.secret if ctx is not None else None
        strategy = ctx.strategy if ctx is not None else None
        return AgentView(
            run_id=run_id,
            step=state.step,
            round=state.step // len(self.agents),
            agent=agent,
            role=self.config.agent(agent).role,
            system_prompt=system_prompt(self.config.agent(agent), self.config, secret),
            agents=self.agents,
            transcript=state.transcript,
            observations=ctx.observations if ctx is not None else (),
            mole_strategy=strategy,
            rounds=self.rounds,
        )

    def messages(self, view: AgentView) -> list[dict[str, str]]:
        return render_messages(view)

    def tool_calls(self, text: str) -> list[tuple[str, str]]:
        return parse_tool_calls(text)

    def run_tool(self, name: str, param: str) -> Any:
        return self.toolbox.run(name, param)

    def outcome(self, transcript: list[ChatLine]) -> dict[str, Any]:
        return msgspec.to_builtins(score_plan(self.world, transcript))  # type: ignore[no-any-return]


def opening_events(
    scenario: HeistScenario,
    policy: Policy,
    seed: int,
    started_at: str,
    *,
    mole: tuple[str, Strategy] | None,
    context_window: int = DEFAULT_CONTEXT_WINDOW,
) -> list[ev.Event]:
    """The run-level events a heist opens with: RunStarted, then the secret MoleAssigned."""
    opening: list[ev.Event] = [
        run_started(
            scenario,
            policy,
            seed,
            started_at,
            rounds=scenario.rounds,
            context_window=context_window,
        )
    ]
    if mole is None:
        opening.append(ev.NO_MOLE)  # journaled all the same: its presence tells nothing
    else:
        opening.append(
            ev.MoleAssigned(
                agent=mole[0], strategy=mole[1].value, instructions=instructions(mole[1])
            )
        )
    return opening


def choose_heist_mole(
    agents: tuple[str, ...], seed: int, strategy: Strategy | None = None
) -> tuple[str, Strategy]:
    """The mole and strategy a heist with this seed gets unless they are given."""
    return choose_mole(list(agents), random.Random(f"mole:{seed}"), strategy)


def record_heist(
    journal: Journal,
    policy: Policy,
    *,
    seed: int,
    rounds: int = DEFAULT_ROUNDS,
    config: HeistConfig | None = None,
    config_path: str | Path | None = None,
    mole: str | None = None,
    strategy: str | None = None,
    no_mole: bool = False,
    context_window: int = DEFAULT_CONTEXT_WINDOW,
    clock: Clock | None = None,
    control: ControlChannel | None = None,
    on_step: StepCallback | None = None,
    server: str | None = None,
    label: str = "",
    group_ms: float = DEFAULT_GROUP_MS,
    on_created: Callable[[str], None] | None = None,
) -> EpisodeResult:
    """Record one heist from scratch: RunStarted, the secret mole, every step, RunEnded.

    `on_created(run_id)` is called once the opening events are committed (a live viewer can
    follow the run from then on); `group_ms=0` commits every step on its own."""
    cfg = config or load_agents_config(config_path)
    scenario = HeistScenario(cfg, seed, rounds)
    if mole is not None and mole not in scenario.agents:
        raise ConfigError(f"unknown agent {mole!r} for --mole; agents are: {', '.join(cfg.names)}")
    strat = parse_strategy(strategy) if strategy is not None else None
    chosen, chosen_strategy = choose_heist_mole(scenario.agents, seed, strat)
    mole_agent = mole or chosen
    # a game without a mole journals its (empty) secret too: whether there is a mole is part
    # of the secret, and a missing event would shift every later seq by one
    secret: list[ev.Event] = [ev.NO_MOLE]
    if not no_mole:
        secret = [
            ev.MoleAssigned(
                agent=mole_agent,
                strategy=chosen_strategy.value,
                instructions=instructions(chosen_strategy),
            )
        ]
    return record_run(
        journal,
        scenario,
        policy,
        seed=seed,
        opening=secret,
        rounds=scenario.rounds,
        context_window=context_window,
        clock=clock,
        control=control,
        on_step=on_step,
        server=server,
        label=label,
        group_ms=group_ms,
        on_created=on_created,
    )


class Accusation(msgspec.Struct, frozen=True):
    run_id: str
    suspect: str | None
    verdict: str
    mole: str
    strategy: str


def accuse_run(journal: Journal, run_id: str, suspect: str | None) -> Accusation:
    """Evaluate the user's suspect (HeistController), journal the verdict, reveal the mole."""
    info = journal.run(run_id)
    status = journal.status(info.run_id)
    started: ev.RunStarted | None = None
    secret: ev.MoleAssigned | None = None
    for stored in journal.read(info.run_id):
        e = stored.event
        if isinstance(e, ev.RunStarted):
            started = e
        elif isinstance(e, ev.MoleAssigned):
            secret = e
        elif isinstance(e, ev.SuspicionDeclared):
            raise JournalError(
                f"run {info.run_id!r} was already accused ({e.suspect or 'nobody'}: {e.verdict})"
            )
    if started is None or started.scenario != SCENARIO:
        raise JournalError(f"run {info.run_id!r} is not a heist")
    if status == "recording" or status == "paused":
        raise JournalError(f"run {info.run_id!r} is still recording; accuse it when it has ended")
    if status == "abandoned":
        raise JournalError(
            f"run {info.run_id!r} was abandoned by its recording process; close it with "
            "`car runs --close-stale` before accusing"
        )
    if info.parent_run_id is not None:
        # a branch plays the same game with the same mole: its verdict would reveal the mole
        # of a game that is still unaccused
        raise JournalError(
            f"run {info.run_id!r} is a branch of heist {info.root_run_id!r}; the accusation is"
            f" the game's: accuse {info.root_run_id!r}"
        )
    if secret is None or secret.none:
        raise JournalError(f"run {info.run_id!r} has no mole to accuse")
    verdict = accuse(secret.agent, suspect, started.agents)
    journal.append(
        info.run_id,
        [
            ev.SuspicionDeclared(
                suspect=suspect,
                verdict=verdict.value,
                mole=secret.agent,
                strategy=secret.strategy,
            )
        ],
    )
    return Accusation(info.run_id, suspect, verdict.value, secret.agent, secret.strategy)


__all__ = [
    "DEFAULT_ROUNDS",
    "SCENARIO",
    "Accusation",
    "HeistScenario",
    "Strategy",
    "accuse_run",
    "engine_version",
    "opening_events",
    "record_heist",
]
