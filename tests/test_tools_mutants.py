"""What mutation testing of engine/heist/tools.py showed unchecked: every result names its
tool and carries the exact reason, a failed result without a reason reads "failed", empty
quotes unquote to nothing, the number bound itself is allowed, long output is cut with a
note, and the file listing leaves out directories."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
import threading
from pathlib import Path

import pytest

from engine.errors import EngineError
from engine.heist.tools import (
    MAX_NUMBER,
    MAX_OUTPUT_CHARS,
    Toolbox,
    ToolResult,
    _bounded,
    _render_rows,
    _sql_reason,
    _unquote,
    cache_root,
    materialise,
    observation_for,
    parse_tool_calls,
)
from engine.heist.world import World, make_world


def _tools(tmp_path: Path) -> Toolbox:
    return Toolbox(make_world(5), root=tmp_path)


def _own_tools(tmp_path: Path) -> Toolbox:
    """A toolbox whose world folder is this test's own, for tests that change the folder: a
    mutant that ignored `root` would otherwise have them change the shared cache that every
    other test and process reads."""
    t = _tools(tmp_path)
    assert tmp_path in t.folder.parents, t.folder
    return t


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
    t = _own_tools(tmp_path)
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


# --- what the seed-1 sample of the second round showed unchecked -------------------------


def test_fresh_database_has_the_worlds_columns(tmp_path: Path) -> None:
    """A database built in a fresh folder names each column as the world's tables do."""
    t = _tools(tmp_path)
    assert t.run("database_query", "SELECT * FROM guards LIMIT 0").output == (
        "name|post|shift|start_time|end_time\n(no rows)"
    )
    assert t.run("database_query", "SELECT * FROM vehicles WHERE 0").output == (
        "plate|model|seats|fuel_pct\n(no rows)"
    )


def test_query_text_that_is_not_encodable_is_refused(tmp_path: Path) -> None:
    """A query holding a lone surrogate (no valid UTF-8) is a failed result of the query tool
    naming the error's type, not an exception."""
    sql = "SELECT '\ud800'"
    assert _tools(tmp_path).run("database_query", sql) == ToolResult(
        "database_query", sql, False, "", "query rejected: UnicodeEncodeError"
    )


def test_sql_reason_of_a_readonly_database() -> None:
    """SQLite's "attempt to write a readonly database" reads as the database being
    read-only; an unknown message is passed on as an SQL error."""
    assert _sql_reason("attempt to write a readonly database") == (
        "not allowed: the security database is read-only"
    )
    assert _sql_reason("no such table: x") == "SQL error: no such table: x"


def test_file_reader_exact_reasons(tmp_path: Path) -> None:
    """An empty name and a symlink are refused with their whole reasons."""
    t = _own_tools(tmp_path)
    assert t.run("file_reader", "") == ToolResult("file_reader", "", False, "", "empty file name")
    (t.files_dir / "link.txt").symlink_to(t.files_dir / "routes.txt")
    assert t.run("file_reader", "link.txt").error == (
        "'link.txt' is (or passes through) a symbolic link; links are not read"
    )


