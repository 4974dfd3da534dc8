"""The heist tools: inline call syntax, and three tools that survive hostile parameters."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import re
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.errors import EngineError
from engine.heist.tools import (
    MAX_CALL_OPENINGS,
    MAX_CALLS_PER_MESSAGE,
    MAX_FILE_CHARS,
    MAX_PARAM_CHARS,
    MAX_ROWS,
    Toolbox,
    ToolResult,
    materialise,
    observation_for,
    parse_tool_calls,
)
from engine.heist.world import make_world

WORLD = make_world(5)


@pytest.fixture(scope="module")
def tools() -> Toolbox:
    return Toolbox(WORLD)


# --- parse_tool_calls ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "calls"),
    [
        ("use [TOOL:calculator:50*2] now", [("calculator", "50*2")]),
        ("[TOOL:file_reader:vault_specs.txt]", [("file_reader", "vault_specs.txt")]),
        (
            "[TOOL:database_query:SELECT * FROM guards WHERE shift='night']",
            [("database_query", "SELECT * FROM guards WHERE shift='night'")],
        ),
        ("[TOOL:calculator:01:30]", [("calculator", "01:30")]),
        ("[TOOL:calculator:  7 + 1  ]", [("calculator", "7 + 1")]),
        (
            "[TOOL:database_query:SELECT name FROM guards WHERE name = 'a]b']",
            [("database_query", "SELECT name FROM guards WHERE name = 'a]b'")],
        ),
        ('[TOOL:file_reader:"vault_specs.txt"]', [("file_reader", '"vault_specs.txt"')]),
        ("[TOOL:calculator:[1+2]*3]", [("calculator", "[1+2]*3")]),
        ("[TOOL:file_reader:guard's notes.txt]", [("file_reader", "guard's notes.txt")]),
        ("[TOOL:calculator]", [("calculator", "")]),
        ("[TOOL:calculator:]", [("calculator", "")]),
        (
            "a [TOOL:calculator:1+1] b [TOOL:file_reader:routes.txt] c",
            [("calculator", "1+1"), ("file_reader", "routes.txt")],
        ),
        (
            "[TOOL:database_query:SELECT *\nFROM routes]",
            [("database_query", "SELECT *\nFROM routes")],
        ),
        ("[TOOL:calculator:1+1", []),
        ("[tool:calculator:1+1]", []),
        ("[TOOL::1+1]", []),
        ("[TOOL:9lives:1]", []),
        ("[TOOL:calc ulator:1]", []),
        ("[TOOL:", []),
        ("[TOOL:[TOOL:calculator:2*3]", [("calculator", "2*3")]),
        ("[PLAN:entry_time=01:30]", []),
        ("", []),
    ],
)
def test_parse_tool_calls(text: str, calls: list[tuple[str, str]]) -> None:
    """The grammar in the module docstring: colons, quotes and nested brackets in params."""
    assert parse_tool_calls(text) == calls


def test_parse_tool_calls_is_bounded() -> None:
    """At most MAX_CALLS_PER_MESSAGE calls are taken from one message."""
    text = "[TOOL:calculator:1+1]" * 1000
    assert len(parse_tool_calls(text)) == MAX_CALLS_PER_MESSAGE


@pytest.mark.parametrize(
    "text",
    ["[TOOL:a:" * 200_000, "[TOOL:a:[" * 100_000, "[TOOL:a:'" * 100_000, "x" * 10**6],
)
def test_parse_tool_calls_is_cheap_on_hostile_text(text: str) -> None:
    """Megabytes of unclosed openings are examined only up to the documented bounds: at most
    MAX_CALL_OPENINGS openings, each scanned at most twice (with and without quotes) for at
    most MAX_PARAM_CHARS + 1 characters. Counted, not timed: every character the parser
    looks at goes through the text's __getitem__."""

    class Counted(str):
        looked = 0

        def __getitem__(self, key: Any) -> str:
            Counted.looked += 1
            return str.__getitem__(self, key)

    assert parse_tool_calls(Counted(text)) == []
    assert Counted.looked <= MAX_CALL_OPENINGS * (2 * (MAX_PARAM_CHARS + 1) + 2)


def test_overlong_parameter_is_not_a_call() -> None:
    """A parameter longer than MAX_PARAM_CHARS does not make a call."""
    assert parse_tool_calls(f"[TOOL:calculator:{'1' * (MAX_PARAM_CHARS + 1)}]") == []
    assert len(parse_tool_calls(f"[TOOL:calculator:{'1' * MAX_PARAM_CHARS}]")) == 1


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from("[]:'\"TOOLcalx1 \n"), max_size=80))
def test_parse_tool_calls_never_raises(text: str) -> None:
    """Any text parses to a list of (name, param) pairs without raising."""
    for name, param in parse_tool_calls(text):
        assert name and isinstance(param, str)


