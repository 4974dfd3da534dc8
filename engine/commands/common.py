"""What every command shares: the consoles, the journal it opens, JSON output, one-line errors."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer
from rich.console import Console

from engine.journal import Journal, default_journal_url

# A pipe gets whole lines: rich would hard-wrap them at 80 columns, mid-word, when stdout is
# not a terminal; soft wrapping leaves the wrapping to whatever reads the output.
out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)

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


def emit_json(data: Any) -> None:
    out.print_json(json.dumps(data, default=str))


def fail(message: str, code: int = 1) -> None:
    """One clean line on stderr (never wrapped) and a non-zero exit."""
    first = " ".join(message.split())
    sys.stderr.write(f"error: {first}\n")
    raise SystemExit(code)


def progress() -> Any:
    """A progress bar on stderr, shown only when stderr is a terminal (never mixed into --json)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    return Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    )
