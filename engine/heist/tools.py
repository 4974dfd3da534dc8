"""The three heist tools and the inline call syntax agents use to invoke them.

Grammar of an inline tool call (what `parse_tool_calls` accepts)::

    call   := "[TOOL:" name ( ":" param )? "]"
    name   := [A-Za-z_][A-Za-z0-9_]*
    param  := any text, up to the first "]" that is not nested and not quoted

Inside `param`, text in single or double quotes is taken literally (so a "]" in a SQL string
does not end the call), and balanced square brackets nest. A quote that is never closed is an
ordinary character. `param` may contain colons ("01:30"), newlines and quotes; surrounding
whitespace is stripped. `[TOOL:name]` is a call with an empty parameter. Text that opens a call
but never closes it, or whose parameter runs past `MAX_PARAM_CHARS`, is not a call. The prefix
"[TOOL:" is case-sensitive. At most `MAX_CALLS_PER_MESSAGE` calls are taken from one message,
and only its first `MAX_CALL_OPENINGS` openings are examined, so hostile text costs little.

Every tool faces untrusted input and answers with a `ToolResult`; no parameter makes `run` raise
or change anything on disk. Results are deterministic for a given world and parameter, so a
replay that re-runs a tool gets the recorded answer back.
"""

from __future__ import annotations

import ast
import math
import os
import re
import shutil
import sqlite3
import stat
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path, PurePosixPath

import msgspec

from engine.errors import EngineError
from engine.heist.world import World, world_files, world_tables
from engine.policies.base import Observation

TOOL_NAMES: tuple[str, ...] = ("calculator", "file_reader", "database_query")

MAX_CALLS_PER_MESSAGE = 16
MAX_CALL_OPENINGS = 64
MAX_PARAM_CHARS = 2000
MAX_EXPRESSION_CHARS = 200
MAX_NUMBER = 10**15
MAX_FILE_CHARS = 4000
MAX_SQL_CHARS = 2000
MAX_ROWS = 50
MAX_CELL_CHARS = 200
MAX_OUTPUT_CHARS = 8000
# The query budget is counted in SQLite VM instructions, not seconds, so the same query fails
# (or succeeds) the same way on every machine and in every replay.
_PROGRESS_EVERY = 1000
MAX_QUERY_STEPS = 2000  # x _PROGRESS_EVERY instructions
# A wall-clock backstop behind the instruction budget, checked by the same progress handler:
# it catches what the budget counts as cheap (a slow disk, a loaded machine).
MAX_QUERY_SECONDS = 2.0
# What one VM instruction may cost is bounded by the size of its operands: LIKE/GLOB of a long
# pattern, instr() or replace() over long strings run inside a single instruction, where no
# progress handler can stop them. Short patterns and strings keep every instruction cheap.
MAX_LIKE_PATTERN_CHARS = 100
MAX_VALUE_BYTES = 20_000
# Sorts, DISTINCT, GROUP BY and materialised subqueries use temporary storage; it is kept in
# memory (never a temp file) and SQLite's heap is capped. The cap is process-wide (SQLite has
# no per-connection heap limit, and the pragma can only lower it); it sits far above what the
# journal's connections use (a few MiB of page cache each).
HARD_HEAP_LIMIT_BYTES = 128 * 1024 * 1024

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PREFIX = "[TOOL:"


class ToolResult(msgspec.Struct, frozen=True):
    """The answer of one tool call. A failed call has ok=False, output "" and a reason."""

    tool: str
    param: str
    ok: bool
    output: str
    error: str | None = None


def observation_for(result: ToolResult, step: int) -> Observation:
    """The private observation an agent receives for a tool result (the reason if it failed)."""
    text = result.output if result.ok else (result.error or "failed")
    return Observation(step=step, tool=result.tool, param=result.param, ok=result.ok, output=text)