def test_file_reader_read_error_is_a_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that fails after the file was opened (an I/O error of the disk) is a failed
    result of the file reader with the system's reason. Fault injected: os.fdopen raises EIO,
    since a regular file inside the folder cannot be made to fail its read for real."""
    t = _own_tools(tmp_path)

    def broken(*args: object, **kwargs: object) -> object:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fdopen", broken)
    assert t.run("file_reader", "routes.txt") == ToolResult(
        "file_reader", "routes.txt", False, "", "cannot read 'routes.txt': Input/output error"
    )


def test_folder_layout_and_privacy(tmp_path: Path) -> None:
    """The cache folder is created private (0700); a world's folder is named by its content
    hash with '-' for ':' (a name every file system takes) and holds the marker with the hash."""
    world = make_world(5)
    base = tmp_path / "new" / "cache"
    folder = materialise(world, base)
    assert stat.S_IMODE(os.stat(base).st_mode) == 0o700
    algo, digest = world.content_hash().split(":")
    assert folder == base / f"{algo}-{digest}"
    assert (folder / "complete").read_text() == world.content_hash() + "\n"
    assert os.listdir(base) == [folder.name]


def test_build_stays_inside_the_cache_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The world is built in a scratch folder inside the cache folder (one file system for
    the final rename), never in the system temp dir: with TMPDIR pointing nowhere it still
    builds, and no scratch folder is left."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-tmp"))
    folder = materialise(make_world(6), tmp_path / "cache")
    assert (folder / "complete").is_file()
    assert os.listdir(tmp_path / "cache") == [folder.name]


def test_incomplete_folder_in_the_way_is_named(tmp_path: Path) -> None:
    """A world's folder that exists without its marker (a half copy by hand) is not used
    nor replaced: the error names it and says what to do; the scratch copy is removed."""
    world = make_world(5)
    base = tmp_path / "cache"
    base.mkdir(mode=0o700)
    final = base / world.content_hash().replace(":", "-")
    final.mkdir()
    (final / "stray").write_text("x")
    with pytest.raises(EngineError) as caught:
        materialise(world, base)
    assert str(caught.value) == f"heist folder {str(final)!r} exists but is incomplete; delete it"
    assert sorted(os.listdir(base)) == [final.name]


def _files_in(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


@pytest.mark.parametrize("lost", ["security.db", "files/vault_specs.txt"])
def test_a_complete_folder_emptied_since_is_built_again(tmp_path: Path, lost: str) -> None:
    """A world's folder whose marker says complete but that lost its database or a file (a
    clean-up of old files in /tmp) is moved aside and built again: the next Toolbox answers
    its queries and reads, and nothing but the rebuilt folder is left in the cache."""
    world = make_world(5)
    base = tmp_path / "cache"
    folder = materialise(world, base)
    names = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    assert lost in names
    (folder / lost).unlink()
    assert materialise(world, base) == folder
    assert (
        sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) == names
    )
    assert os.listdir(base) == [folder.name]
    tb = Toolbox(world, root=base)
    assert tb.run("database_query", "SELECT COUNT(*) FROM guards").ok
    assert tb.run("file_reader", "vault_specs.txt").ok


def test_a_whole_folder_is_used_as_it_is(tmp_path: Path) -> None:
    """A world's folder that is whole is returned as it is, not built again: a file put into
    it after the build is still there after the next call (inode numbers would not tell: a
    rebuilt folder may get the freed ones back)."""
    world = make_world(5)
    folder = materialise(world, tmp_path / "cache")
    (folder / "left-here").write_text("a file no build writes")
    assert materialise(world, tmp_path / "cache") == folder
    assert (folder / "left-here").read_text() == "a file no build writes"


def test_a_broken_folder_another_process_moved_first_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two processes find the same emptied folder and race to move it aside; the one that
    loses the race (its rename finds nothing: faked here, the race is a matter of
    microseconds) still builds the world and returns a whole folder."""
    import engine.heist.tools as tools

    world = make_world(5)
    base = tmp_path / "cache"
    folder = materialise(world, base)
    (folder / "security.db").unlink()
    real = os.rename
    lost = []

    def rename(src: object, dst: object) -> None:
        if not lost and str(dst).startswith(str(base / ".broken-")):
            lost.append(src)
            real(src, str(base / "moved-by-the-other"))  # the other process's move
            shutil.rmtree(base / "moved-by-the-other")
            raise FileNotFoundError(src)
        real(src, dst)  # type: ignore[arg-type]

    monkeypatch.setattr(tools.os, "rename", rename)
    assert materialise(world, base) == folder
    assert lost and (folder / "security.db").is_file()
    assert os.listdir(base) == [folder.name]