# --- calculator ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "output"),
    [
        ("50*2", "100"),
        ("4*9+6", "42"),
        ("(3+4)*2", "14"),
        ("-3 + 5", "2"),
        ("7/2", "3.5"),
        ("10/2", "5"),
        ("7//2", "3"),
        ("7 % 3", "1"),
        ("2**10", "1024"),
        ("0.1+0.2", "0.3"),
        ("1_000 * 3", "3000"),
        ("'6*7'", "42"),
        ("--4", "4"),
        ("2**-1", "0.5"),
        ("(" * 99 + "1" + ")" * 99, "1"),
        ("-" * 199 + "1", "-1"),
    ],
)
def test_calculator_arithmetic(tools: Toolbox, expr: str, output: str) -> None:
    """Arithmetic with + - * / // % **, parentheses, unary minus and decimals."""
    r = tools.run("calculator", expr)
    assert r.ok and r.output == output and r.error is None


@pytest.mark.parametrize(
    ("expr", "reason"),
    [
        ("", "empty expression"),
        ("1/0", "division by zero"),
        ("5//0", "division by zero"),
        ("5%0", "division by zero"),
        ("0**-1", "division by zero"),
        ("9**99", "exponent too large"),
        ("10**20", "result too large"),
        ("99999999**9", "result too large"),
        ("10**15*10**15*10", "number too large"),
        ("1e400", "not a finite number"),
        ("(-8)**0.5", "not a real number"),
        ("x + 1", "names are not allowed: 'x'"),
        ("__import__('os').system('id')", "function calls are not allowed"),
        ("abs(-1)", "function calls are not allowed"),
        ("(1).real", "attribute access is not allowed"),
        ("2^3", r"operator '\^' is not allowed \(use \*\* for powers\)"),
        ("1 << 40", "operator '<<' is not allowed"),
        ("~1", "operator Invert is not allowed"),
        ("'a' * 3", "only numbers are allowed, got 'a'"),
        ("'abc'", "names are not allowed"),
        ("True + 1", "only numbers are allowed"),
        ("1j", "only numbers are allowed"),
        ("1 < 2", "Compare is not allowed"),
        ("[1, 2]", "List is not allowed"),
        ("lambda: 1", "Lambda is not allowed"),
        ("4x9", "not an arithmetic expression"),
        ("01:30", "not an arithmetic expression"),
        ("1+" * 150 + "1", "longer than 200 characters"),
        ("(" * 190 + "1" + ")" * 190, "longer than 200 characters"),
        ("(" * 150 + "1" + ")" * 40, "not an arithmetic expression"),
        ("\x00", "not an arithmetic expression"),
    ],
)
def test_calculator_refuses(tools: Toolbox, expr: str, reason: str) -> None:
    """Anything but bounded arithmetic is a failed result with a reason, never an exception."""
    r = tools.run("calculator", expr)
    assert not r.ok and r.output == ""
    assert r.error is not None and re.search(reason, r.error), r.error


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from("0123456789+-*/%().e_ jx'"), max_size=60))
def test_calculator_never_raises(expr: str) -> None:
    """Random arithmetic-looking text never makes the calculator raise."""
    r = Toolbox(WORLD).run("calculator", expr)
    assert r.ok or r.error


# --- file_reader --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["vault_specs.txt", "camera_schedule.txt", "building_layout.txt", "routes.txt"]
)
def test_file_reader_reads_world_files(tools: Toolbox, name: str) -> None:
    """Each materialised file can be read by name."""
    r = tools.run("file_reader", name)
    assert r.ok and r.output.strip()


def test_file_reader_accepts_quotes_and_dot_slash(tools: Toolbox) -> None:
    """Surrounding quotes and a leading ./ still name the same file."""
    plain = tools.run("file_reader", "routes.txt").output
    assert tools.run("file_reader", '"routes.txt"').output == plain
    assert tools.run("file_reader", "./routes.txt").output == plain


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("", "empty file name"),
        ("/etc/passwd", "absolute paths are not allowed"),
        ("~/secret", "absolute paths are not allowed"),
        ("C:/Windows/win.ini", "absolute paths are not allowed"),
        ("../security.db", "'..' is not allowed"),
        ("../../../../etc/passwd", "'..' is not allowed"),
        ("files/../../x", "'..' is not allowed"),
        ("..\\security.db", "backslashes are not allowed"),
        ("vault_specs.txt\x00.png", "NUL byte"),
        (".", "'.' is the folder itself"),
        ("nope.txt", "no such file 'nope.txt'; available: building_layout.txt"),
        ("vault_specs.txt/x", "no such file"),
        ("a" * 300, "longer than 255"),
    ],
)
def test_file_reader_refuses(tools: Toolbox, name: str, reason: str) -> None:
    """The reader never leaves its folder; every refusal says why."""
    r = tools.run("file_reader", name)
    assert not r.ok and r.error is not None and reason in r.error, r.error


