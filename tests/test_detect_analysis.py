"""analyze() on runs that are not tidy ended heists: live, empty, unknown methods or options."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import events as ev
from engine.detect import DetectError, analyze
from engine.journal import Journal

CREW = ["kite", "lark", "moth"]


def _hand_made(j: Journal, texts: list[tuple[str, str]], *, ended: bool) -> str:
    rid = j.create_run("heist")
    j.append(
        rid,
        [
            ev.RunStarted(
                scenario="heist",
                config={},
                agents=CREW,
                policy={"name": "sim"},
                root_seed=1,
                engine_version="test",
                started_at="2026-01-01T00:00:00Z",
                rounds=1,
            )
        ],
    )
    for k, (agent, text) in enumerate(texts):
        j.append(rid, [ev.ChatMessage(step=k, agent=agent, text=text)])
    if ended:
        j.append(rid, [ev.RunEnded(status="completed", outcome={"bad": True})])
    return rid


def test_live_run_gets_rules_but_not_reruns(tmp_path: Path) -> None:
    """A run still recording is analysed by the rules (as the blog's dashboard does mid-game,
    with a warning saying how much was seen); causal and replay refuse it clearly."""
    with Journal(tmp_path / "j.db") as j:
        rid = _hand_made(
            j, [("kite", "Maybe, I think, not sure."), ("lark", "The vault door.")], ended=False
        )
        out = analyze(j, rid)
        assert out["suggested_mole"] == "kite"
        assert any("still recording" in w for w in out["warnings"])
        for method in ("causal", "replay"):
            with pytest.raises(DetectError, match="still recording"):
                analyze(j, rid, method=method)


def test_empty_run_scores_zero_without_crashing(tmp_path: Path) -> None:
    """No messages and no tools: every signal is 0, the suggestion is a tie-break, and the
    output says there was nothing to go on."""
    with Journal(tmp_path / "j.db") as j:
        rid = _hand_made(j, [], ended=True)
        out = analyze(j, rid)
    assert set(out["suspicion_scores"].values()) == {0.0}
    assert out["suggested_mole"] in CREW and out["margin"] == 0.0
    assert any("no messages" in w for w in out["warnings"])


def test_bad_method_and_option_fail_loudly(tmp_path: Path) -> None:
    """A misspelt method or option is an error naming the valid ones, never ignored."""
    with Journal(tmp_path / "j.db") as j:
        rid = _hand_made(j, [("kite", "ok")], ended=True)
        with pytest.raises(DetectError, match="expected one of: rules, llm"):
            analyze(j, rid, method="rulez")
        with pytest.raises(DetectError, match="unknown detection option"):
            analyze(j, rid, kmax=3)
