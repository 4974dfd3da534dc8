"""What mutation testing of engine/heist/tools.py showed unchecked: every result names its
tool and carries the exact reason, a failed result without a reason reads "failed", empty
quotes unquote to nothing, the number bound itself is allowed, long output is cut with a
note, and the file listing leaves out directories."""

from __future__ import annotations

from pathlib import Path

from engine.heist.tools import (
    MAX_NUMBER,
    MAX_OUTPUT_CHARS,
    Toolbox,
    ToolResult,
    _bounded,
    _render_rows,
    _unquote,
    observation_for,
)
from engine.heist.world import make_world


def _tools(tmp_path: Path) -> Toolbox:
    return Toolbox(make_world(5), root=tmp_path)


def test_results_name_their_tool_and_exact_reason(tmp_path: Path) -> None:
    """Unknown tools, two statements, attribute access and a NUL byte: each a failed result
    of the tool asked for, with the whole reason."""
    t = _tools(tmp_path)
    assert t.run("teleport", "x") == ToolResult(
        "teleport",
        "x",
        False,
        "",
        "unknown tool 'teleport'; available tools: calculator, file_reader, database_query",
    )
    assert t.run("database_query", "SELECT 1; SELECT 2") == ToolResult(
        "database_query", "SELECT 1; SELECT 2", False, "", "only one statement per query is allowed"
    )
    assert t.run("database_query", "SELECT 1 AS one") == ToolResult(
        "database_query", "SELECT 1 AS one", True, "one\n1"
    )
    assert t.run("calculator", "a.b").error == "attribute access is not allowed"
    assert t.run("file_reader", "a\x00b").error == "file name contains a NUL byte"


def test_listing_leaves_out_directories(tmp_path: Path) -> None:
    """A missing file's error lists the regular files only, not a directory beside them."""
    t = _tools(tmp_path)
    (t.files_dir / "sub").mkdir()
    assert t.run("file_reader", "nope.txt").error == (
        "no such file 'nope.txt'; available: building_layout.txt, camera_schedule.txt, "
        "routes.txt, vault_specs.txt"
    )


def test_failed_observation_without_a_reason() -> None:
    """A failed result with no reason reaches the agent as "failed"."""
    obs = observation_for(ToolResult("calculator", "1", False, ""), 3)
    assert (obs.step, obs.tool, obs.ok, obs.output) == (3, "calculator", False, "failed")


def test_unquote_and_bound_edges() -> None:
    """Two quotes unquote to the empty text; a number exactly at the bound is allowed."""
    assert _unquote("''") == ""
    assert _unquote('"x"') == "x"
    assert _bounded(MAX_NUMBER) == MAX_NUMBER


def test_render_rows_edges() -> None:
    """No columns says so; output over the limit is cut at it with a note saying where."""
    assert _render_rows([], []) == "(no columns)"
    out = _render_rows(["c"], [("x" * 300,)] * 50)
    note = f"\n[... truncated at {MAX_OUTPUT_CHARS} characters]"
    assert out.endswith(note) and len(out) == MAX_OUTPUT_CHARS + len(note)
