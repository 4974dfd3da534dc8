"""The Scenario protocol: what the core needs from whatever the agents are doing, and the
registry that finds a scenario by the name its runs record.

Every scenario, whoever drives its steps, says the same four things (`Scenario`):

- what a *step* is: one turn of one agent, `total_steps` of them, by `agents`;
- how a *branch re-runs from s_k*: `fork` makes N journaled child runs of one intervention at
  step k, and `forward_model` gives the attribution estimators their forward runs (each a
  journaled branch too), both run as `Rerun` says (workers, executor, a program's command);
- how an *outcome is scored*: a dict journaled in RunEnded whose `"bad"` (a bool: the run
  failed) is what forks and attribution count;
- its journaled configuration (`run_config`, RunStarted.config), from which the registry
  rebuilds it at any s_k (`ScenarioFactory.from_state`).

Two kinds implement it. A *stepped* scenario (`SteppedScenario`; the heist, and any scenario
written for the core's step loop) is driven by the core: `view(s_k)` says who acts and what it
sees, `messages` renders the request its policy is sent, `tool_calls`/`run_tool` execute the
action's tools, and `outcome` scores the finished transcript; replay and fidelity need these,
and `engine.branching.SteppedForks` gives such a scenario its `fork` and `forward_model` from
the core's loop. A *program-driven* scenario (a recorded program, engine.program) drives its
own steps: its branches re-run the program's command against a proxy that answers from the
journal, and its outcome is the program's own verdict; it implements only `Scenario`.

A scenario implementation is registered under its name, as a lazy "module:attr" reference (the
core never imports an implementation until a run of that scenario is opened) or as the factory
object itself (`register_scenario`). The factory is anything with `from_state(state)`; a class
with a `from_state` classmethod is one.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

from engine.errors import ConfigError, UnknownScenario
from engine.otel.imported import IMPORTED_SCENARIO, not_rerunnable
from engine.policies.base import AgentView, ChatLine
from engine.state import State, fold

if TYPE_CHECKING:
    from engine.attribution.base import ForwardRequest
    from engine.executors.base import ExecutorOptions
    from engine.interventions import ForkReport, Intervention
    from engine.journal import Journal

#: Called as branches complete: (done so far, total planned or None when adaptive).
Progress = Callable[[int, int | None], None]


@dataclass(frozen=True)
class Rerun:
    """How the forward runs of a recorded run are executed: what `car fork` and `car attribute`
    were told beyond the intervention itself. A scenario uses what applies to it and refuses,
    in one line, what cannot (a heist has no command; a program runs no Ray actors)."""

    concurrency: int = 1
    #: base_url / model / timeout for the policy (a program: base_url is its upstream)
    policy_override: dict[str, Any] | None = None
    #: branches made before under the same deterministic key are read back, not run again
    reuse: bool = True
    executor: ExecutorOptions | None = None
    #: the command that re-runs a program-driven scenario (after `--` on the CLI)
    command: tuple[str, ...] = ()


class ClosingForwardModel(Protocol):
    """The attribution estimators' ForwardModel (engine.attribution.base, not imported here:
    it loads the estimators) over a recorded run's branches: it holds workers until closed
    and counts the branches an attribution reports."""

    @property
    def n_steps(self) -> int: ...

    @property
    def step_agents(self) -> Sequence[str | None]: ...

    @property
    def step_labels(self) -> Sequence[str]: ...

    def message(self, k: int) -> str:
        """What step k said (shown beside its effect)."""
        ...

    def run_batch(self, requests: Sequence[ForwardRequest]) -> list[bool]: ...

    @property
    def created(self) -> int:
        """Branches this model added to the journal."""
        ...

    @property
    def reused(self) -> int:
        """Forward runs answered by a branch made earlier under the same key."""
        ...

    def executor_stats(self) -> dict[str, Any] | None:
        """What the executor did (engine.executors.base.ExecutorStats), or None without one."""
        ...

    def __enter__(self) -> ClosingForwardModel: ...

    def __exit__(self, exc_type: object, *rest: object) -> None: ...


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
    """One scenario instance, bound to one run's configuration: what every scenario says."""

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

    def fork(
        self,
        journal: Journal,
        run_id: str,
        iv: Intervention,
        n: int,
        *,
        seed: int = 0,
        rerun: Rerun = ...,
        progress: Progress | None = None,
    ) -> ForkReport:
        """N journaled branches of run `run_id`, each forked at step iv.k with `iv` applied
        and run to its end (branch i seeded by engine.interventions.branch_seed_for(seed, i));
        their outcome distribution."""
        ...

    def forward_model(
        self, journal: Journal, run_id: str, rerun: Rerun = ...
    ) -> ClosingForwardModel:
        """The estimators' ForwardModel over failed run `run_id`'s branches; used as a context
        manager, it releases its workers on exit."""
        ...


class SteppedScenario(Scenario, Protocol):
    """A scenario the core's step loop drives (engine.runtime.episode): replay, fidelity and
    the core's branches rebuild every step from s_k through these members."""

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
    names) when there is none, and NotReRunnable for the runs `car import` made (scenario
    `imported`, which no implementation re-runs, unless one is registered for it)."""
    with _lock:
        hit = _loaded.get(name)
        target = _registered.get(name)
    if hit is not None:
        return hit
    if target is None and name == IMPORTED_SCENARIO:
        # a run `car import` made from a trace: no implementation, nothing to re-run
        raise not_rerunnable(None)
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


def stepped_for(state: State, what: str) -> SteppedScenario:
    """The scenario of `state` when the core's step loop can drive it; for a program-driven
    one, a one-line ConfigError saying that `what` needs a stepped scenario and what to use."""
    scenario = scenario_for(state)
    # stepped is what the loop calls; fork/forward_model are every scenario's (checked on use)
    if not all(callable(getattr(scenario, m, None)) for m in _STEPPED_MEMBERS):
        hint = getattr(scenario, "rerun_hint", "")
        raise ConfigError(
            f"{what} rebuilds each step from s_k, and a {scenario.name!r} run drives its own "
            f"steps" + (f": {hint}" if hint else "")
        )
    return cast(SteppedScenario, scenario)


_STEPPED_MEMBERS = ("view", "messages", "tool_calls", "run_tool", "outcome")


def scenario_of_run(journal: Journal, run_id: str) -> Scenario:
    """The scenario of recorded run `run_id` (id or unique prefix), rebuilt from its
    RunStarted alone."""
    from engine.errors import JournalError

    info = journal.run(run_id)
    if info.scenario == IMPORTED_SCENARIO and IMPORTED_SCENARIO not in scenario_names():
        raise not_rerunnable(info.run_id)
    first = next(journal.read(info.run_id, 0, 1), None)
    if first is None:
        raise JournalError(f"run {info.run_id!r} has no RunStarted event")
    return scenario_for(fold([first.event]))


__all__ = [
    "BUILTIN_SCENARIOS",
    "ClosingForwardModel",
    "Progress",
    "Rerun",
    "Scenario",
    "ScenarioFactory",
    "SteppedScenario",
    "ToolOutcome",
    "UnknownScenario",
    "register_scenario",
    "scenario_factory",
    "scenario_for",
    "scenario_names",
    "scenario_of_run",
    "stepped_for",
    "unregister_scenario",
]