def parse_tool_calls(text: str) -> list[tuple[str, str]]:
    """All inline `[TOOL:name:param]` calls in `text`, in order, as (name, param) pairs."""
    calls: list[tuple[str, str]] = []
    pos = 0
    for _ in range(MAX_CALL_OPENINGS):
        if len(calls) >= MAX_CALLS_PER_MESSAGE:
            break
        start = text.find(_PREFIX, pos)
        if start < 0:
            break
        m = _NAME.match(text, start + len(_PREFIX))
        if m is None or m.end() >= len(text) or text[m.end()] not in ":]":
            pos = start + len(_PREFIX)
            continue
        if text[m.end()] == "]":
            calls.append((m.group(), ""))
            pos = m.end() + 1
            continue
        body = m.end() + 1
        end = _param_end(text, body, quotes=True)
        if end is None:
            end = _param_end(text, body, quotes=False)
        if end is None:
            pos = start + len(_PREFIX)
            continue
        calls.append((m.group(), text[body:end].strip()))
        pos = end + 1
    return calls


def _param_end(text: str, i: int, *, quotes: bool) -> int | None:
    """Index of the "]" closing a parameter starting at i, or None if it never closes."""
    depth = 0
    quote = ""
    n = min(len(text), i + MAX_PARAM_CHARS + 1)
    while i < n:
        ch = text[i]
        if quote:
            if ch == quote:
                quote = ""
        elif quotes and ch in "'\"":
            quote = ch
        elif ch == "[":
            depth += 1
        elif ch == "]":
            if depth == 0:
                return i
            depth -= 1
        i += 1
    return None


def _fail(tool: str, param: str, reason: str) -> ToolResult:
    return ToolResult(tool=tool, param=param, ok=False, output="", error=reason)


def _ok(tool: str, param: str, output: str) -> ToolResult:
    return ToolResult(tool=tool, param=param, ok=True, output=output)


# --- calculator ---------------------------------------------------------------------------

_BINOPS: dict[type[ast.operator], str] = {
    ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%",
    ast.Pow: "**", ast.BitXor: "^", ast.BitAnd: "&", ast.BitOr: "|", ast.LShift: "<<",
    ast.RShift: ">>", ast.MatMult: "@",
}  # fmt: skip
_ALLOWED_BINOPS = frozenset({"+", "-", "*", "/", "//", "%", "**"})


class _CalcError(Exception):
    """A reason the calculator refuses an expression; never leaves this module."""


def _calculate(expression: str) -> int | float:
    expr = _unquote(expression.strip())
    if not expr:
        raise _CalcError("empty expression")
    if len(expr) > MAX_EXPRESSION_CHARS:
        raise _CalcError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as e:
        col = f" at column {e.offset}" if e.offset else ""
        raise _CalcError(f"not an arithmetic expression{col}: {expr!r}") from None
    except (ValueError, RecursionError, MemoryError):
        raise _CalcError(f"not an arithmetic expression: {expr!r}") from None
    try:
        value = _eval(tree.body)
    except RecursionError:
        raise _CalcError("expression is nested too deeply") from None
    return value


def _eval(node: ast.expr) -> int | float:
    if isinstance(node, ast.Constant):
        v = node.value
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise _CalcError(f"only numbers are allowed, got {v!r}")
        return _bounded(v)
    if isinstance(node, ast.UnaryOp):
        if isinstance(node.op, ast.USub):
            return _bounded(-_eval(node.operand))
        if isinstance(node.op, ast.UAdd):
            return _eval(node.operand)
        raise _CalcError(f"operator {type(node.op).__name__} is not allowed")
    if isinstance(node, ast.BinOp):
        sym = _BINOPS.get(type(node.op), type(node.op).__name__)
        if sym not in _ALLOWED_BINOPS:
            hint = " (use ** for powers)" if sym == "^" else ""
            raise _CalcError(f"operator {sym!r} is not allowed{hint}")
        return _binop(sym, _eval(node.left), _eval(node.right))
    if isinstance(node, ast.Name):
        raise _CalcError(f"names are not allowed: {node.id!r}")
    if isinstance(node, ast.Call):
        raise _CalcError("function calls are not allowed")
    if isinstance(node, ast.Attribute):
        raise _CalcError("attribute access is not allowed")
    raise _CalcError(f"{type(node).__name__} is not allowed; use numbers, + - * / // % ** and ()")


