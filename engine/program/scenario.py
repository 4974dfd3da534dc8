"""Recorded programs in the Scenario registry (engine.scenario), under the name "program".

A recorded program is driven by the program, not by the core's step loop: what an agent sees
and the request it sends live in the program's own memory, so s_k cannot rebuild them (the
protocol's `view`/`messages`/`run_tool`). A program is re-run by its own command through the
recording proxy instead - `car replay RUN -- CMD`, `car fork RUN ... -- CMD` - and every core
entry point that would drive it step by step (fidelity, heist-style forks, the dashboard's
re-runs) gets one clear line saying so when it looks the scenario up.

What the protocol does say about such a run holds here too: its name, its agents (in the
order they first called), its number of steps, its journaled configuration, and its outcome:
the recorded program's exit status and outcome command, judged when it ran (`outcome` below
reads that verdict; the transcript alone cannot re-judge a program's run).
"""

from __future__ import annotations

from typing import Any

from engine.policies.base import AgentView, ChatLine
from engine.program.session import SCENARIO, ProgramError
from engine.state import State

RERUN = (
    "a recorded program (scenario 'program') is re-run by its own command, not step by step: "
    "use car replay RUN -- CMD, car fork RUN ... -- CMD or car attribute RUN -- CMD"
)


class ProgramScenario:
    """The Scenario of a recorded program's run."""

    name = SCENARIO

    def __init__(self, config: dict[str, Any], agents: tuple[str, ...], steps: int) -> None:
        self.config = config
        self.agents = agents
        self.total_steps = steps

    @classmethod
    def from_state(cls, state: State) -> ProgramScenario:
        raise ProgramError(RERUN)

    def run_config(self) -> dict[str, Any]:
        return dict(self.config)

    def view(self, state: State, run_id: str) -> AgentView:
        raise ProgramError(RERUN)

    def messages(self, view: AgentView) -> list[dict[str, str]]:
        raise ProgramError(RERUN)

    def tool_calls(self, text: str) -> list[tuple[str, str]]:
        # a program's tool calls arrive as OpenAI tool calls, journaled as ToolCall events;
        # its message text holds none
        return []

    def run_tool(self, name: str, param: str) -> Any:
        raise ProgramError(RERUN)

    def outcome(self, transcript: list[ChatLine]) -> dict[str, Any]:
        raise ProgramError(RERUN)
