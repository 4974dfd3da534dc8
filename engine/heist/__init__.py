"""The heist scenario ("the mole game"): a seeded world, the tools agents use to learn it, the
crew config, the mole, the rule that decides whether the crew's plan would work, and the
embedded `sim` crew. Its forks and attribution are the core's (engine.branching).

The core knows the heist only as the scenario named "heist" (engine.scenario) and the policies
named "sim" and "sim-honest" (engine.policies.registry); both are loaded on first use. The names
below are the heist's public API for its own consumers (the detector, the game server, the CLI);
they are imported lazily, so importing one heist module does not load them all."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.heist.config import HeistConfig, load_agents_config, parse_agents_config
    from engine.heist.session import (
        DEFAULT_ROUNDS,
        SCENARIO,
        Accusation,
        HeistScenario,
        accuse_run,
        record_heist,
    )
    from engine.heist.sim import SimPolicy, SimReferencePolicy

_EXPORTS = {
    "HeistConfig": "engine.heist.config",
    "load_agents_config": "engine.heist.config",
    "parse_agents_config": "engine.heist.config",
    "DEFAULT_ROUNDS": "engine.heist.session",
    "SCENARIO": "engine.heist.session",
    "Accusation": "engine.heist.session",
    "HeistScenario": "engine.heist.session",
    "accuse_run": "engine.heist.session",
    "record_heist": "engine.heist.session",
    "SimPolicy": "engine.heist.sim",
    "SimReferencePolicy": "engine.heist.sim",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine.heist' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "DEFAULT_ROUNDS",
    "SCENARIO",
    "Accusation",
    "HeistConfig",
    "HeistScenario",
    "SimPolicy",
    "SimReferencePolicy",
    "accuse_run",
    "load_agents_config",
    "parse_agents_config",
    "record_heist",
]
