"""What mutation testing of engine/detect/rules.py showed unchecked, as hand-worked cases:
message anomaly (length deviation, its cap, hesitation per message), information quality
and timing summed over several messages, agents without tools or messages before others,
and empty keyword lists."""

from __future__ import annotations

import math

import pytest

from engine.detect.rules import (
    Msg,
    Terms,
    ToolUse,
    information_quality_scores,
    message_anomaly_scores,
    timing_scores,
    tool_usage_scores,
)


def test_message_anomaly_by_hand() -> None:
    """Lengths 2 and 4 (a), 6 (b), 10 (c): mean 5.5, population std sqrt(8.75); each score
    is |own mean - 5.5| / std / 2. An agent without messages (d, listed before b and c)
    scores 0 and does not stop the others; an unlisted agent's message is left out."""
    msgs = [
        Msg("a", "xx"),
        Msg("a", "xxxx"),
        Msg("b", "x" * 6),
        Msg("c", "x" * 10),
        Msg("z", "x" * 100),
    ]
    got = message_anomaly_scores(msgs, ["a", "d", "b", "c"])
    std = math.sqrt(8.75)
    assert got == pytest.approx(
        {"a": 2.5 / std / 2, "d": 0.0, "b": 0.5 / std / 2, "c": 4.5 / std / 2}
    )


def test_message_anomaly_small_std_and_the_cap() -> None:
    """A std below 1 still counts (lengths 2 and 3: std 0.5, both 0.5); an outlier of 50
    among seven of length 1 is 2.6 std units away, capped at 1."""
    assert message_anomaly_scores([Msg("a", "xx"), Msg("b", "xxx")], ["a", "b"]) == {
        "a": 0.5,
        "b": 0.5,
    }
    msgs = [Msg("a", "x")] * 7 + [Msg("b", "x" * 50)]
    got = message_anomaly_scores(msgs, ["a", "b"])
    assert got["b"] == 1.0
    mean = 57 / 8
    std = math.sqrt((7 * (1 - mean) ** 2 + (50 - mean) ** 2) / 8)
    assert got["a"] == pytest.approx((mean - 1) / std / 2)


def test_hesitation_is_counted_per_message() -> None:
    """Equal lengths (std 0): the score is hesitation markers per message: one "hmm" in two
    messages is 0.5."""
    msgs = [Msg("a", "hmm ab"), Msg("a", "cd efg"), Msg("b", "xyzxyz")]
    assert message_anomaly_scores(msgs, ["a", "b"]) == {"a": 0.5, "b": 0.0}


def test_information_quality_sums_over_messages() -> None:
    """a: "camera guard maybe" and "probably vault": 3 concrete, 2 vague, so 2 / 5; b has
    no keyword: 0."""
    msgs = [Msg("a", "camera guard maybe"), Msg("a", "probably vault"), Msg("b", "hello")]
    assert information_quality_scores(msgs, ["a", "b"]) == {"a": pytest.approx(0.4), "b": 0.0}


def test_timing_sums_over_messages() -> None:
    """a: timing 2 (minute, hour), contradiction 1 (actually, in its first message); b:
    timing 1, contradiction 1. Normalised by the top agent: a 0.5 x 1 + 0.5 x 1, b 0.5 x 0.5
    + 0.5 x 1."""
    msgs = [Msg("a", "actually one minute"), Msg("a", "an hour"), Msg("b", "the time is wrong")]
    assert timing_scores(msgs, ["a", "b"]) == {"a": 1.0, "b": 0.75}
    assert timing_scores([], []) == {}


def test_tool_usage_agent_without_tools_does_not_stop_the_others() -> None:
    """Listed before b, an agent without tool calls scores 0 and b still gets its score:
    crew average 3/4, b's rate 1/2, so (0.25 / 0.75) x 1.5 = 0.5."""
    tools = [ToolUse("a", "t", True), ToolUse("a", "t", True)]
    tools += [ToolUse("b", "t", False), ToolUse("b", "t", True)]
    assert tool_usage_scores(tools, ["a", "n", "b"]) == pytest.approx(
        {"a": 0.0, "n": 0.0, "b": 0.5}
    )


def test_phrases_win_over_their_first_word() -> None:
    """Longest first: "not sure" is found as the phrase, not as "not"."""
    assert Terms(["not", "not sure"]).found("I am Not  sure") == {"not sure"}


def test_empty_keyword_list_finds_nothing() -> None:
    """A list with no terms (or only blanks) finds and counts nothing."""
    for terms in (Terms([]), Terms(["  "])):
        for text in ("any  text", "", " - "):  # an empty pattern would match between spaces
            assert terms.found(text) == set()
            assert terms.present(text) == 0
            assert terms.occurrences(text) == 0