def test_file_reader_refuses_symlinks_and_dirs(tmp_path: Path) -> None:
    """A symlink planted in the folder (even to a file inside it) and a directory are refused;
    a file above the limit is truncated."""
    tb = Toolbox(make_world(77), root=tmp_path)
    assert tmp_path in tb.folder.parents  # never change the shared cache (a mutant's root)
    outside = tmp_path / "outside.txt"
    outside.write_text("secret")
    (tb.files_dir / "escape.txt").symlink_to(outside)
    (tb.files_dir / "inner.txt").symlink_to(tb.files_dir / "routes.txt")
    (tb.files_dir / "sub").mkdir()
    (tb.files_dir / "big.txt").write_text("x" * (MAX_FILE_CHARS * 3))

    escape = tb.run("file_reader", "escape.txt")
    assert not escape.ok and "symbolic link" in (escape.error or "")
    assert "secret" not in escape.output
    inner = tb.run("file_reader", "inner.txt")
    assert not inner.ok and "symbolic link" in (inner.error or "")
    sub = tb.run("file_reader", "sub")
    assert not sub.ok and "a directory, not a regular file" in (sub.error or "")
    big = tb.run("file_reader", "big.txt")
    assert big.ok and len(big.output) < MAX_FILE_CHARS + 100 and "truncated" in big.output


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40))
def test_file_reader_never_raises(name: str) -> None:
    """Any file name gives a result, never an exception."""
    r = Toolbox(WORLD).run("file_reader", name)
    assert r.ok or r.error


# --- database_query -----------------------------------------------------------------------


def test_database_query_returns_rows(tools: Toolbox) -> None:
    """A SELECT answers with a header line and one compact line per row."""
    r = tools.run("database_query", "SELECT name, post FROM guards WHERE shift='night'")
    assert r.ok
    lines = r.output.splitlines()
    assert lines[0] == "name|post"
    night = [g for g in WORLD.guards if g.shift == "night"]
    assert len(lines) == 1 + len(night)


def test_database_query_with_and_no_rows(tools: Toolbox) -> None:
    """WITH ... SELECT is a query too; an empty answer says so."""
    r = tools.run("database_query", "WITH v AS (SELECT * FROM guards) SELECT name FROM v LIMIT 1")
    assert r.ok and r.output.startswith("name\n")
    empty = tools.run("database_query", "SELECT * FROM routes WHERE name='nowhere'")
    assert empty.ok and empty.output.endswith("(no rows)")


def test_database_query_bounds_rows(tools: Toolbox) -> None:
    """At most MAX_ROWS rows come back, with a note that more were left out."""
    sql = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c LIMIT 1000) SELECT x FROM c"
    r = tools.run("database_query", sql)
    assert r.ok
    lines = r.output.splitlines()
    assert len(lines) == 1 + MAX_ROWS + 1 and "more omitted" in lines[-1]


@pytest.mark.parametrize(
    ("sql", "reason"),
    [
        ("", "empty query"),
        ("DELETE FROM guards", "only a single SELECT"),
        ("UPDATE guards SET post='lobby'", "only a single SELECT"),
        ("INSERT INTO guards VALUES ('x','vault','night','01:00','02:00')", "only a single"),
        ("DROP TABLE guards", "only a single SELECT"),
        ("ATTACH DATABASE '/tmp/x.db' AS x", "only a single SELECT"),
        ("PRAGMA query_only=OFF", "only a single SELECT"),
        ("PRAGMA writable_schema=ON", "only a single SELECT"),
        ("VACUUM", "only a single SELECT"),
        ("-- hi\nDELETE FROM guards", "got 'DELETE'"),
        ("/* c */ DROP TABLE routes", "got 'DROP'"),
        ("SELECT 1; DELETE FROM guards", "only one statement"),
        ("SELECT 1; SELECT 2", "only one statement"),
        ("WITH x AS (SELECT 1) DELETE FROM guards", "not allowed"),
        ("SELECT * FROM sqlite_master; DROP TABLE guards", "only one statement"),
        ("SELECT random()", "not allowed"),
        ("SELECT randomblob(10)", "not allowed"),
        ("SELECT date('now')", "not allowed"),
        ("SELECT CURRENT_TIMESTAMP", "not allowed"),
        ("SELECT load_extension('x')", "not allowed"),
        ("SELEC * FROM guards", "only a single SELECT"),
        ("SELECT * FROM vaults", "SQL error: no such table: vaults"),
        ("SELECT nonsense FROM guards", "SQL error: no such column"),
        ("SELECT * FROM guards WHERE", "SQL error"),
        (
            "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c) SELECT count(*) FROM c",
            "ran too long",
        ),
        ("SELECT length(zeroblob(1000000000))", "a value grew past"),
        ("SELECT 1 " + "x" * 3000, "longer than 2000 characters"),
        ("SELECT '\x00'", "NUL byte"),
    ],
)
def test_database_query_refuses(tools: Toolbox, sql: str, reason: str) -> None:
    """Only one read-only, deterministic, bounded SELECT runs; all else fails with a reason."""
    r = tools.run("database_query", sql)
    assert not r.ok and r.error is not None and reason in r.error, r.error


