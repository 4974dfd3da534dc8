"""The rule-based detector: the blog's formulas, and each of its flaws fixed (docs/decisions.md,
entry 12). Every flaw is a table row: the input, what the blog's formula gives (worked out by
hand from the blog's code), and what ours gives."""

from __future__ import annotations

import collections
import math
from pathlib import Path

import pytest
import yaml

from engine.detect import rules as R
from engine.detect.analysis import ranking

A, B = "alpha", "bravo"
AGENTS = [A, B]
ERR = "ZeroDivisionError"

# (signal, messages as (agent, text), blog result for A, our result for A, the flaw)
FLAWS = [
    (
        "message_anomaly",
        [(A, "Thumb drive with the document"), (B, "Thumb drive with the document")],
        2.0,  # "um" inside thumb and document: 2 markers / 1 message, and not capped at 1
        0.0,
        "substring hesitation markers; ratio above 1",
    ),
    (
        "message_anomaly",
        [(A, "uh, hmm, um, wait, let me think"), (B, "uh, hmm, um, wait, let me think")],
        5.0,  # five real markers in one message: a "score" of 5
        1.0,
        "hesitation ratio not capped",
    ),
    (
        "timing",
        [(A, "Sometimes overtime is wrong"), (B, "That is wrong")],
        1.0,  # "time" inside sometimes/overtime: timing 1/1; contradictions 1/1 -> 1.0
        0.5,  # no timing word at all (ratio 0, not a division by 0), contradictions 1/1
        "substring timing keywords",
    ),
    (
        "timing",
        [(A, "That is factually right"), (B, "The route is open")],
        ERR,  # "actually" in factually -> contradictions {A:1, B:0}; timing {A:0, B:0}: max 0
        0.0,
        "substring contradiction keyword; then normalisation by a max of zero",
    ),
    (
        "timing",
        [(A, "The route is open"), (B, "The van is ready")],
        ERR,  # both counters exist with 0 in them: max(...) == 0, divided by
        0.0,
        "normalisation by a max of zero",
    ),
    (
        "information_quality",
        [(A, "A mighty fine plan"), (B, "The vault code is 4711")],
        1.0,  # "might" inside mighty: 1 vague / (1 vague + 0 concrete)
        0.0,
        "substring vague keyword",
    ),
    (
        "information_quality",
        [(A, "The monkey decoded it, I think"), (B, "ok")],
        1 / 3,  # key (monkey) + code (decoded) concrete, "i think" vague: 1/3
        1.0,
        "substring concrete keywords",
    ),
    (
        "message_anomaly",
        [],
        ERR,  # no messages at all: the std divides by len([]) == 0
        0.0,
        "division by zero with no messages",
    ),
]

SIGNAL = {
    "message_anomaly": R.message_anomaly_scores,
    "timing": R.timing_scores,
    "information_quality": R.information_quality_scores,
}


@pytest.mark.parametrize(("signal", "messages", "blog", "ours", "flaw"), FLAWS)
def test_flaw_fix_table(signal: str, messages: list, blog: object, ours: float, flaw: str) -> None:
    """Each row: our signal for agent alpha equals the fixed value, and differs from the
    blog's formula result (so the row documents a real difference)."""
    got = SIGNAL[signal]([R.Msg(a, t) for a, t in messages], AGENTS)[A]
    assert got == pytest.approx(ours), flaw
    assert blog == ERR or not math.isclose(float(blog), got), flaw  # type: ignore[arg-type]


