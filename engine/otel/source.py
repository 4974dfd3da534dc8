"""What an export may read of a run: the public view, and the public facts of its LLM calls.

The rule (docs/decisions.md, entry 17): an export is a function of what is public. For a run
whose scenario can hold a secret (a secret agent's recorded request holds its instructions, and
the run's seeds may decide who that agent is), that is

- the public view: messages as the crew saw them, tool usage, controls, interventions, outcome;
- of each LLM call only what is a function of its public reply or of the run's public
  configuration: the model, the finish reason and the reply's token count.

Never: the recorded request, its token count and latency (the mole's prompt is longer, so both
betray it), seeds, the secret event, the verdict of `car accuse` (the reveal).

Runs made by `car import` are transparent: their requests came from a trace file the user
already had, and no secret was ever recorded, so their exports carry the recorded request,
seed and token counts too. Which scenarios are transparent is decided by the scenario's name,
never by the presence of a secret event (presence would betray a run played with no secret).
"""

from __future__ import annotations

from typing import Any

import msgspec

from engine.journal import Journal
from engine.public import PublicMessage, PublicRun, PublicToolUse, public_view

TRANSPARENT_SCENARIOS = frozenset({"imported"})


class LlmFacts(msgspec.Struct, frozen=True, kw_only=True):
    """One LLM call as an export may show it. The `request*`, `seed`, `prompt_tokens` and
    `latency_ms` fields are filled only for transparent runs."""

    step: int
    agent: str
    model: str
    finish_reason: str
    completion_tokens: int = 0
    request: list[dict[str, Any]] | None = None
    seed: int | None = None
    prompt_tokens: int | None = None
    latency_ms: float | None = None


class _PublicLlmRow(msgspec.Struct, frozen=True, tag_field="kind", tag="llm_call"):
    """An llm_call payload decoded with the public fields only: msgspec skips the request
    without building it, so the recorded prompt never becomes a Python object here."""

    agent: str
    model: str
    finish_reason: str
    step: int | None = None
    completion_tokens: int = 0


_public_llm = msgspec.msgpack.Decoder(_PublicLlmRow)


class ExportSource(msgspec.Struct, frozen=True):
    run: PublicRun
    transparent: bool
    llm: dict[int, LlmFacts]  # step -> the step's LLM call (absent for forced actions)
    created_at: str  # when the run (or branch) was created: the journal's recorded time
    model: str | None  # the configured model (the policy's, the same for every agent)
    provider: str | None  # gen_ai.provider.name of the policy's API


def read_source(journal: Journal, run_id: str) -> ExportSource:
    """Everything an export of this run reads, nothing more."""
    info = journal.run(run_id)
    run = public_view(journal, info.run_id)
    transparent = run.scenario in TRANSPARENT_SCENARIOS
    llm: dict[int, LlmFacts] = {}
    model: str | None = None
    provider: str | None = None
    for stored in journal.read(info.run_id):
        if stored.kind == "run_started":
            started = stored.event
            policy = getattr(started, "policy", {}) or {}
            model = str(policy["model"]) if policy.get("model") else None
            provider = _provider(policy)
        if stored.kind != "llm_call" or stored.step is None:
            continue
        if transparent:
            full = stored.event
            llm[stored.step] = LlmFacts(
                step=stored.step,
                agent=full.agent,  # type: ignore[union-attr]
                model=full.model,  # type: ignore[union-attr]
                finish_reason=full.finish_reason,  # type: ignore[union-attr]
                completion_tokens=full.completion_tokens,  # type: ignore[union-attr]
                request=[dict(m) for m in full.request],  # type: ignore[union-attr]
                seed=full.seed,  # type: ignore[union-attr]
                prompt_tokens=full.prompt_tokens,  # type: ignore[union-attr]
                latency_ms=full.latency_ms,  # type: ignore[union-attr]
            )
        else:
            row = _public_llm.decode(stored.payload)
            llm[stored.step] = LlmFacts(
                step=stored.step,
                agent=row.agent,
                model=row.model,
                finish_reason=row.finish_reason,
                completion_tokens=row.completion_tokens,
            )
    return ExportSource(run, transparent, llm, info.created_at, model, provider)


def _provider(policy: dict[str, Any]) -> str | None:
    """The GenAI provider name of a policy: the API it speaks, or car's own embedded ones."""
    if policy.get("provider"):
        return str(policy["provider"])
    name = str(policy.get("name", ""))
    if name == "openai":
        return "openai"
    return f"car.{name}" if name else None


__all__ = [
    "ExportSource",
    "LlmFacts",
    "PublicMessage",
    "PublicRun",
    "PublicToolUse",
    "public_view",
    "read_source",
]
