"""The journal's own commands: `runs`, `verify`, `anchor`, `db path`, `db upgrade`.

Everything here but `runs --close-stale`, `anchor` (which only reads the journal) and
`db upgrade` opens the journal read-only: nothing is migrated, created or switched to WAL, and a
file that is not a journal is refused untouched.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from engine.commands.common import JsonOpt, emit_json, fail, journal_target, open_journal, out

if TYPE_CHECKING:
    from engine.journal import RunInfo, UnreadableRun

KeyFileOpt = Annotated[
    Path | None,
    typer.Option(
        "--key-file",
        help="File holding the anchor key (>= 16 bytes; keep it away from the journal). "
        "Default: $CAR_ANCHOR_KEY_FILE, else the key itself in $CAR_ANCHOR_KEY.",
    ),
]


def register(app: typer.Typer) -> None:
    db_app = typer.Typer(
        help="The journal database itself.", no_args_is_help=True, rich_markup_mode=None
    )
    app.add_typer(db_app, name="db")
    db_app.command("path")(db_path)
    db_app.command("upgrade")(db_upgrade)
    app.command("runs")(runs_cmd)
    app.command("verify")(verify_cmd)
    app.command("anchor")(anchor_cmd)


# ----------------------------------------------------------------- db


def db_path() -> None:
    """Print where the journal is."""
    target = journal_target()
    if "://" in target:
        out.print(target, highlight=False)
    else:
        out.print(str(Path(target).expanduser().resolve()), highlight=False)


def db_upgrade() -> None:
    """Create the journal or apply pending schema migrations."""
    with open_journal() as j:
        out.print(f"journal schema at revision {j.schema_revision()}", highlight=False)


# ----------------------------------------------------------------- runs


def runs_cmd(
    all_: Annotated[bool, typer.Option("--all", "-a", help="Include forked branches.")] = False,
    limit: Annotated[
        int, typer.Option("--limit", "-n", min=1, help="Show at most N root runs (newest).")
    ] = 20,
    close_stale: Annotated[
        bool,
        typer.Option(
            "--close-stale",
            help="Close every abandoned run (its writer process is gone) by appending a stop "
            "and RunEnded(stopped); then list.",
        ),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """List recorded runs (newest last); branches are shown under their parents with --all.

    A run whose writer process died before it ended shows as `abandoned`; `--close-stale`
    closes such runs in the journal (appending, like everything else), after which they can be
    forked and accused. A run whose row was tampered with (a cell retyped by hand) is left out
    and named on stderr; `car verify` reports it."""
    from engine import projections as views

    closed: list[dict[str, str]] = []
    if close_stale:
        with open_journal(create=False) as j:
            infos, _ = j.listing()
            readable = {info.run_id: info for info in infos}
            for info in infos:
                if not _reachable(info, readable):
                    continue  # a branch of a tampered run: its history does not read
                if j.status(info.run_id) == "abandoned":
                    closed.append({"run_id": info.run_id, "reason": j.close_abandoned(info.run_id)})
    with open_journal(create=False, readonly=True) as j:
        # one tampered row must not hide every other run: it is left out and named
        rows, unreadable = views.list_runs(j, include_branches=all_, limit=limit)
    _warn_unreadable(unreadable)
    if as_json:
        if close_stale:
            ids = [u.run_id for u in unreadable]
            emit_json({"closed": closed, "runs": rows, "unreadable": ids})
        else:
            emit_json(rows)
        return
    for c in closed:
        out.print(f"closed {c['run_id']}: {c['reason']}", highlight=False)
    if close_stale and not closed:
        out.print("no abandoned runs", highlight=False)
    if not rows:
        if not unreadable:
            out.print("no runs yet: record one with `car heist`", highlight=False)
        return
    from rich.table import Table

    table = Table(title=None, box=None, header_style="bold")
    # ids are what users copy into the next command: never cut them
    widest = max((2 * r["depth"] + len(r["run_id"]) for r in rows), default=12)
    table.add_column("run", no_wrap=True, min_width=widest)
    table.add_column("parent", no_wrap=True, min_width=12 if _has_parents(rows) else 0)
    for col in ("@step", "steps", "status", "outcome", "forks"):
        table.add_column(col, no_wrap=True)
    for r in rows:
        indent = "  " * r["depth"]
        outcome = r.get("outcome") or {}
        # a run that ended without one (failed, stopped) has no outcome: not "ok"
        bad = outcome.get("bad")
        verdict = "" if bad is None else "bad" if bad else "ok"
        table.add_row(
            indent + r["run_id"],
            r["parent_run_id"] or "",
            "" if r["fork_step"] is None else str(r["fork_step"]),
            str(r["steps"]),
            r["status"],
            verdict,
            str(r["branches"]),
        )
    out.print(table)
    if any(r["status"] == "abandoned" for r in rows) and not close_stale:
        out.print(
            "abandoned: the writer process is gone; close with `car runs --close-stale`",
            highlight=False,
        )


def _reachable(info: RunInfo, readable: dict[str, RunInfo]) -> bool:
    """Whether every ancestor of the run is among the readable runs."""
    seen: set[str] = set()
    while info.parent_run_id is not None and info.run_id not in seen:
        seen.add(info.run_id)
        parent = readable.get(info.parent_run_id)
        if parent is None:
            return False
        info = parent
    return info.parent_run_id is None


def _warn_unreadable(unreadable: list[UnreadableRun]) -> None:
    """One line on stderr per run whose row a listing left out (also beside --json)."""
    from engine.terminal import printable

    for u in unreadable:
        sys.stderr.write(
            f"warning: run {printable(u.run_id)} has a tampered {u.column} cell and is not"
            " listed (see `car verify`)\n"
        )


def _has_parents(rows: list[dict[str, Any]]) -> bool:
    return any(r["parent_run_id"] for r in rows)


# ----------------------------------------------------------------- verify


def verify_cmd(
    run_id: Annotated[str | None, typer.Argument(help="Only this run (default: all).")] = None,
    anchor: Annotated[
        Path | None,
        typer.Option(
            "--anchor",
            help="Also check against an anchor written by `car anchor`: finds re-chained runs, "
            "truncated tails, deleted runs and altered run rows.",
        ),
    ] = None,
    key_file: KeyFileOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Check the journal without changing it: every hash, row, column and snapshot.

    Exit 0 only when nothing is wrong; every finding names its run and seq."""
    from engine.anchor import load_key, read_anchor
    from engine.errors import NotAJournal
    from engine.verify import verify_journal

    doc = read_anchor(anchor, load_key(key_file)) if anchor is not None else None
    try:
        with open_journal(create=False, readonly=True) as j:
            report = verify_journal(j, run_id, anchor=doc)
    except NotAJournal as e:
        if "malformed" not in str(e) and "not a database" not in str(e):
            raise
        # so damaged that not even the schema reads: that is a finding too
        data = {"ok": False, "problems": [{"run_id": None, "seq": None, "problem": str(e)}]}
        if as_json:
            emit_json(data)
        fail(f"journal damaged: {e}")
        return
    if as_json:
        emit_json(report.to_dict())
    else:
        for note in report.notes:
            out.print(f"note: {note}", highlight=False)
        if report.ok:
            what = f"; {report.anchored_runs} runs match the anchor" if doc is not None else ""
            out.print(
                f"OK: {report.runs_checked} runs, {report.events_checked} events, "
                f"{report.snapshots_checked} snapshots, every hash verified{what}",
                highlight=False,
                soft_wrap=True,
            )
        else:
            # the findings are the report (stdout); the one error line goes to stderr
            for p in report.problems:
                where = f"run {p.run_id}" if p.run_id is not None else "journal"
                at = f" seq {p.seq}" if p.seq is not None else ""
                out.print(
                    f"{where}{at}: {p.problem}", highlight=False, markup=False, soft_wrap=True
                )
    if not report.ok:
        # name a run when one is hurt: that is what the user looks at next
        first = next((p for p in report.problems if p.run_id is not None), report.problems[0])
        where = f"run {first.run_id}" if first.run_id is not None else "the file"
        at = f" seq {first.seq}" if first.seq is not None else ""
        more = len(report.problems) - 1
        fail(
            f"journal tampered: {where}{at}: {first.problem}" + (f" (+{more} more)" if more else "")
        )


# ----------------------------------------------------------------- anchor


def anchor_cmd(
    output: Annotated[
        Path | None,
        typer.Option(
            "-o", "--output", help="Write the anchor to this file (default, or -: stdout)."
        ),
    ] = None,
    key_file: KeyFileOpt = None,
) -> None:
    """Write keyed digests of every run's head, to keep somewhere the journal's writers cannot.

    `car verify --anchor FILE` later reports any run that was re-chained, cut short, deleted or
    had its row changed since. The anchor is authenticated with HMAC-SHA256 under the key."""
    import datetime as dt
    import json

    from engine.anchor import load_key, make_anchor, write_anchor

    key = load_key(key_file)
    now = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    with open_journal(create=False, readonly=True) as j:
        doc = make_anchor(j, key, now)
    if output is None or str(output) == "-":
        sys.stdout.write(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        return
    write_anchor(doc, output)
    heads = sum(r["head"] for r in doc["runs"])
    sys.stderr.write(f"anchored {len(doc['runs'])} runs ({heads} events) in {output}\n")
