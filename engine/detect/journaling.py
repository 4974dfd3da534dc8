"""Journaling the LLM step of a detection: a `detection` run of its own.

The analysed run is closed (it ends with RunEnded, its status derives from its last events), so
the detector never appends to it. Each LLM-based analysis records one small run instead:
RunStarted (scenario "detection", the analysed run id, method, server and model), the LlmCall
(the prompt, seed, model, raw answer, usage and latency — the prompt holds only the public
view) and RunEnded with the parsed scores and warnings. docs/decisions.md, entry 13.
"""

from __future__ import annotations

from typing import Any

from engine import events as ev
from engine.detect.llm import LlmAnswer
from engine.journal import Journal
from engine.otel.imported import DETECTION_SCENARIO
from engine.runtime.clock import SystemClock

SCENARIO = DETECTION_SCENARIO
AGENT = "detector"


def journal_llm_step(
    journal: Journal,
    analysed_run: str,
    *,
    method: str,
    base_url: str,
    model: str,
    seed: int,
    prompt: list[dict[str, str]],
    answer: LlmAnswer | None,
    error: str | None,
    scores: dict[str, float] | None,
    warnings: list[str],
) -> str:
    """Record one LLM detection step; returns the detection run's id."""
    from engine.version import engine_version

    clock = SystemClock()
    outcome: dict[str, Any] = {
        "analysed_run": analysed_run,
        "method": method,
        "llm_scores": scores,
        "warnings": list(warnings),
    }
    events: list[ev.Event] = [
        ev.RunStarted(
            scenario=SCENARIO,
            config={"analysed_run": analysed_run, "method": method},
            agents=[AGENT],
            policy={"name": "openai", "base_url": base_url, "model": model},
            root_seed=seed,
            engine_version=engine_version(),
            started_at=clock.now_iso(),
        ),
        ev.LlmCall(
            step=0,
            agent=AGENT,
            request=prompt,
            seed=seed,
            model=answer.model if answer is not None else model,
            response=answer.raw if answer is not None else "",
            finish_reason=answer.finish_reason if answer is not None else "error",
            prompt_tokens=answer.prompt_tokens if answer is not None else 0,
            completion_tokens=answer.completion_tokens if answer is not None else 0,
            latency_ms=answer.latency_ms if answer is not None else 0.0,
            server=base_url,
        ),
        ev.RunEnded(
            status="failed" if answer is None else "completed",
            outcome=outcome if answer is not None else {},
            error=error,
        ),
    ]
    # the run and its events in one transaction (every event encoded and checked first): an
    # event the journal refuses, an interrupt or a busy journal leaves no run behind
    return journal.create_run(SCENARIO, label=f"detect {analysed_run} {method}", events=events)
