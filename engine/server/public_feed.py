"""The server's read of a run before the verdict: public events only.

Interim adapter with the same signature as `engine.public.public_events` (the project's one
public read model, being built on its own branch); it is replaced by that module once merged.
It yields run-level facts everyone sees, the crew's messages, tool calls and results, control
events, the end of the run and, after an accusation, the verdict. Never the mole assignment and
never a recorded LLM request (the mole's prompt holds its secret instructions).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from engine import events as ev
from engine.journal import Journal


def public_event(seq: int, e: ev.Event) -> dict[str, Any] | None:
    """The public, JSON-able form of one event, or None for an event that is not public."""
    base: dict[str, Any] = {"seq": seq, "step": e.step}
    if isinstance(e, ev.RunStarted):
        return {
            **base,
            "kind": "run_started",
            "scenario": e.scenario,
            "agents": list(e.agents),
            "rounds": e.rounds,
            "policy": e.policy.get("name"),
            "seed": e.root_seed,
        }
    if isinstance(e, ev.ChatMessage):
        return {**base, "kind": "message", "agent": e.agent, "text": e.text}
    if isinstance(e, ev.ToolCall):
        return {**base, "kind": "tool_call", "agent": e.agent, "tool": e.tool, "param": e.param}
    if isinstance(e, ev.ToolResult):
        return {
            **base,
            "kind": "tool_result",
            "agent": e.agent,
            "tool": e.tool,
            "param": e.param,
            "success": e.ok,
            "output": e.output,
            "error": e.error,
        }
    if isinstance(e, ev.Control):
        return {**base, "kind": "control", "action": e.action, "reason": e.reason}
    if isinstance(e, ev.RunEnded):
        return {
            **base,
            "kind": "run_ended",
            "status": e.status,
            "outcome": dict(e.outcome) if e.outcome else None,
            "error": e.error,
        }
    if isinstance(e, ev.SuspicionDeclared):
        return {
            **base,
            "kind": "verdict",
            "suspect": e.suspect,
            "verdict": e.verdict,
            "mole": e.mole,
            "strategy": e.strategy,
        }
    return None


# kinds whose payload is never decoded here: skipping them by the row's kind column means the
# secret and the recorded prompts are not even read into memory
_SKIPPED_KINDS = frozenset({"mole_assigned", "llm_call", "intervention"})


def public_events(
    journal: Journal, run_id: str, after_seq: int = -1
) -> Iterator[tuple[int, dict[str, Any]]]:
    """(seq, event) for every public event of the run's history with seq > after_seq."""
    for stored in journal.read(run_id, after_seq + 1):
        if stored.kind in _SKIPPED_KINDS:
            continue
        data = public_event(stored.seq, stored.event)
        if data is not None:
            yield stored.seq, data
