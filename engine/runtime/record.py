"""Recording a new run of any scenario: RunStarted, the scenario's own opening events, every
step through the step loop, RunEnded. A scenario's own `record_*` function decides its
configuration and opening events, then records through here."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine import events as ev
from engine.errors import ConfigError
from engine.journal import Journal
from engine.policies.base import Policy
from engine.policies.registry import policy_spec
from engine.runtime.clock import Clock, SystemClock
from engine.runtime.control import ControlChannel
from engine.runtime.episode import (
    EpisodeResult,
    StepCallback,
    close_after,
    run_episode,
    start_run,
)
from engine.runtime.recorder import DEFAULT_GROUP_MS
from engine.runtime.seeds import step_seed
from engine.scenario import SteppedScenario
from engine.state import DEFAULT_CONTEXT_WINDOW
from engine.version import engine_version

#: The largest root seed (what the server and `car heist --seed` accept: a signed 64-bit int)
MAX_SEED = 2**63 - 1


def run_started(
    scenario: SteppedScenario,
    policy: Policy,
    seed: int,
    started_at: str,
    *,
    rounds: int = 0,
    context_window: int = DEFAULT_CONTEXT_WINDOW,
) -> ev.RunStarted:
    """The first event of a run: everything the registry needs to rebuild the scenario
    (name, run_config) and the policy (its spec) for a replay or a branch."""
    return ev.RunStarted(
        scenario=scenario.name,
        config=scenario.run_config(),
        agents=list(scenario.agents),
        policy=policy_spec(policy),
        root_seed=seed,
        engine_version=engine_version(),
        started_at=started_at,
        rounds=rounds,
        context_window=context_window,
    )


def record_run(
    journal: Journal,
    scenario: SteppedScenario,
    policy: Policy,
    *,
    seed: int,
    opening: Sequence[ev.Event] = (),
    rounds: int = 0,
    context_window: int = DEFAULT_CONTEXT_WINDOW,
    clock: Clock | None = None,
    control: ControlChannel | None = None,
    on_step: StepCallback | None = None,
    server: str | None = None,
    label: str = "",
    group_ms: float = DEFAULT_GROUP_MS,
    on_created: Callable[[str], None] | None = None,
) -> EpisodeResult:
    """Record one run from scratch; step k is decided with step_seed(seed, k).

    `opening` is what the scenario journals after RunStarted and before the first step (a
    secret, say). `on_created(run_id)` is called once the opening events are
    committed (a live viewer can follow the run from then on); `group_ms=0` commits every step
    on its own."""
    if not 0 <= seed <= MAX_SEED:
        # refused before the run exists: RunStarted could not hold it (a run row without its
        # opening events would be left behind, abandoned)
        raise ConfigError(f"root seed must lie within 0..{MAX_SEED}, got {seed!r}")
    clk = clock or SystemClock()
    first = run_started(
        scenario, policy, seed, clk.now_iso(), rounds=rounds, context_window=context_window
    )
    recorder = start_run(journal, scenario.name, [first, *opening], label=label, group_ms=group_ms)
    try:
        if on_created is not None:
            on_created(recorder.run_id)
        return run_episode(
            recorder,
            scenario,
            policy,
            lambda k: step_seed(seed, k),
            [],
            control=control,
            clock=clk,
            on_step=on_step,
            server=server,
        )
    except BaseException as e:
        # Ctrl-C at any moment, also before the episode took the run over (the episode
        # closes the run itself; closing a closed run again writes nothing)
        close_after(recorder, e)
        raise