def test_the_default_cache_folder_is_the_users(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a root, a world is built in cache_root() (under the temp dir)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    folder = materialise(make_world(5))
    assert folder.parent == cache_root() == tmp_path / f"car-heist-{os.getuid()}"
    assert (folder / "security.db").is_file()


def test_toolboxes_of_two_worlds_in_one_folder(tmp_path: Path) -> None:
    """Two worlds materialised under the same root get their own folders and answers."""
    a, b = Toolbox(make_world(5), root=tmp_path), Toolbox(make_world(6), root=tmp_path)
    assert a.folder != b.folder
    assert a.world.content_hash() != b.world.content_hash()
    assert (a.folder / "complete").read_text() != (b.folder / "complete").read_text()


def test_unclosed_call_before_a_call(tmp_path: Path) -> None:
    """An opening that never closes is skipped and the call after it is still found."""
    assert parse_tool_calls("[TOOL:a:x [TOOL:b:1]") == [("b", "1")]


def test_connections_one_per_thread_and_process(tmp_path: Path) -> None:
    """A toolbox reuses its connection within a thread, another thread opens its own, and a
    forked child never uses the connection it inherited (SQLite connections must not cross a
    fork): it opens a new one."""
    t = _tools(tmp_path)
    mine = t._connection()
    assert t._connection() is mine
    other: list[object] = []
    th = threading.Thread(target=lambda: other.append(t._connection()))
    th.start()
    th.join()
    assert other and other[0] is not mine
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if it got a connection of its own
        try:
            ok = t._connection() is not mine and t._connection() is t._connection()
            os._exit(0 if ok else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert t._connection() is mine


def test_missing_security_database_is_a_result(tmp_path: Path) -> None:
    """A world's folder whose database was deleted gives a failed query result saying the
    database is unavailable, not an exception."""
    t = _own_tools(tmp_path)
    t.db_path.unlink()
    r = t.run("database_query", "SELECT 1")
    assert (r.tool, r.param, r.ok, r.output) == ("database_query", "SELECT 1", False, "")
    assert r.error == "security database unavailable: unable to open database file"


# --- what the seed-2 sample showed unchecked ----------------------------------------------


@pytest.mark.parametrize(
    ("tool", "param", "error"),
    [
        ("calculator", "1\x00", "not an arithmetic expression: '1\\x00'"),
        ("calculator", "\ud800", "not an arithmetic expression: '\\ud800'"),  # not UTF-8
        ("calculator", "abs(1)", "function calls are not allowed"),
        ("calculator", "2**60", "result too large (limit 1e+15)"),
        ("file_reader", "nope.txt", "no such file 'nope.txt'; available: building_layout.txt, "
         "camera_schedule.txt, routes.txt, vault_specs.txt"),
        ("database_query", "SELECT * FROM nope", "SQL error: no such table: nope"),
        ("database_query", "SELECT 1" + " " * 2000, None),
        ("database_query", "SELECT '" + "x" * 2000 + "'", "query longer than 2000 characters"),
        ("database_query", "SELECT 1\x00", "query contains a NUL byte"),
        ("database_query", "DELETE FROM guards", "only a single SELECT (or WITH ... SELECT) "
         "query is allowed, got 'DELETE'; the security database is read-only"),
        ("database_query", "SELECT ?", "query rejected: Incorrect number of bindings supplied. "
         "The current statement uses 1, and there are 0 supplied."),
        ("database_query", "SELECT random()", "not allowed (to use function: random): the "
         "security database is read-only and accepts only queries"),
    ],
)  # fmt: skip
def test_failed_results_in_full(tmp_path: Path, tool: str, param: str, error: str | None) -> None:
    """Each refusal is a failed result of the tool asked, with the parameter as given and the
    whole reason (a query padded with blanks past the limit is still a query)."""
    r = _tools(tmp_path).run(tool, param)
    if error is None:
        assert r == ToolResult(tool, param, True, "1\n1")
    else:
        assert r == ToolResult(tool, param, False, "", error)


def test_statement_length_is_bounded_in_bytes(tmp_path: Path) -> None:
    """The statement limit is 2 x MAX_SQL_CHARS bytes of UTF-8 (what SQLite counts): 1300
    three-byte characters pass, 1400 do not."""
    t = _tools(tmp_path)
    ok = "SELECT '" + "€" * 1300 + "'"
    assert t.run("database_query", ok).ok
    big = "SELECT '" + "€" * 1400 + "'"
    assert t.run("database_query", big).error == "SQL error: query string is too large"


def test_sql_reasons_by_message() -> None:
    """SQLite's out-of-memory and read-only messages map to their reasons; a refusal without
    a detail says only that it is not allowed."""
    assert _sql_reason("out of memory") == "query needed too much memory and was stopped"
    assert _sql_reason("database is read-only") == "not allowed: the security database is read-only"
    assert _sql_reason("not authorized") == (
        "not allowed: the security database is read-only and accepts only queries"
    )


def test_successful_read_and_undecodable_bytes(tmp_path: Path) -> None:
    """A read names its tool and parameter; bytes that are not UTF-8 read as U+FFFD."""
    t = _own_tools(tmp_path)
    (t.files_dir / "raw.txt").write_bytes(b"ok \xff\xfe end")
    assert t.run("file_reader", "raw.txt") == ToolResult(
        "file_reader", "raw.txt", True, "ok \ufffd\ufffd end"
    )


def test_hard_link_reason_in_full(tmp_path: Path) -> None:
    """A hard-linked file is refused saying why (it may come from outside the folder)."""
    t = _own_tools(tmp_path)
    os.link(t.files_dir / "routes.txt", t.files_dir / "copy.txt")
    assert t.run("file_reader", "copy.txt").error == (
        "'copy.txt' has 2 hard links; a linked file is not read "
        "(it may be a file from outside the heist folder)"
    )


def test_missing_files_folder_is_a_result(tmp_path: Path) -> None:
    """A world folder whose files/ was removed gives a failed read naming the error."""
    t = _own_tools(tmp_path)
    shutil.rmtree(t.files_dir)
    assert t.run("file_reader", "routes.txt") == ToolResult(
        "file_reader", "routes.txt", False, "", "cannot read: FileNotFoundError"
    )


def test_non_text_tool_name_is_named_as_given(tmp_path: Path) -> None:
    """A tool name that is not text is echoed as its text form in the failed result."""
    r = _tools(tmp_path).run(5, "x")  # type: ignore[arg-type]
    assert (r.tool, r.param, r.ok, r.error) == (
        "5",
        "x",
        False,
        "tool name and parameter must be text",
    )


def test_observation_keeps_the_parameter() -> None:
    """The agent's observation carries the parameter of the call it answers."""
    obs = observation_for(ToolResult("calculator", "6*7", True, "42"), 2)
    assert (obs.tool, obs.param, obs.ok, obs.output) == ("calculator", "6*7", True, "42")


def test_quote_characters_are_only_quotes(tmp_path: Path) -> None:
    """Only ' and " quote inside a parameter: a letter does not hide the closing bracket."""
    assert parse_tool_calls("[TOOL:a:X]X]") == [("a", "X")]


def test_cache_root_is_per_user_under_the_temp_dir() -> None:
    """Worlds are cached in car-heist-UID under the system temp dir."""
    assert cache_root() == Path(tempfile.gettempdir()) / f"car-heist-{os.getuid()}"


def test_cache_folder_of_another_owner_is_refused(tmp_path: Path) -> None:
    """A cache folder owned by someone else is refused even when nobody else may write to it
    (root: a folder given to uid 65534; another user: '/', which root owns)."""
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
    else:
        theirs = Path("/")
    assert stat.S_IMODE(os.stat(theirs).st_mode) & 0o022 == 0
    with pytest.raises(EngineError, match="is not a private directory of this user"):
        materialise(make_world(5), theirs)


def test_threads_racing_to_build_one_world_share_the_folder(tmp_path: Path) -> None:
    """Threads building the same world at once all get the one complete folder: those whose
    rename loses to the first take the winner's folder instead of failing (five rounds of
    eight threads started together)."""
    world = make_world(9)
    for round_ in range(5):
        base = tmp_path / f"r{round_}"
        start = threading.Barrier(8)
        got: list[object] = []
        threads = [
            threading.Thread(target=_build_after, args=(start, world, base, got)) for _ in range(8)
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert len(got) == 8 and len(set(got)) == 1 and isinstance(got[0], Path), got
        assert os.listdir(base) == [got[0].name]


def _build_after(start: threading.Barrier, world: World, base: Path, got: list[object]) -> None:
    start.wait()
    try:
        got.append(materialise(world, base))
    except Exception as e:  # a loser that failed: recorded, then asserted on
        got.append(e)


# --- what a fresh sample (seed 3) showed unchecked -----------------------------------------


@pytest.mark.parametrize(
    ("expr", "result"),
    [
        ("10-3", ToolResult("calculator", "10-3", True, "7")),
        ("2 - 5", ToolResult("calculator", "2 - 5", True, "-3")),
        ("1/10000000", ToolResult("calculator", "1/10000000", True, "1e-07")),
        # 15.5 x log10(10) is exactly the estimate's bound: computed, then refused by size
        ("10**15.5",
         ToolResult("calculator", "10**15.5", False, "", "number too large (limit 1e+15)")),
    ],
)  # fmt: skip
def test_calculator_results_in_full(tmp_path: Path, expr: str, result: ToolResult) -> None:
    """Binary minus, a small float's exponent form and the power estimate's boundary, as the
    whole result of the calculator."""
    assert _tools(tmp_path).run("calculator", expr) == result


def test_more_refusals_in_full(tmp_path: Path) -> None:
    """A query not starting with a word, './/' (the folder itself) and a name of 256
    characters are refused with their reasons; 255 characters are still a name."""
    t = _tools(tmp_path)
    assert t.run("database_query", "(SELECT 1)").error == (
        "only a single SELECT (or WITH ... SELECT) query is allowed, got '(SELECT 1)'; "
        "the security database is read-only"
    )
    assert t.run("file_reader", ".//").error == "'.' is the folder itself, not a file"
    assert t.run("file_reader", "a" * 256).error == "file name longer than 255 characters"
    assert (t.run("file_reader", "a" * 255).error or "").startswith("no such file 'aaa")


def test_calls_back_to_back() -> None:
    """Two calls without a parameter, one right after the other, are both found."""
    assert parse_tool_calls("[TOOL:a][TOOL:b]") == [("a", ""), ("b", "")]


def test_shared_cache_folder_message_names_it(tmp_path: Path) -> None:
    """The refusal of a cache folder others may write to names the folder."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    shared.chmod(0o777)
    with pytest.raises(EngineError) as caught:
        materialise(make_world(5), shared)
    assert str(caught.value) == (
        f"heist cache folder {str(shared)!r} is not a private directory of this user "
        "(a symlink, another owner, or writable by others)"
    )


def _cache_root_as(uid: int) -> str:
    """cache_root() in a forked child that became `uid` (a real setuid; root only)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: become the user, answer, and leave without pytest
        try:
            os.close(read)
            os.setuid(uid)
            os.write(write, str(cache_root()).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as fh:
        got = fh.read().decode()
    os.waitpid(pid, 0)
    return got


def test_cache_root_names_the_real_uid_not_zero() -> None:
    """The cache folder's name carries the process's own uid, never a default 0: as root, a
    forked child that became uid 65534 names car-heist-65534; as another user, that user's
    (non-zero) uid."""
    # this process's own answer too: it is in the same temp dir (and a call here is what ties
    # the test to cache_root for scripts/mutate, which sees no call made in a child)
    assert cache_root().parent == Path(tempfile.gettempdir())
    if os.getuid() == 0:
        uid, got = 65534, _cache_root_as(65534)
    else:
        uid, got = os.getuid(), str(cache_root())
    assert uid != 0 and got == str(Path(tempfile.gettempdir()) / f"car-heist-{uid}")


def test_calculator_messages_in_full(tmp_path: Path) -> None:
    """A blank expression is "empty expression", word for word; a fractional power of a
    number in [0, 1) is a real number (0.25 ** 0.5 = 0.5); a text between two X's is a name,
    not a quoted expression."""
    t = _tools(tmp_path)
    assert t.run("calculator", "  ") == ToolResult(
        "calculator", "  ", False, "", "empty expression"
    )
    assert t.run("calculator", "0.25 ** 0.5") == ToolResult(
        "calculator", "0.25 ** 0.5", True, "0.5"
    )
    assert t.run("calculator", "0 ** 0.5").output == "0"
    assert t.run("calculator", "X2X") == ToolResult(
        "calculator", "X2X", False, "", "names are not allowed: 'X2X'"
    )


def test_calculator_nesting_deeper_than_the_stack_is_a_result(tmp_path: Path) -> None:
    """An expression nested deeper than the Python stack left is a failed result, never a
    RecursionError: with the recursion limit raised step by step above the caller's depth
    (from where the tool answers "1"), 150 unary minus signs first fail to parse ("not an
    arithmetic expression"), then parse but are "expression is nested too deeply" to
    evaluate, word for word, then evaluate."""
    import inspect
    import sys

    t = _tools(tmp_path)
    expr = "-" * 150 + "1"
    errors: list[str | None] = []
    limit = sys.getrecursionlimit()
    depth = len(inspect.stack())
    try:
        for extra in range(10, 1000, 5):
            sys.setrecursionlimit(depth + extra)
            try:
                t.run("calculator", "1")
            except RecursionError:
                continue  # too short a stack for the tool itself: not what is claimed here
            r = t.run("calculator", expr)
            errors.append(r.error)
            if r.ok:
                break
    finally:
        sys.setrecursionlimit(limit)
    assert errors[-1] is None  # a deep enough stack evaluates it
    assert (
        ToolResult("calculator", expr, False, "", "expression is nested too deeply").error in errors
    )
    assert set(errors) <= {
        None,
        "expression is nested too deeply",
        f"not an arithmetic expression: {expr!r}",
    }


def test_lower_case_select_is_a_select(tmp_path: Path) -> None:
    """SQL keywords are case-insensitive: `select` and `With` start a query like SELECT."""
    t = _tools(tmp_path)
    assert t.run("database_query", "select 1 AS one").output == "one\n1"
    assert t.run("database_query", "With w AS (SELECT 2 AS two) select * FROM w").ok


def test_query_over_the_sqlite_heap_is_a_result(tmp_path: Path) -> None:
    """A query whose working set passes SQLite's heap limit (20 000 distinct values of 19 000
    bytes: 380 MB against 128 MiB) is stopped by SQLite (a Python MemoryError out of the
    driver) and answered as the failed result naming the memory, in full."""
    t = _tools(tmp_path)
    sql = (
        "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c WHERE x < 20000) "
        "SELECT count(DISTINCT zeroblob(19000) || x) FROM c"
    )
    assert t.run("database_query", sql) == ToolResult(
        "database_query", sql, False, "", "query needed too much memory and was stopped"
    )


def _count_to(n: int) -> str:
    return (
        f"WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c WHERE x < {n}) "
        "SELECT count(*) AS n FROM c"
    )


def _progress_calls(db: Path, sql: str) -> int:
    """How many times SQLite calls a progress handler every 1000 VM instructions while
    running `sql` on its own read-only connection (as the tool runs it: execute, then fetch
    up to 51 rows) — an independent count of the tool's budget."""
    import sqlite3

    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    calls = 0

    def count() -> int:
        nonlocal calls
        calls += 1
        return 0

    try:
        conn.set_progress_handler(count, 1000)
        conn.execute(sql).fetchmany(51)
    finally:
        conn.close()
    return calls


def test_query_budget_is_exactly_its_progress_calls(tmp_path: Path) -> None:
    """The instruction budget admits a query that needs exactly MAX_QUERY_STEPS progress calls
    and stops one that needs one more: the counting query of each size is found by counting
    the calls on a separate connection."""
    from engine.heist.tools import MAX_QUERY_STEPS

    t = _tools(tmp_path)
    db = t.folder / "security.db"
    # calls grow linearly with the count: bracket the budget around a linear estimate
    guess = 20_000 * MAX_QUERY_STEPS // _progress_calls(db, _count_to(20_000))
    lo, hi = guess * 9 // 10, guess * 11 // 10  # calls(lo) <= budget < calls(hi)
    assert _progress_calls(db, _count_to(lo)) <= MAX_QUERY_STEPS
    assert _progress_calls(db, _count_to(hi)) > MAX_QUERY_STEPS
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _progress_calls(db, _count_to(mid)) <= MAX_QUERY_STEPS:
            lo = mid
        else:
            hi = mid
    assert _progress_calls(db, _count_to(lo)) == MAX_QUERY_STEPS
    assert t.run("database_query", _count_to(lo)) == ToolResult(
        "database_query", _count_to(lo), True, f"n\n{lo}"
    )
    assert t.run("database_query", _count_to(lo + 1)).error == "query ran too long and was stopped"