def _binop(sym: str, a: int | float, b: int | float) -> int | float:
    if sym in ("/", "//", "%") and b == 0:
        raise _CalcError("division by zero")
    if sym == "**":
        return _power(a, b)
    if sym == "+":
        return _bounded(a + b)
    if sym == "-":
        return _bounded(a - b)
    if sym == "*":
        return _bounded(a * b)
    if sym == "/":
        return _bounded(a / b)
    if sym == "//":
        return _bounded(a // b)
    return _bounded(a % b)


def _power(a: int | float, b: int | float) -> int | float:
    if abs(b) > 64:
        raise _CalcError("exponent too large (limit 64)")
    if a == 0 and b < 0:
        raise _CalcError("division by zero")
    # Estimate the size before computing, so 9**64 never materialises a huge integer.
    if abs(a) > 1 and b > 0 and b * math.log10(abs(a)) > 15.5:
        raise _CalcError(f"result too large (limit {MAX_NUMBER:.0e})")
    if a < 0 and isinstance(b, float) and not b.is_integer():
        raise _CalcError("result is not a real number")
    try:
        result = a**b
    except (OverflowError, ZeroDivisionError) as e:
        raise _CalcError(str(e)) from None
    return _bounded(result)


def _bounded(v: int | float) -> int | float:
    if isinstance(v, float) and not math.isfinite(v):
        raise _CalcError("result is not a finite number")
    if abs(v) > MAX_NUMBER:
        raise _CalcError(f"number too large (limit {MAX_NUMBER:.0e})")
    return v


def format_number(v: int | float) -> str:
    """Integers as integers; floats with up to 12 significant digits (5.0 -> '5')."""
    if isinstance(v, int):
        return str(v)
    return format(v, ".12g")


def _unquote(text: str) -> str:
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"`":
        return text[1:-1].strip()
    return text


def _run_calculator(param: str) -> ToolResult:
    try:
        value = _calculate(param)
    except _CalcError as e:
        return _fail("calculator", param, str(e))
    return _ok("calculator", param, format_number(value))


# --- the world's folder and database ------------------------------------------------------


def cache_root() -> Path:
    """Per-user directory under the system temp dir where worlds are materialised."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"car-heist-{uid}"


def materialise(world: World, root: Path | None = None) -> Path:
    """The world's folder (files/ and security.db), built once and reused by every process.

    Built in a private temporary directory and renamed into place, so processes racing to build
    the same world never see a half-written folder: the first rename wins, the others discard
    their copy.
    """
    base = root if root is not None else cache_root()
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_private(base)
    final = base / world.content_hash().replace(":", "-")
    if _usable(final, world):
        return final
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=base))
    try:
        files = tmp / "files"
        files.mkdir()
        for name, text in world_files(world).items():
            (files / name).write_text(text, encoding="utf-8")
        _build_database(world, tmp / "security.db")
        (tmp / "complete").write_text(world.content_hash() + "\n", encoding="utf-8")
        try:
            os.rename(tmp, final)
        except OSError as e:
            if not (final / "complete").is_file():
                raise EngineError(
                    f"heist folder {str(final)!r} exists but is incomplete; delete it"
                ) from e
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _usable(final: Path, world: World) -> bool:
    """Whether a world's folder is there whole: built to the end, with its database and every
    file. A folder something emptied since (a clean-up of old files in /tmp) is moved aside and
    removed, to be built again: left, it would fail every query of that world on the machine."""
    if not (final / "complete").is_file():
        return False
    names = ["security.db", *(f"files/{n}" for n in world_files(world))]
    if all((final / n).is_file() for n in names):
        return True
    aside = final.with_name(f".broken-{final.name}-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.rename(final, aside)
    except FileNotFoundError:
        return False  # another process moved it first
    shutil.rmtree(aside, ignore_errors=True)
    return False


def _check_private(base: Path) -> None:
    """Refuse a cache folder others could have planted or can write to: its files are the
    ground truth the tools report."""
    st = os.lstat(base)
    owner_ok = not hasattr(os, "getuid") or st.st_uid == os.getuid()
    if stat.S_ISLNK(st.st_mode) or not owner_ok or st.st_mode & 0o022:
        raise EngineError(
            f"heist cache folder {str(base)!r} is not a private directory of this user "
            "(a symlink, another owner, or writable by others)"
        )


def _build_database(world: World, path: Path) -> None:
    conn = sqlite3.connect(path)
    try:
        for table, (columns, rows) in world_tables(world).items():
            cols = ", ".join(columns)
            conn.execute(f"CREATE TABLE {table} ({cols})")
            marks = ", ".join("?" * len(columns))
            conn.executemany(f"INSERT INTO {table} VALUES ({marks})", rows)
        conn.commit()
    finally:
        conn.close()


# --- file_reader --------------------------------------------------------------------------


def _run_file_reader(folder: Path, param: str) -> ToolResult:
    name = _unquote(param.strip())
    reason = _unsafe_name(name)
    if reason is not None:
        return _fail("file_reader", param, reason)
    try:
        fd = _open_inside(folder, PurePosixPath(name).parts)
    except _Refused as e:
        return _fail("file_reader", param, str(e).format(name=repr(name), listing=_listing(folder)))
    try:
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read(MAX_FILE_CHARS * 4 + 1)
    except OSError as e:
        return _fail("file_reader", param, f"cannot read {name!r}: {e.strerror}")
    finally:
        os.close(fd)
    text = data.decode("utf-8", errors="replace")
    if len(text) > MAX_FILE_CHARS:
        text = text[:MAX_FILE_CHARS] + f"\n[... truncated at {MAX_FILE_CHARS} characters]"
    return _ok("file_reader", param, text)


class _Refused(Exception):
    """Why a path is not read; {name} and {listing} are filled in by the caller."""


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _open_inside(folder: Path, parts: tuple[str, ...]) -> int:
    """An fd of the regular file folder/parts..., opened one component at a time relative to
    its parent's fd, so nothing swapped in between a check and the open is followed:

    * every component is opened with O_NOFOLLOW (a symlink, also a symlinked directory, fails
      to open instead of being followed);
    * the file is opened with O_NONBLOCK, so a FIFO or a device never blocks the open, and
      fstat of the opened fd must say regular file with one link (a hard link planted in the
      folder shares its inode with a file elsewhere)."""
    if not parts:
        raise _Refused("'.' is the folder itself, not a file")
    flags_dir = os.O_RDONLY | _NOFOLLOW | _DIRECTORY | _CLOEXEC | _NONBLOCK
    fd = os.open(folder, flags_dir)
    try:
        for part in parts[:-1]:
            try:
                nxt = os.open(part, flags_dir, dir_fd=fd)
            except OSError as e:
                raise _Refused(_why(fd, part, e, folder_part=True)) from None
            os.close(fd)
            fd = nxt
        last = parts[-1]
        try:
            out = os.open(last, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC, dir_fd=fd)
        except OSError as e:
            raise _Refused(_why(fd, last, e, folder_part=False)) from None
    finally:
        os.close(fd)
    st = os.fstat(out)
    if not stat.S_ISREG(st.st_mode):
        os.close(out)
        kind = _kind(st.st_mode)
        raise _Refused(f"{{name}} is {kind}, not a regular file; available: {{listing}}")
    if st.st_nlink != 1:
        os.close(out)
        raise _Refused(
            f"{{name}} has {st.st_nlink} hard links; a linked file is not read "
            "(it may be a file from outside the heist folder)"
        )
    return out


def _why(dir_fd: int, part: str, e: OSError, *, folder_part: bool) -> str:
    try:
        st = os.lstat(part, dir_fd=dir_fd)
    except OSError:
        return "no such file {name}; available: {listing}"
    if stat.S_ISLNK(st.st_mode):
        return "{name} is (or passes through) a symbolic link; links are not read"
    if folder_part and not stat.S_ISDIR(st.st_mode):
        return "no such file {name}; available: {listing}"
    if not folder_part and not stat.S_ISREG(st.st_mode):  # a socket cannot be opened at all
        return f"{{name}} is {_kind(st.st_mode)}, not a regular file; available: {{listing}}"
    return f"cannot open {{name}}: {e.strerror}"


def _kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a named pipe (FIFO)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


def _listing(folder: Path) -> str:
    return ", ".join(sorted(p.name for p in folder.iterdir() if p.is_file() and not p.is_symlink()))


def _unsafe_name(name: str) -> str | None:
    if not name:
        return "empty file name"
    if "\x00" in name:
        return "file name contains a NUL byte"
    if len(name) > 255:
        return "file name longer than 255 characters"
    if "\\" in name:
        return f"backslashes are not allowed in file names: {name!r}"
    if name.startswith("/") or re.match(r"^[A-Za-z]:", name) or name.startswith("~"):
        return f"absolute paths are not allowed: {name!r}; name a file in the heist folder"
    if ".." in PurePosixPath(name).parts:
        return f"'..' is not allowed: the file reader cannot leave its folder ({name!r})"
    if name in (".", "./"):
        return "'.' is the folder itself, not a file"
    return None


# --- database_query -----------------------------------------------------------------------

# Reading is all a query may do; functions that depend on the clock or on chance are refused
# so that a replayed query gives the recorded answer.
_DENIED_FUNCTIONS = frozenset(
    {
        "random", "randomblob", "load_extension", "date", "time", "datetime", "julianday",
        "strftime", "unixepoch", "timediff", "current_date", "current_time",
        "current_timestamp",
    }
)  # fmt: skip
_ALLOWED_ACTIONS = frozenset({sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_RECURSIVE})


def _authorize(action: int, arg1: str | None, arg2: str | None, *_: object) -> int:
    if action in _ALLOWED_ACTIONS:
        return sqlite3.SQLITE_OK
    if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() not in _DENIED_FUNCTIONS:
        return sqlite3.SQLITE_OK
    return sqlite3.SQLITE_DENY


def _open_readonly(path: Path) -> sqlite3.Connection:
    uri = "file:" + urllib.parse.quote(str(path)) + "?mode=ro"
    conn = sqlite3.connect(uri, uri=True)
    conn.execute("PRAGMA query_only=ON")
    conn.execute("PRAGMA temp_store=MEMORY")
    conn.execute(f"PRAGMA hard_heap_limit={HARD_HEAP_LIMIT_BYTES}")
    conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
    conn.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, MAX_SQL_CHARS * 2)
    conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
    conn.setlimit(sqlite3.SQLITE_LIMIT_LIKE_PATTERN_LENGTH, MAX_LIKE_PATTERN_CHARS)
    conn.setlimit(sqlite3.SQLITE_LIMIT_COMPOUND_SELECT, 50)
    conn.setlimit(sqlite3.SQLITE_LIMIT_EXPR_DEPTH, 100)
    conn.set_authorizer(_authorize)
    return conn


_COMMENT = re.compile(r"\s+|--[^\n]*(?:\n|$)|/\*.*?\*/", re.S)


def _first_keyword(sql: str) -> str:
    i = 0
    while True:
        m = _COMMENT.match(sql, i)
        if m is None or m.end() == i:
            break
        i = m.end()
    m = re.match(r"[A-Za-z_]+", sql[i:])
    return m.group().upper() if m else sql[i : i + 10]


def _run_query(conn: sqlite3.Connection, param: str) -> ToolResult:
    sql = param.strip()
    if not sql:
        return _fail("database_query", param, "empty query")
    if len(sql) > MAX_SQL_CHARS:
        return _fail("database_query", param, f"query longer than {MAX_SQL_CHARS} characters")
    if "\x00" in sql:
        return _fail("database_query", param, "query contains a NUL byte")
    keyword = _first_keyword(sql)
    if keyword not in ("SELECT", "WITH"):
        return _fail(
            "database_query",
            param,
            f"only a single SELECT (or WITH ... SELECT) query is allowed, got {keyword!r}; "
            "the security database is read-only",
        )
    steps = 0
    deadline = time.monotonic() + MAX_QUERY_SECONDS

    def budget() -> int:
        nonlocal steps
        steps += 1
        return 1 if steps > MAX_QUERY_STEPS or time.monotonic() > deadline else 0

    conn.set_progress_handler(budget, _PROGRESS_EVERY)
    cur = conn.cursor()
    try:
        cur.execute(sql)
        columns = [d[0] for d in cur.description or ()]
        rows = cur.fetchmany(MAX_ROWS + 1)
    except sqlite3.ProgrammingError as e:
        if "one statement" in str(e):
            return _fail("database_query", param, "only one statement per query is allowed")
        return _fail("database_query", param, f"query rejected: {e}")
    except sqlite3.Error as e:
        return _fail("database_query", param, _sql_reason(str(e)))
    except MemoryError:
        return _fail("database_query", param, "query needed too much memory and was stopped")
    except (OverflowError, ValueError) as e:
        return _fail("database_query", param, f"query rejected: {type(e).__name__}")
    finally:
        cur.close()
        conn.set_progress_handler(None, 0)
    return _ok("database_query", param, _render_rows(columns, rows))


def _sql_reason(message: str) -> str:
    if message == "interrupted":
        return "query ran too long and was stopped"
    if "LIKE or GLOB pattern too complex" in message:
        return f"LIKE/GLOB pattern longer than {MAX_LIKE_PATTERN_CHARS} characters"
    if "string or blob too big" in message:
        return f"a value grew past {MAX_VALUE_BYTES} bytes; the query was stopped"
    if "out of memory" in message:
        return "query needed too much memory and was stopped"
    if message.startswith("not authorized"):
        detail = message.removeprefix("not authorized").strip(": ")
        what = f" ({detail})" if detail else ""
        return f"not allowed{what}: the security database is read-only and accepts only queries"
    if "readonly" in message or "read-only" in message:
        return "not allowed: the security database is read-only"
    return f"SQL error: {message}"


def _render_rows(columns: list[str], rows: list[tuple[object, ...]]) -> str:
    if not columns:
        return "(no columns)"
    lines = ["|".join(columns)]
    for row in rows[:MAX_ROWS]:
        lines.append("|".join(_cell(v) for v in row))
    if not rows:
        lines.append("(no rows)")
    elif len(rows) > MAX_ROWS:
        lines.append(f"(first {MAX_ROWS} rows shown; more omitted)")
    out = "\n".join(lines)
    if len(out) > MAX_OUTPUT_CHARS:
        out = out[:MAX_OUTPUT_CHARS] + f"\n[... truncated at {MAX_OUTPUT_CHARS} characters]"
    return out


def _cell(v: object) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, bytes):
        return f"<{len(v)} bytes>"
    if isinstance(v, float):
        return format_number(v)
    text = str(v).replace("\n", " ").replace("|", "/")
    return text if len(text) <= MAX_CELL_CHARS else text[:MAX_CELL_CHARS] + "..."


# --- Toolbox ------------------------------------------------------------------------------

_folders: dict[tuple[str, str], Path] = {}
_folders_lock = threading.Lock()
# SQLite connections may not cross threads or a fork, so each (process, thread) opens its own.
_local = threading.local()


class Toolbox:
    """The tools bound to one world. Cheap to construct: folders and connections are cached."""

    def __init__(self, world: World, root: Path | None = None) -> None:
        self.world = world
        self._hash = world.content_hash()
        key = (self._hash, str(root))
        with _folders_lock:
            folder = _folders.get(key)
            if folder is None or not (folder / "complete").is_file():
                folder = materialise(world, root)
                _folders[key] = folder
        self.folder = folder
        self.files_dir = folder / "files"
        self.db_path = folder / "security.db"

    def ready(self) -> bool:
        """Whether its materialised files are still there (a long-lived process may outlive
        a cleaned-up temporary folder; a new Toolbox materialises them again)."""
        return (self.folder / "complete").is_file()

    def run(self, name: str, param: str) -> ToolResult:
        """Run tool `name` on `param`; every failure is a failed result, never an exception."""
        if not isinstance(name, str) or not isinstance(param, str):
            return _fail(str(name), str(param), "tool name and parameter must be text")
        if name == "calculator":
            return _run_calculator(param)
        if name == "file_reader":
            try:
                return _run_file_reader(self.files_dir, param)
            except (OSError, ValueError) as e:
                return _fail(name, param, f"cannot read: {type(e).__name__}")
        if name == "database_query":
            try:
                conn = self._connection()
            except sqlite3.Error as e:
                return _fail(name, param, f"security database unavailable: {e}")
            return _run_query(conn, param)
        return _fail(
            name, param, f"unknown tool {name!r}; available tools: {', '.join(TOOL_NAMES)}"
        )

    def _connection(self) -> sqlite3.Connection:
        pid = os.getpid()
        conns: dict[str, sqlite3.Connection] | None = getattr(_local, "conns", None)
        if conns is None or getattr(_local, "pid", None) != pid:
            conns = {}
            _local.conns = conns
            _local.pid = pid
        key = str(self.db_path)
        conn = conns.get(key)
        if conn is None:
            conn = _open_readonly(self.db_path)
            conns[key] = conn
        return conn
