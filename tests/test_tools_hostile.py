"""The heist tools under hostile input: every query stays within hard limits of time, memory,
temporary storage and output, and the file reader reads only the folder's own regular files,
never blocking on one that is not.

The limits are SQLite's own (a progress handler with an instruction budget and a wall-clock
deadline, LIKE/GLOB pattern and value length limits, an in-memory temp store under a heap
limit), so each test runs a real query against the real security database."""

# ruff: noqa: E501  (the tables of hostile input read best one case per line)
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from engine.heist.tools import (
    MAX_LIKE_PATTERN_CHARS,
    MAX_OUTPUT_CHARS,
    MAX_QUERY_SECONDS,
    Toolbox,
    ToolResult,
)
from engine.heist.world import make_world

WORLD = make_world(5)
ROWS = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c LIMIT {n}) "
LONG = "printf('%.*c', {n}, 'a')"
# a wall-clock margin over the query deadline for the progress handler's granularity
MARGIN = 1.0


@pytest.fixture(scope="module")
def tools() -> Toolbox:
    return Toolbox(WORLD)


def timed(tb: Toolbox, tool: str, param: str) -> tuple[ToolResult, float]:
    t0 = time.monotonic()
    r = tb.run(tool, param)
    return r, time.monotonic() - t0


@pytest.mark.parametrize(
    ("sql", "expect"),
    [
        # one LIKE/GLOB of a long pattern runs inside one VM instruction: refused by length
        ("SELECT name FROM guards WHERE name LIKE '" + "%a" * 900 + "'",
         f"LIKE/GLOB pattern longer than {MAX_LIKE_PATTERN_CHARS} characters"),
        ("SELECT name FROM guards WHERE name GLOB '" + "*a" * 900 + "'",
         "LIKE/GLOB pattern longer than"),
        (f"SELECT {LONG.format(n=19000)} LIKE printf('%.*c', 5000, '%')", "LIKE/GLOB pattern longer"),
        # a short pattern against a long string, on every row of many: stopped by the budget
        (ROWS.format(n=10**7) + f"SELECT count(*) FROM c WHERE ({LONG.format(n=19000)} || x) "
         "LIKE '" + "%a" * 45 + "%b'", "ran too long"),
        (ROWS.format(n=10**9) + "SELECT count(*) FROM c", "ran too long"),
        # values may not grow past the value limit (replace, printf, zeroblob, group_concat)
        (f"SELECT replace({LONG.format(n=19000)}, 'a', 'bbbbbbbb')",
         "a value grew past 20000 bytes"),
        ("SELECT zeroblob(1000000000)", "a value grew past"),
        (ROWS.format(n=10**5) + f"SELECT group_concat({LONG.format(n=1000)}) FROM c",
         "a value grew past"),
        # nesting and compounds are capped before they reach the VM
        ("SELECT " + "(" * 500 + "1" + ")" * 500, "SQL error: (Expression tree is too large|parser stack overflow)"),
        ("SELECT 1" + " UNION SELECT 1" * 100, "too many terms in compound SELECT"),
        # a sort of big rows runs out of the heap limit (or the deadline), never onto disk
        (ROWS.format(n=10**5) + f"SELECT {LONG.format(n=15000)} || x AS y FROM c ORDER BY y",
         "too much memory|ran too long"),
    ],
)  # fmt: skip
def test_hostile_query_is_refused_within_the_deadline(
    tools: Toolbox, sql: str, expect: str
) -> None:
    """Each hostile query fails with its reason, within the query deadline plus a margin."""
    r, elapsed = timed(tools, "database_query", sql)
    assert not r.ok, r.output[:200]
    assert r.error is not None
    assert re.search(expect, r.error), r.error
    assert elapsed < MAX_QUERY_SECONDS + MARGIN, elapsed


@pytest.mark.parametrize(
    "sql",
    [
        f"SELECT instr({LONG.format(n=19000)}, {LONG.format(n=9000)} || 'b')",
        f"SELECT {LONG.format(n=19000)} LIKE '" + "%a" * 45 + "%b'",
        "SELECT * FROM guards a, guards b, guards c, guards d ORDER BY 1, 2, 3",
        f"SELECT {LONG.format(n=19000)} AS big, * FROM guards",
        f"SELECT {LONG.format(n=10**6)}",  # printf answers NULL past the value limit
    ],
)
def test_expensive_but_bounded_query_answers_quickly_and_small(tools: Toolbox, sql: str) -> None:
    """Queries at the edge of the limits answer within the deadline, output bounded."""
    r, elapsed = timed(tools, "database_query", sql)
    assert r.ok, r.error
    assert len(r.output) <= MAX_OUTPUT_CHARS + 100
    assert elapsed < MAX_QUERY_SECONDS + MARGIN, elapsed


