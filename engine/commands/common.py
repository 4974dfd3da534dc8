"""What every command shares: the consoles, the journal it opens, JSON output, one-line errors."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import TYPE_CHECKING, Annotated, Any, cast

import typer

from engine.journal import Journal, default_journal_url

if TYPE_CHECKING:
    from rich.console import Console


#: the exit status of a command whose reader closed its output early (`car export RUN | head`):
#: what a process that the pipe's SIGPIPE ended gets, 128 + 13 (docs/decisions.md, 56)
EXIT_PIPE_CLOSED = 141


class _LazyConsole:
    """A rich Console made on first use: importing rich costs ~20 ms of every start-up, and a
    command that prints JSON into a pipe, or only an error line, never needs it."""

    def __init__(self, **options: Any) -> None:
        self._options = options
        self._console: Console | None = None

    @property
    def console(self) -> Console:
        if self._console is None:
            from rich.console import Console

            class _Console(Console):
                def on_broken_pipe(self) -> None:
                    # its reader went away (`car show RUN | head`): nothing more to write,
                    # and the exit status every command gives then (rich's own: 1)
                    self.quiet = True
                    with contextlib.suppress(OSError, ValueError):
                        devnull = os.open(os.devnull, os.O_WRONLY)
                        os.dup2(devnull, self.file.fileno())
                    raise SystemExit(EXIT_PIPE_CLOSED)

            self._console = _Console(**self._options)
        return self._console

    def __getattr__(self, name: str) -> Any:
        return getattr(self.console, name)


# A pipe gets whole lines: rich would hard-wrap them at 80 columns, mid-word, when stdout is
# not a terminal; soft wrapping leaves the wrapping to whatever reads the output.
out = cast("Console", _LazyConsole(soft_wrap=True))
err = cast("Console", _LazyConsole(stderr=True, soft_wrap=True))


def _plain(stream: Any) -> bool:
    """Whether rich would treat `stream` as no terminal (nothing to colour, nothing to
    redraw), by the variables and the test rich's `Console.is_terminal` uses."""
    compatible = os.environ.get("TTY_COMPATIBLE", "")
    if compatible in ("0", "1"):
        return compatible == "0"
    force = os.environ.get("FORCE_COLOR")
    if force is not None:
        return force == ""
    try:
        return not stream.isatty()
    except (AttributeError, ValueError):
        return True


JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]


class _Ctx:
    """Options of the `car` callback that every command reads (set once per invocation)."""

    journal_target: str | None = None


options = _Ctx()


def journal_target() -> str:
    return options.journal_target or default_journal_url()


def open_journal(create: bool = True, readonly: bool = False) -> Journal:
    """The journal the command works on; `readonly` for commands that only read (never
    migrates, creates or writes, and refuses a file that is not a journal untouched)."""
    return Journal(journal_target(), create=create and not readonly, readonly=readonly)


#: What JSON may hold raw inside a string but a terminal could act on (DEL, C1 controls such as
#: CSI, line separators, bidi overrides): written as \\u escapes, the same value to a parser.
_UNSAFE_IN_JSON = {c: f"\\u{c:04x}" for c in (0x7F, *range(0x80, 0xA0), 0x2028, 0x2029,
                   *range(0x202A, 0x202F), *range(0x2066, 0x206A))}  # fmt: skip


def emit_json(data: Any) -> None:
    """`data` as JSON on stdout: indented, non-ASCII text as itself but never a character a
    terminal would act on (C0 controls are escaped by JSON itself, the rest here); coloured
    on a terminal."""
    # through a compact dump first: what a default (`str`) made of a value is then plain data
    text = json.dumps(json.loads(json.dumps(data, default=str)), indent=2, ensure_ascii=False)
    text = text.translate(_UNSAFE_IN_JSON)
    if _plain(sys.stdout):
        sys.stdout.write(text + "\n")
    else:
        from rich.highlighter import JSONHighlighter
        from rich.text import Text

        shown = Text(text, no_wrap=True, overflow="ignore")
        JSONHighlighter().highlight(shown)
        out.print(shown, soft_wrap=True)


def fail(message: str, code: int = 1) -> None:
    """One clean line on stderr (never wrapped), terminal control in it shown escaped (an
    error may quote what a user, a file or a model wrote), and a non-zero exit."""
    from engine.terminal import printable

    first = printable(" ".join(message.split()))
    sys.stderr.write(f"error: {first}\n")
    raise SystemExit(code)


def progress() -> Any:
    """A progress bar on stderr, shown only when stderr is a terminal (never mixed into --json)."""
    if _plain(sys.stderr):
        return _NoProgress()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    return Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=cast(_LazyConsole, err).console,  # rich needs the Console itself
        transient=True,
        disable=not err.is_terminal,
    )


class _NoProgress:
    """What `progress()` gives when stderr is no terminal: rich's Progress API, showing
    nothing (as rich's disabled bar shows nothing), without importing rich."""

    def __enter__(self) -> _NoProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def add_task(self, description: str, **_: Any) -> int:
        return 0

    def update(self, task: int, **_: Any) -> None:
        return None

    def advance(self, task: int, advance: float = 1) -> None:
        return None

    def remove_task(self, task: int) -> None:
        return None
