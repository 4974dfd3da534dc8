"""The diagnosis of a replayed request that matches no recorded call, by itself."""

from __future__ import annotations

from engine.program.matching import describe


def test_a_difference_past_the_first_80_characters_is_shown() -> None:
    """Two long values that differ late (a tool call's id at the end of its JSON) are shown
    around where they differ, not as the same 80 first characters twice."""
    recorded = '[{"function": {"arguments": "' + "x" * 100 + '"}, "id": "call_solver_1_0"}]'
    got = recorded.replace("call_solver_1_0", "call_solver_2_0")
    text = describe(("messages[2].tool_calls", recorded, got))
    shown = text.split("recorded ", 1)[1].split(", got ")
    assert shown[0] != shown[1]
    assert "call_solver_1_0" in shown[0] and "call_solver_2_0" in shown[1]
    assert all(len(s) <= 84 for s in shown)  # 80 characters, quotes and ellipses


def test_short_values_are_shown_whole_and_long_ones_cut_alike() -> None:
    assert describe(("messages[0].content", "hello", "hello!")) == (
        "messages[0].content differs: recorded 'hello', got 'hello!'"
    )
    text = describe(("m", "a" * 200, "b" * 200))
    assert text.count("…") == 2 and "a" * 79 in text and "b" * 79 in text
    assert describe(("m", None, "x")).startswith("m is new (got 'x'")