def test_big_sort_is_held_by_the_heap_limit_not_spilled_to_disk(tmp_path: Path) -> None:
    """With the time limits lifted, a sort of 1.5 GB of rows fails with 'too much memory'
    while the process stays far below that and writes no temp file. Peak RSS < 800 MiB: the
    128 MiB heap limit plus the interpreter and the allocator's slack, which vary from machine
    to machine (448-552 MiB seen here); a spilled or unbounded sort needs the whole 1.5 GB."""
    script = f"""
import resource, sys
import engine.heist.tools as T
T.MAX_QUERY_SECONDS = 120.0
T.MAX_QUERY_STEPS = 10**9
from engine.heist.world import make_world
tb = T.Toolbox(make_world(5))
r = tb.run("database_query", {ROWS.format(n=10**5) + f"SELECT {LONG.format(n=15000)} || x AS y FROM c ORDER BY y"!r})
print(r.ok, r.error)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
"""
    tmp = tmp_path / "sqlite-tmp"
    tmp.mkdir()
    env = {**os.environ, "SQLITE_TMPDIR": str(tmp), "TMPDIR": str(tmp)}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr
    verdict, rss = proc.stdout.splitlines()[-2:]
    assert verdict == "False query needed too much memory and was stopped", proc.stdout
    assert int(rss) < 800, rss
    assert [p for p in tmp.rglob("etilqs*")] == []


# --- file_reader --------------------------------------------------------------------------


def _fifo(folder: Path, outside: Path) -> None:
    os.mkfifo(folder / "plan.txt")


def _socket(folder: Path, outside: Path) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(folder / "plan.txt"))
    _keep.append(s)


def _hardlink_out(folder: Path, outside: Path) -> None:
    os.link(outside, folder / "plan.txt")


def _hardlink_in(folder: Path, outside: Path) -> None:
    os.link(folder / "routes.txt", folder / "plan.txt")


def _symlink_out(folder: Path, outside: Path) -> None:
    (folder / "plan.txt").symlink_to(outside)


def _symlink_in(folder: Path, outside: Path) -> None:
    (folder / "plan.txt").symlink_to(folder / "routes.txt")


def _dir_symlink(folder: Path, outside: Path) -> None:
    (folder / "sub").symlink_to(outside.parent)


def _link_in_subdir(folder: Path, outside: Path) -> None:
    (folder / "sub").mkdir()
    (folder / "sub" / "plan.txt").symlink_to(outside)


def _directory(folder: Path, outside: Path) -> None:
    (folder / "plan.txt").mkdir()


def _device(folder: Path, outside: Path) -> None:
    import stat

    os.mknod(folder / "plan.txt", 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null


_keep: list[socket.socket] = []

PLANTED = [
    ("fifo", _fifo, "plan.txt", r"is a named pipe \(FIFO\), not a regular file"),
    ("unix-socket", _socket, "plan.txt", r"is a socket, not a regular file"),
    ("hard-link-to-outside", _hardlink_out, "plan.txt", r"has 2 hard links"),
    ("hard-link-of-a-world-file", _hardlink_in, "plan.txt", r"has 2 hard links"),
    ("hard-linked-original", _hardlink_in, "routes.txt", r"has 2 hard links"),
    ("symlink-to-outside", _symlink_out, "plan.txt", r"symbolic link"),
    ("symlink-inside", _symlink_in, "plan.txt", r"symbolic link"),
    ("symlinked-directory", _dir_symlink, "sub/outside.txt", r"symbolic link"),
    ("symlink-in-subdirectory", _link_in_subdir, "sub/plan.txt", r"symbolic link"),
    ("directory", _directory, "plan.txt", r"is a directory, not a regular file"),
]
if os.geteuid() == 0:  # only root may create device nodes
    PLANTED.append(("char-device", _device, "plan.txt", r"is a character device"))


@pytest.mark.parametrize(("plant", "name", "match"), [p[1:] for p in PLANTED],
                         ids=[p[0] for p in PLANTED])  # fmt: skip
def test_file_reader_refuses_planted_files_without_blocking(
    tmp_path: Path, request: pytest.FixtureRequest, plant: object, name: str, match: str
) -> None:
    """Someone with write access to the tools' folder plants a FIFO, a socket, a device, a hard
    link or a symlink: reading it fails with the reason, at once (never blocks on a FIFO), and
    no byte of the outside file is returned."""
    # a short root: a unix socket's path must fit in 108 bytes
    root = Path(tempfile.mkdtemp(prefix="car-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(root, ignore_errors=True))
    tb = Toolbox(make_world(78), root=root)
    assert root in tb.folder.parents  # never change the shared cache (a mutant's root)
    outside = tmp_path / "outside.txt"
    outside.write_text("TOP SECRET outside the heist folder")
    plant(tb.files_dir, outside)  # type: ignore[operator]
    box: list[ToolResult] = []
    t = threading.Thread(target=lambda: box.append(tb.run("file_reader", name)), daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(5)
    assert not t.is_alive(), "file_reader blocked"
    assert time.monotonic() - t0 < 1.0
    (r,) = box
    assert not r.ok and r.output == "", r
    assert r.error is not None and re.search(match, r.error), r.error
    assert "TOP SECRET" not in r.error


def test_file_reader_still_reads_a_real_file_in_a_subdirectory(tmp_path: Path) -> None:
    """A regular, singly-linked file in a real subdirectory is read."""
    tb = Toolbox(make_world(79), root=tmp_path)
    assert tmp_path in tb.folder.parents  # never change the shared cache (a mutant's root)
    (tb.files_dir / "sub").mkdir()
    (tb.files_dir / "sub" / "note.txt").write_text("meet at 01:30")
    r = tb.run("file_reader", "sub/note.txt")
    assert (r.ok, r.output) == (True, "meet at 01:30")
