"""What marks a run imported from a trace, and the refusal to re-run one.

A module of its own so that the commands that re-run a program (fork, fidelity, attribute)
check it without loading the importer (`engine.otel.importer`, which writes such runs)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.errors import EngineError

if TYPE_CHECKING:
    from engine.journal import Journal

#: the scenario of every run `car import` writes
IMPORTED_SCENARIO = "imported"


class NotReRunnable(EngineError):
    """The run was imported from a trace: there is no program to re-run."""


def ensure_rerunnable(journal: Journal, run_id: str) -> None:
    """Fork, fidelity and attribution re-run a program; an imported trace has none."""
    info = journal.run(run_id)
    if info.scenario == IMPORTED_SCENARIO:
        raise NotReRunnable(
            f"run {info.run_id!r} was imported from a trace and has no program to re-run; "
            "forking and replay need a run recorded by car (a heist, or a program recorded "
            "through car)"
        )
