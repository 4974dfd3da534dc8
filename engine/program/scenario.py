"""Recorded programs in the Scenario registry (engine.scenario), under the name "program".

A recorded program is a program-driven scenario: the program, not the core's step loop, drives
its steps - what an agent sees and the request it sends live in the program's own memory, so
s_k cannot rebuild them, and it implements `Scenario` but not `SteppedScenario`. What the
protocol asks of every scenario holds here:

- a step is one chat completion of one agent (agents in the order they first called);
- a branch re-runs from s_k by re-running the program's command against the recording proxy,
  which answers the calls before k from the journal, applies the intervention at call k and
  forwards later calls live (`fork`, `forward_model`: engine.program.forks);
- the outcome is the program's exit status and its outcome command's, judged when it ran
  (journaled in RunEnded; the transcript alone cannot re-judge a program's run).

Core entry points that drive a run step by step (fidelity, the core's own branches) refuse a
program's run in one line (engine.scenario.stepped_for), naming `car replay RUN -- CMD`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.errors import ConfigError
from engine.program.session import SCENARIO, ProgramError
from engine.scenario import ClosingForwardModel, Progress, Rerun
from engine.state import State

if TYPE_CHECKING:
    from engine.interventions import ForkReport, Intervention
    from engine.journal import Journal

RERUN = (
    "a recorded program (scenario 'program') is re-run by its own command, not step by step: "
    "use car replay RUN -- CMD, car fork RUN ... -- CMD or car attribute RUN -- CMD"
)


class ProgramScenario:
    """The Scenario of a recorded program's run."""

    name = SCENARIO
    rerun_hint = RERUN

    def __init__(self, config: dict[str, Any], agents: tuple[str, ...], steps: int) -> None:
        self.config = config
        self.agents = agents
        self.total_steps = steps

    @classmethod
    def from_state(cls, state: State) -> ProgramScenario:
        return cls(dict(state.config), tuple(state.agents), state.step)

    def run_config(self) -> dict[str, Any]:
        return dict(self.config)

    def fork(
        self,
        journal: Journal,
        run_id: str,
        iv: Intervention,
        n: int,
        *,
        seed: int = 0,
        rerun: Rerun = Rerun(),
        progress: Progress | None = None,
    ) -> ForkReport:
        from engine.program.forks import fork_program

        cmd, upstream = _rerun_with(journal, run_id, rerun, "fork")
        return fork_program(
            journal,
            run_id,
            iv,
            n,
            cmd,
            seed=seed,
            concurrency=rerun.concurrency,
            upstream=upstream,
            progress=progress,
        )

    def forward_model(
        self,
        journal: Journal,
        run_id: str,
        rerun: Rerun = Rerun(),
    ) -> ClosingForwardModel:
        from engine.program.forks import ProgramForwardModel

        cmd, upstream = _rerun_with(journal, run_id, rerun, "attribute")
        return ProgramForwardModel(
            journal,
            run_id,
            cmd,
            upstream=upstream,
            concurrency=rerun.concurrency,
            reuse=rerun.reuse,
        )


def _rerun_with(
    journal: Journal, run_id: str, rerun: Rerun, verb: str
) -> tuple[list[str], str | None]:
    """The command and upstream a program's branches run with; one line for what cannot apply.
    A program's branches are local subprocesses of this command, talking to its proxy."""
    if rerun.executor is not None and getattr(rerun.executor, "kind", "local") != "local":
        raise ConfigError(
            "a recorded program (-- CMD) runs its forward runs here, as local subprocesses; "
            "--executor ray applies to heist runs"
        )
    override = dict(rerun.policy_override or {})
    if set(override) - {"base_url"}:
        raise ConfigError(
            "--model/--timeout apply to a recorded program through --do policy --value "
            "'openai:model=...'"
        )
    if not rerun.command:
        shown = journal.run(run_id).run_id
        raise ProgramError(
            f"run {shown!r} is a recorded program: give its command after `--` "
            f"(e.g. car {verb} {shown} ... -- python agents.py)"
        )
    return list(rerun.command), override.get("base_url")
