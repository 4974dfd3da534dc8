"""The Scenario protocol: what the core needs from whatever the agents are doing, and the
registry that finds a scenario by the name its runs record.

The core (the step loop, replay, forks, attribution) knows a run only through this protocol:

- a *step* is one turn of one agent: `view(s_k)` says who acts and what it sees, `messages`
  renders that view as the chat request its policy is sent;
- the action is text; `tool_calls` parses the tool calls in it, and `run_tool` executes one,
  giving the observation that is journaled as its ToolResult;
- a *branch* re-runs from s_k: the registry rebuilds the scenario from the folded RunStarted
  (`State.scenario` names it, `State.config` is what `run_config` journaled), and the same loop
  runs it forward;
- the *outcome* is scored on the full public transcript once the last step is taken: a dict
  journaled in RunEnded, whose `"bad"` (a bool: the run failed) is what forks and attribution
  count.

A scenario implementation is registered under its name, as a lazy "module:attr" reference (the
core never imports an implementation until a run of that scenario is opened) or as the factory
object itself (`register_scenario`). The factory is anything with `from_state(state)`; a class
with a `from_state` classmethod is one.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any, Protocol

from engine.errors import ConfigError, UnknownScenario
from engine.policies.base import AgentView, ChatLine
from engine.state import State


class ToolOutcome(Protocol):
    """The result of one tool call: journaled as a ToolResult, seen by the calling agent."""

    # read-only members: a frozen dataclass or msgspec Struct implements them
    @property
    def ok(self) -> bool: ...

    @property
    def output(self) -> str: ...

    @property
    def error(self) -> str | None: ...


class Scenario(Protocol):
    """One scenario instance, bound to one run's configuration."""

    # read-only members: a plain class attribute implements them
    @property
    def name(self) -> str:
        """The name runs of this scenario record in RunStarted.scenario (the registry key)."""
        ...

    @property
    def agents(self) -> tuple[str, ...]:
        """The agents, in the order RunStarted lists them."""
        ...

    @property
    def total_steps(self) -> int:
        """How many steps a run takes; the loop ends the run after step total_steps - 1."""
        ...

    def run_config(self) -> dict[str, Any]:
        """The journaled form of this scenario (RunStarted.config): all from_state needs."""
        ...

    def view(self, state: State, run_id: str) -> AgentView:
        """Who acts at s_k (`state.step`) and what that agent sees of s_k."""
        ...

    def messages(self, view: AgentView) -> list[dict[str, str]]:
        """The chat request the acting agent's policy is sent (journaled in LlmCall.request,
        and rebuilt from s_k by replay: it must depend on the view alone)."""
        ...

    def tool_calls(self, text: str) -> list[tuple[str, str]]:
        """The (tool, parameter) calls an action makes, in order."""
        ...

    def run_tool(self, name: str, param: str) -> ToolOutcome:
        """Execute one tool call; deterministic given the run's configuration, so a branch
        sees the same world its parent saw."""
        ...

    def outcome(self, transcript: list[ChatLine]) -> dict[str, Any]:
        """Score the finished run on its full public transcript; `"bad"` says it failed."""
        ...


class ScenarioFactory(Protocol):
    """What the registry holds: builds the scenario of a recorded run from its folded state
    (RunStarted), which is how a replay or a branch re-runs from any s_k."""

    def from_state(self, state: State) -> Scenario: ...


#: Built-in scenarios by name, as "module:attr" references imported on first use.
BUILTIN_SCENARIOS: dict[str, str] = {
    "heist": "engine.heist.session:HeistScenario",
    "program": "engine.program.scenario:ProgramScenario",
}

_registered: dict[str, str | ScenarioFactory] = dict(BUILTIN_SCENARIOS)
_loaded: dict[str, ScenarioFactory] = {}
_lock = threading.Lock()


def register_scenario(name: str, factory: str | ScenarioFactory) -> None:
    """Register (or replace) the implementation of scenario `name`: a "module:attr" reference,
    loaded when a run of that scenario is first opened, or the factory itself."""
    if not name or not isinstance(name, str):
        raise ConfigError(f"a scenario needs a non-empty name, got {name!r}")
    if isinstance(factory, str) and ":" not in factory:
        raise ConfigError(f"scenario {name!r}: {factory!r} is not a 'module:attr' reference")
    with _lock:
        _registered[name] = factory
        _loaded.pop(name, None)


def unregister_scenario(name: str) -> None:
    """Forget a registered scenario (a built-in one returns to its built-in reference)."""
    with _lock:
        _loaded.pop(name, None)
        if name in BUILTIN_SCENARIOS:
            _registered[name] = BUILTIN_SCENARIOS[name]
        else:
            _registered.pop(name, None)


def scenario_names() -> tuple[str, ...]:
    """The names of every registered scenario, sorted."""
    with _lock:
        return tuple(sorted(_registered))


def scenario_factory(name: str) -> ScenarioFactory:
    """The implementation registered for `name`; UnknownScenario (one line, listing the known
    names) when there is none."""
    with _lock:
        hit = _loaded.get(name)
        target = _registered.get(name)
    if hit is not None:
        return hit
    if target is None:
        known = ", ".join(scenario_names()) or "none"
        shown = repr(name) if name else "(none recorded)"
        raise UnknownScenario(f"unknown scenario {shown}; known scenarios: {known}")
    factory = _load(name, target) if isinstance(target, str) else target
    with _lock:
        _loaded[name] = factory
    return factory


def _load(name: str, ref: str) -> ScenarioFactory:
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
        factory: ScenarioFactory = getattr(module, attr)
    except (ImportError, AttributeError) as e:
        raise UnknownScenario(f"scenario {name!r} cannot be loaded from {ref!r}: {e}") from e
    return factory


def scenario_for(state: State) -> Scenario:
    """The scenario of the run whose folded state this is (any s_k of it)."""
    return scenario_factory(state.scenario).from_state(state)


__all__ = [
    "BUILTIN_SCENARIOS",
    "Scenario",
    "ScenarioFactory",
    "ToolOutcome",
    "UnknownScenario",
    "register_scenario",
    "scenario_factory",
    "scenario_for",
    "scenario_names",
    "unregister_scenario",
]
