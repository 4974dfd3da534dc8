"""`car`: the command line of Causal Agent Replay. It parses and prints; the engine decides."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.tree import Tree

from engine import projections as views
from engine.errors import EngineError
from engine.journal import Journal, default_journal_url

app = typer.Typer(
    help="Causal Agent Replay: record multi-agent runs, replay and fork them, find the step "
    "that caused a failure and the agent that sabotaged it.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
db_app = typer.Typer(help="The journal database itself.", no_args_is_help=True)
app.add_typer(db_app, name="db")

out = Console()
err = Console(stderr=True)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]


class _Ctx:
    journal_target: str | None = None


_ctx = _Ctx()


@app.callback()
def _main(
    journal: Annotated[
        str | None,
        typer.Option(
            "--journal",
            envvar="CAR_JOURNAL",
            help="Journal file or database URL (sqlite path or postgresql+psycopg://...). "
            "Default: recordings/journal.db.",
        ),
    ] = None,
) -> None:
    _ctx.journal_target = journal


def open_journal(create: bool = True) -> Journal:
    return Journal(_ctx.journal_target or default_journal_url(), create=create)


def emit_json(data: Any) -> None:
    out.print_json(json.dumps(data, default=str))


# ----------------------------------------------------------------- db


@db_app.command("path")
def db_path() -> None:
    """Print where the journal is."""
    target = _ctx.journal_target or default_journal_url()
    if "://" in target:
        out.print(target, highlight=False)
    else:
        out.print(str(Path(target).expanduser().resolve()), highlight=False)


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Create the journal or apply pending schema migrations."""
    with open_journal() as j:
        out.print(f"journal schema at revision {j.schema_revision()}", highlight=False)


# ----------------------------------------------------------------- runs


@app.command("runs")
def runs_cmd(
    all_: Annotated[bool, typer.Option("--all", "-a", help="Include forked branches.")] = False,
    limit: Annotated[int, typer.Option("-n", help="Show at most N root runs (newest).")] = 20,
    as_json: JsonOpt = False,
) -> None:
    """List recorded runs (newest last); branches are shown under their parents with --all."""
    with open_journal(create=False) as j:
        rows = views.list_runs(j, include_branches=all_, limit=limit)
    if as_json:
        emit_json(rows)
        return
    table = Table(title=None, box=None, header_style="bold")
    for col in ("run", "scenario", "parent", "fork@step", "steps", "status", "outcome", "branches"):
        table.add_column(col)
    for r in rows:
        indent = "  " * r["depth"]
        outcome = r.get("outcome") or {}
        verdict = "" if not outcome else ("bad" if outcome.get("bad") else "ok")
        table.add_row(
            indent + r["run_id"],
            r["scenario"],
            r["parent_run_id"] or "",
            "" if r["fork_step"] is None else str(r["fork_step"]),
            str(r["steps"]),
            r["status"],
            verdict,
            str(r["branches"]),
        )
    out.print(table)


@app.command("show")
def show_cmd(
    run_id: Annotated[str, typer.Argument(help="Run id or unique prefix.")],
    reveal: Annotated[
        bool, typer.Option("--reveal", help="Also show secret events (the mole).")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Show a run: its header, transcript, outcome and branch tree."""
    with open_journal(create=False) as j:
        data = views.show_run(j, run_id, reveal=reveal)
    if as_json:
        emit_json(data)
        return
    h = data["run"]
    out.print(
        f"[bold]run {h['run_id']}[/]  scenario={h['scenario']}  status={data['status']}  "
        f"steps={data['steps']}",
        highlight=False,
    )
    if h["parent_run_id"]:
        out.print(f"forked from {h['parent_run_id']} at step {data['fork_step']}", highlight=False)
    start = data.get("started") or {}
    if start:
        out.print(
            f"policy={start.get('policy')}  seed={start.get('root_seed')}  "
            f"agents={', '.join(start.get('agents', []))}",
            highlight=False,
        )
    for line in data["lines"]:
        out.print(line, highlight=False, markup=False)
    if data.get("outcome"):
        o = data["outcome"]
        out.print(
            f"[bold]outcome[/]: {'BAD' if o.get('bad') else 'OK'} score={o.get('score')}",
            highlight=False,
        )
        for reason in o.get("reasons", []):
            out.print(f"  - {reason}", highlight=False, markup=False)
    tree_data = data["branches"]
    if tree_data["children"]:
        tree = Tree(f"[bold]{tree_data['run_id']}[/]")
        _add_branches(tree, tree_data["children"])
        out.print(tree)


def _add_branches(node: Tree, children: list[dict[str, Any]]) -> None:
    for c in children:
        label = f"{c['run_id']} @step {c['fork_step']} {c.get('op') or ''} {c.get('verdict') or ''}"
        _add_branches(node.add(label.strip()), c["children"])


@app.command("state")
def state_cmd(
    run_id: Annotated[str, typer.Argument(help="Run id or unique prefix.")],
    at: Annotated[int, typer.Option("--at", "-k", help="Step k: the state before step k.")],
    reveal: Annotated[
        bool, typer.Option("--reveal", help="Include the mole's secret context.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Reconstruct s_k (the state before step k) from the journal."""
    with open_journal(create=False) as j:
        data = views.state_view(j, run_id, at, reveal=reveal)
    if as_json:
        emit_json(data)
        return
    out.print(
        f"[bold]s_{at}[/] of run {data['run_id']}: {data['seq']} events folded, "
        f"next agent {data['acting_agent']} (round {data['round']}), status {data['status']}",
        highlight=False,
    )
    out.print(f"seeds in window: {data['seeds']}", highlight=False)
    out.print("[bold]conversation (window)[/]")
    for m in data["transcript"]:
        out.print(f"  [{m['step']}] {m['agent']}: {m['text']}", highlight=False, markup=False)
    out.print("[bold]private contexts[/]")
    for agent, ctx in data["contexts"].items():
        out.print(
            f"  {agent}: turns={ctx['turns']} observations={len(ctx['observations'])}"
            + (f" secret={ctx['secret']!r}" if ctx.get("secret") else ""),
            highlight=False,
            markup=False,
        )


@app.command("verify")
def verify_cmd(
    run_id: Annotated[str | None, typer.Argument(help="Only this run (default: all).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Re-derive every hash of the chain; exit 0 only when the journal is intact."""
    with open_journal(create=False) as j:
        report = j.verify(run_id)
    if as_json:
        emit_json(
            {
                "ok": report.ok,
                "runs_checked": report.runs_checked,
                "events_checked": report.events_checked,
                "problems": [
                    {"run_id": p.run_id, "seq": p.seq, "problem": p.problem}
                    for p in report.problems
                ],
            }
        )
    elif report.ok:
        out.print(
            f"OK: {report.runs_checked} runs, {report.events_checked} events, every hash verified",
            highlight=False,
        )
    if not report.ok:
        first = report.problems[0]
        fail(
            f"journal tampered: run {first.run_id} seq {first.seq}: {first.problem}"
            + (f" (+{len(report.problems) - 1} more runs)" if len(report.problems) > 1 else "")
        )


def fail(message: str, code: int = 1) -> None:
    """One clean line on stderr (never wrapped) and a non-zero exit."""
    first = " ".join(message.split())
    sys.stderr.write(f"error: {first}\n")
    raise SystemExit(code)


def main() -> None:
    """Entry point: run the app, turning engine errors into one clean line and exit 1."""
    try:
        app()
    except EngineError as e:
        fail(str(e))
    except KeyboardInterrupt:
        err.print("interrupted", highlight=False)
        sys.exit(130)


if __name__ == "__main__":
    main()