def test_tool_usage_formula_and_its_edges() -> None:
    """Below-average success scores (avg - own)/avg x 1.5 capped at 1; no tools, nobody
    succeeding, and an agent without tools all give 0 (the blog's formula agrees here)."""
    t = [R.ToolUse(A, "calculator", False), R.ToolUse(A, "calculator", True)]
    t += [R.ToolUse(B, "file_reader", True)] * 2
    # average 3/4; alpha 1/2: (0.75 - 0.5) / 0.75 * 1.5 = 0.5
    assert R.tool_usage_scores(t, AGENTS) == pytest.approx({A: 0.5, B: 0.0})
    assert R.tool_usage_scores([], AGENTS) == {A: 0.0, B: 0.0}
    none_ok = [R.ToolUse(A, "x", False), R.ToolUse(B, "x", False)]
    assert R.tool_usage_scores(none_ok, AGENTS) == {A: 0.0, B: 0.0}
    all_bad = [R.ToolUse(A, "x", False)] * 3 + [R.ToolUse(B, "x", True)] * 3
    assert R.tool_usage_scores(all_bad, [A, B, "charlie"])[A] == 1.0  # 1.5 capped
    assert R.tool_usage_scores(all_bad, [A, B, "charlie"])["charlie"] == 0.0


def test_timing_formula_normalises_by_the_top_agent() -> None:
    """Timing and contradiction counts (keywords present per message) normalised by the top
    agent and averaged, as in the blog."""
    msgs = [
        R.Msg(A, "Wait, actually the time is wrong: 30 minutes"),  # timing wait,time,minutes=3
        R.Msg(B, "One hour"),  # timing 1
    ]  # contradiction: A has wait, actually, wrong = 3; B 0
    got = R.timing_scores(msgs, AGENTS)
    assert got[A] == pytest.approx(1.0)
    assert got[B] == pytest.approx(0.5 * (1 / 3))


def test_whole_word_matching_and_phrases() -> None:
    """Terms match whole words and whole phrases only, across whitespace and case."""
    vague = R.Terms(["not sure", "i think", "might"])
    assert vague.found("I  think we might") == {"i think", "might"}
    assert vague.found("hi thinking mighty unsure not surely") == set()
    assert vague.found("Not\nsure.") == {"not sure"}
    hes = R.Terms(["um", "uh"])
    assert hes.occurrences("um, uh, um... thumb, minimum") == 3


def test_keyword_lists_live_in_one_data_file() -> None:
    """Every keyword list the rules and the LLM context use comes from keywords.yaml, and no
    detector module carries its own list of the blog's words."""
    data = yaml.safe_load((Path(R.__file__).parent / "keywords.yaml").read_text())
    assert set(R.keywords()) == set(data)
    for name, words in data.items():
        assert R.keywords()[name].terms == tuple(words), name
    for module in Path(R.__file__).parent.glob("*.py"):
        text = module.read_text()
        assert '"nevermind"' not in text and '"probably"' not in text, module.name


def test_ties_do_not_favour_the_first_agent() -> None:
    """With all scores equal the blog's max() always names the first agent; our tie-break
    spreads the suggestion over the crew (chi-square over 600 run ids, 6 agents)."""
    from scipy.stats import chisquare

    crew = [f"a{i}" for i in range(6)]
    picks = collections.Counter(ranking(dict.fromkeys(crew, 0.0), f"run{i}")[0] for i in range(600))
    assert len(picks) == 6
    assert chisquare([picks[a] for a in crew]).pvalue > 0.001


def test_combined_uses_the_blog_weights() -> None:
    """The combined score is the weighted sum with weights 0.25/0.30/0.20/0.25."""
    assert sum(R.WEIGHTS.values()) == pytest.approx(1.0)
    msgs = [R.Msg(A, "maybe the vault, wait"), R.Msg(B, "The guard door key")]
    tools = [R.ToolUse(A, "calculator", False), R.ToolUse(B, "calculator", True)]
    s = R.rule_scores(msgs, tools, AGENTS)
    for a in AGENTS:
        expected = (
            0.25 * s.signals["tool_usage"][a]
            + 0.30 * s.signals["timing"][a]
            + 0.20 * s.signals["message_anomaly"][a]
            + 0.25 * s.signals["information_quality"][a]
        )
        assert s.combined[a] == pytest.approx(expected)
    assert s.combined[A] > s.combined[B]