def test_hostile_queries_leave_the_database_unchanged(tools: Toolbox) -> None:
    """No query changes a byte of the database file."""
    before = hashlib.sha256(tools.db_path.read_bytes()).hexdigest()
    for sql in (
        "DELETE FROM guards",
        "WITH x AS (SELECT 1) UPDATE guards SET post='x'",
        "SELECT 1; DROP TABLE guards",
        "CREATE TABLE t(a)",
        "PRAGMA journal_mode=DELETE",
    ):
        tools.run("database_query", sql)
    assert hashlib.sha256(tools.db_path.read_bytes()).hexdigest() == before
    assert tools.run("database_query", "SELECT count(*) AS n FROM guards").output == (
        f"n\n{len(WORLD.guards)}"
    )


def test_database_per_thread(tools: Toolbox) -> None:
    """Each thread gets its own connection, so parallel replays can query one world."""
    results: list[ToolResult] = []

    def work() -> None:
        results.append(tools.run("database_query", "SELECT count(*) FROM routes"))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and all(r.ok and r.output == results[0].output for r in results)


# --- the toolbox --------------------------------------------------------------------------


def test_non_text_arguments(tools: Toolbox) -> None:
    """A caller passing something other than text gets a failed result, not an exception."""
    r = tools.run("calculator", None)  # type: ignore[arg-type]
    assert not r.ok and r.error == "tool name and parameter must be text"


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_shared_cache_folder_is_refused(tmp_path: Path, mode: int) -> None:
    """A cache folder others can write to is refused: its files are the ground truth."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    with pytest.raises(EngineError, match="is not a private directory of this user"):
        Toolbox(make_world(1), root=shared)


def test_symlinked_cache_folder_is_refused(tmp_path: Path) -> None:
    """A cache folder that is a symlink (possibly planted) is refused."""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(EngineError, match="not a private directory"):
        Toolbox(make_world(1), root=link)


@pytest.mark.parametrize("name", ["shell", "", "Calculator", "file_reader ", "eval"])
def test_unknown_tool(tools: Toolbox, name: str) -> None:
    """An unknown tool name is a failed result listing the tools."""
    r = tools.run(name, "1+1")
    assert not r.ok and "unknown tool" in (r.error or "") and "calculator" in (r.error or "")


def test_tools_are_deterministic(tools: Toolbox) -> None:
    """The same call gives the same result, including a fresh toolbox for the same world."""
    again = Toolbox(make_world(5))
    for name, param in [
        ("calculator", "3*7+2"),
        ("file_reader", "camera_schedule.txt"),
        ("database_query", "SELECT * FROM guards ORDER BY name"),
        ("database_query", "DELETE FROM guards"),
    ]:
        assert tools.run(name, param) == again.run(name, param)


def test_observation_for_carries_the_reason() -> None:
    """A failed call becomes an observation whose output is the failure reason."""
    tb = Toolbox(WORLD)
    obs = observation_for(tb.run("calculator", "1/0"), step=3)
    assert obs.step == 3 and not obs.ok and obs.output == "division by zero"
    ok = observation_for(tb.run("calculator", "2+2"), step=4)
    assert ok.ok and ok.output == "4"


def _build(root: str) -> str:
    return str(materialise(make_world(123), Path(root)))


def test_materialise_is_race_safe(tmp_path: Path) -> None:
    """Processes building the same world at once end up sharing one complete folder."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        folders = pool.map(_build, [str(tmp_path)] * 8)
    assert len(set(folders)) == 1
    folder = Path(folders[0])
    assert (folder / "complete").is_file()
    assert sorted(os.listdir(tmp_path)) == [folder.name]
    assert sorted(p.name for p in (folder / "files").iterdir()) == [
        "building_layout.txt",
        "camera_schedule.txt",
        "routes.txt",
        "vault_specs.txt",
    ]
