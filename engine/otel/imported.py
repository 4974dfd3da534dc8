"""What marks a run imported from a trace, and the refusal to re-run one.

A module of its own so that the commands that re-run a program (fork, fidelity, attribute,
the causal and replay detectors) and the scenario registry check it without loading the
importer (`engine.otel.importer`, which writes such runs)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.errors import EngineError

if TYPE_CHECKING:
    from engine.journal import Journal

#: the scenario of every run `car import` writes
IMPORTED_SCENARIO = "imported"

#: what an imported run can be analysed with: the detectors that read the transcript only
READABLE_BY = (
    "show, state, diff, export and the rules and llm detectors (`car detect --method rules`, "
    "`llm` or `rules+llm`) read it"
)


class NotReRunnable(EngineError):
    """The run was imported from a trace: there is no program to re-run."""


#: what the work refused by default needs instead
RERUN_NEEDS = (
    "forking and replay need a run recorded by car (a heist, or a program recorded through car)"
)


def not_rerunnable(run_id: str | None, needs: str = RERUN_NEEDS) -> NotReRunnable:
    """The one-line refusal for run `run_id` (None: a run whose id is not at hand): it was
    imported, `needs` says what the refused work needs instead, and what reads such a run."""
    run = f"run {run_id!r} was" if run_id is not None else "this run was"
    return NotReRunnable(
        f"{run} imported from a trace and has no program to re-run; {needs}; {READABLE_BY}"
    )


#: the scenario of the runs that record a detector's model call (engine.detect.journaling)
DETECTION_SCENARIO = "detection"


def ensure_rerunnable(journal: Journal, run_id: str) -> None:
    """Fork, fidelity and attribution re-run a program; an imported trace has none, and the
    record of a detector's model call is no run of agents to re-run."""
    info = journal.run(run_id)
    if info.scenario == IMPORTED_SCENARIO:
        raise not_rerunnable(info.run_id)
    if info.scenario == DETECTION_SCENARIO:
        raise NotReRunnable(
            f"run {info.run_id!r} is the record of a detector's model call (`car detect"
            " --method llm`), not a run of agents to re-run; show and export read it"
        )
