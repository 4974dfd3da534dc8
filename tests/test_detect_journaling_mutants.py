"""engine/detect/journaling.py, field by field: the `detection` run that records one LLM step
of a detection (docs/decisions.md, entry 13) — what it holds after an answer and after a
failure to get one."""

from __future__ import annotations

import datetime as dt
from importlib import metadata
from pathlib import Path

from engine import events as ev
from engine.detect.journaling import journal_llm_step
from engine.detect.llm import LlmAnswer
from engine.journal import Journal
from engine.verify import verify_journal

PROMPT = [
    {"role": "system", "content": "You are a detective."},
    {"role": "user", "content": "kite: maybe"},
]
URL = "http://127.0.0.1:9/v1"


def _version() -> str:
    try:
        return metadata.version("causal-agent-replay")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def test_an_answered_step_is_recorded_whole(tmp_path: Path) -> None:
    """After an answer: a new run of scenario "detection" labelled "detect <run> <method>",
    with three events — RunStarted (the analysed run and method as config, the one agent
    "detector", the server and the model asked, the seed, this engine's version, a UTC start
    time), the LlmCall (the prompt, seed, the model that answered, raw answer, finish
    reason, token counts, latency, server) and RunEnded "completed" with the scores and a
    copy of the warnings."""
    answer = LlmAnswer(
        raw='{"kite": 0.9}',
        model="served-model",
        finish_reason="length",
        prompt_tokens=17,
        completion_tokens=5,
        latency_ms=12.5,
    )
    warnings = ["a warning"]
    with Journal(tmp_path / "j.db") as j:
        before = dt.datetime.now(dt.UTC)
        rid = journal_llm_step(
            j,
            "run-a",
            method="rules+llm",
            base_url=URL,
            model="asked-model",
            seed=4242,
            prompt=PROMPT,
            answer=answer,
            error=None,
            scores={"kite": 0.9, "lark": 0.1},
            warnings=warnings,
        )
        after = dt.datetime.now(dt.UTC)
        warnings.append("added later")  # the record keeps the warnings it was handed
        info = j.run(rid)
        events = j.events(rid)
        assert verify_journal(j, rid).ok
    assert info.scenario == "detection" and info.label == "detect run-a rules+llm"
    assert info.parent_run_id is None
    started, call, ended = events
    assert isinstance(started, ev.RunStarted)
    assert started.scenario == "detection"
    assert started.config == {"analysed_run": "run-a", "method": "rules+llm"}
    assert started.agents == ["detector"]
    assert started.policy == {"name": "openai", "base_url": URL, "model": "asked-model"}
    assert started.root_seed == 4242 and started.engine_version == _version()
    t = dt.datetime.fromisoformat(started.started_at)
    assert t.utcoffset() == dt.timedelta(0) and before <= t <= after
    assert isinstance(call, ev.LlmCall)
    assert (call.step, call.agent, call.request, call.seed) == (0, "detector", PROMPT, 4242)
    assert (call.model, call.response, call.finish_reason) == (
        "served-model",
        '{"kite": 0.9}',
        "length",
    )
    assert (call.prompt_tokens, call.completion_tokens, call.latency_ms) == (17, 5, 12.5)
    assert call.server == URL
    assert isinstance(ended, ev.RunEnded)
    assert ended.status == "completed" and ended.error is None
    assert ended.outcome == {
        "analysed_run": "run-a",
        "method": "rules+llm",
        "llm_scores": {"kite": 0.9, "lark": 0.1},
        "warnings": ["a warning"],
    }


def test_a_failed_step_is_recorded_as_failed(tmp_path: Path) -> None:
    """No answer: the LlmCall names the model asked, an empty response, finish reason
    "error", zero tokens and latency; RunEnded is "failed" with the error and no outcome."""
    with Journal(tmp_path / "j.db") as j:
        rid = journal_llm_step(
            j,
            "run-b",
            method="llm",
            base_url=URL,
            model="asked-model",
            seed=7,
            prompt=PROMPT,
            answer=None,
            error="LLM server 'x' is unreachable",
            scores=None,
            warnings=["w"],
        )
        info = j.run(rid)
        started, call, ended = j.events(rid)
    assert info.label == "detect run-b llm"
    assert isinstance(started, ev.RunStarted) and started.root_seed == 7
    assert isinstance(call, ev.LlmCall)
    assert (call.model, call.response, call.finish_reason) == ("asked-model", "", "error")
    assert (call.prompt_tokens, call.completion_tokens, call.latency_ms) == (0, 0, 0.0)
    assert call.request == PROMPT and call.seed == 7 and call.server == URL
    assert isinstance(ended, ev.RunEnded)
    assert ended.status == "failed" and ended.outcome == {}
    assert ended.error == "LLM server 'x' is unreachable"


def test_each_step_is_a_run_of_its_own(tmp_path: Path) -> None:
    """Two steps of the same analysed run are two detection runs, each with its own three
    events (nothing is appended to an earlier one)."""
    with Journal(tmp_path / "j.db") as j:
        kw = dict(
            method="llm",
            base_url=URL,
            model="m",
            seed=1,
            prompt=PROMPT,
            answer=None,
            error="e",
            scores=None,
            warnings=[],
        )
        a = journal_llm_step(j, "run-c", **kw)  # type: ignore[arg-type]
        b = journal_llm_step(j, "run-c", **kw)  # type: ignore[arg-type]
        assert a != b
        assert len(j.events(a)) == len(j.events(b)) == 3
