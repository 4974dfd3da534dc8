"""Commands for recorded programs: `car record -- CMD` and `car replay RUN -- CMD`.

`car fork RUN ... -- CMD` and `car attribute RUN -- CMD` are the counterfactual commands with a
trailing command (engine/commands/counterfactual.py): the run's scenario re-runs it
(engine.program.scenario).
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator
from types import FrameType
from typing import Annotated, Any

import typer

from engine.commands.common import JsonOpt, emit_json, err, fail, open_journal, out

CommandArg = Annotated[
    list[str] | None,
    typer.Argument(
        help="The program to run, after `--` (e.g. -- python agents.py).", metavar="-- CMD"
    ),
]
MatchOpt = Annotated[
    str,
    typer.Option(
        "--match",
        help="exact: every request field must equal the recorded one; messages: the messages "
        "only; position: the n-th call of each agent gets its n-th answer, unchecked.",
    ),
]


@contextlib.contextmanager
def _terminations() -> Iterator[None]:
    """SIGTERM and SIGHUP (the terminal closed) end a recording or a replay like Ctrl-C: the
    program is stopped and the run closed as stopped, never left open. The program runs in a
    session of its own (engine.program.session.run_command), so no signal of the terminal's
    reaches it but through car."""

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, on_term) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _interrupted(what: str) -> None:
    from engine.workers import hard_exit

    hard_exit(f"interrupted: {what}")


def _match(value: str) -> Any:
    from engine.errors import ConfigError
    from engine.program.matching import MatchMode

    try:
        return MatchMode.parse(value)
    except ConfigError as e:
        raise typer.BadParameter(str(e), param_hint="'--match'") from e


def record_cmd(
    command: CommandArg = None,
    base_url: Annotated[
        str | None,
        typer.Option(
            "--base-url", help="Upstream OpenAI-compatible server (default: $OPENAI_BASE_URL)."
        ),
    ] = None,
    name: Annotated[str, typer.Option("--name", help="A label for the run.")] = "",
    outcome: Annotated[
        str | None,
        typer.Option("--outcome", help="Shell command judging the run after it: exit 0 = good."),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Root seed of injected per-call seeds.")] = 0,
    timeout: Annotated[
        float,
        typer.Option(
            "--timeout",
            min=0.1,
            max=86400.0,
            help="The most one upstream call may take in seconds, its whole reply or stream.",
        ),
    ] = 600.0,
    max_reply_bytes: Annotated[
        int,
        typer.Option(
            "--max-reply-bytes",
            min=1024,
            max=64 * 1024 * 1024,
            help="Largest upstream reply in bytes, also after gzip (a stream: its text in UTF-8).",
        ),
    ] = 256 * 1024,
    as_json: JsonOpt = False,
) -> None:
    """Run a program with its OpenAI calls recorded through a local proxy, as one run.

    The program gets OPENAI_BASE_URL pointing at the proxy (and OPENAI_API_KEY if unset);
    each chat completion is forwarded to the upstream and journaled. Agents are named by
    the X-Car-Agent header, the request's `user` field, or the system prompt. Exits with
    the program's exit status (128+N when signal N killed it); 1 when the run failed (an
    upstream or journal fault), 130 when interrupted."""
    from engine.program.session import record, resolve_upstream

    cmd = list(command or [])
    url = resolve_upstream(base_url)
    with open_journal() as j, _terminations():
        try:
            run = record(
                j,
                cmd,
                upstream=url,
                name=name,
                outcome=outcome,
                seed=seed,
                timeout=timeout,
                max_reply_bytes=max_reply_bytes,
                stdout=sys.stderr if as_json else None,
            )
        except KeyboardInterrupt:
            _interrupted("the program was stopped; run closed as stopped")
            return
    if as_json:
        emit_json({"run_id": run.run_id, "status": run.status, "error": run.error, **run.outcome()})
    else:
        verdict = "bad" if run.bad else "good" if run.bad is not None else "none"
        out.print(
            f"recorded run [bold]{run.run_id}[/]: {run.calls} calls, status {run.status}, "
            f"outcome {verdict} (exit {run.exit_status}"
            + (f", outcome command {run.outcome_status}" if run.outcome_status is not None else "")
            + ")",
            highlight=False,
        )
    if run.status == "failed":
        fail(f"{run.error} (run {run.run_id} closed as failed)")
    if run.exit_status:
        why = (
            f"; the upstream answered {', '.join(run.upstream_errors)}"
            if run.upstream_errors
            else ""
        )
        err.print(
            f"error: the program {_ended_how(run.exit_status)}{why} (run {run.run_id} "
            "closed, outcome bad)",
            highlight=False,
            markup=False,
        )
        raise SystemExit(_exit_code(run.exit_status))


def _ended_how(status: int) -> str:
    """How a program that failed ended, as a user reads it (a negative status is Python's
    way of saying it was killed by that signal)."""
    if status >= 0:
        return f"exited with status {status}"
    try:
        name = f" ({signal.Signals(-status).name})"
    except ValueError:
        name = ""
    return f"was killed by signal {-status}{name}"


def _exit_code(status: int) -> int:
    """car's exit status for a program that failed: the program's own, or 128+N when signal N
    killed it (as a shell reports it), so `car record -- CMD` exits as CMD would have."""
    return status if status > 0 else 128 + min(-status, 127)


def replay_cmd(
    run_id: Annotated[str, typer.Argument(help="A recorded program run (id or prefix).")],
    command: CommandArg = None,
    match: MatchOpt = "exact",
    outcome: Annotated[
        str | None,
        typer.Option("--outcome", help="Outcome command (default: the recorded one)."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Re-run a recorded program with every call answered from the journal: its fidelity.

    Each request is matched against the recorded one (--match); a miss stops the program
    with a diagnosis: the first differing field and the nearest recorded call. Exits 1 on
    a miss or when the behaviour diverged."""
    from engine.program.session import replay

    mode = _match(match)
    with open_journal(create=False) as j, _terminations():
        try:
            report = replay(
                j,
                run_id,
                list(command or []),
                match=mode,
                outcome=outcome,
                stdout=sys.stderr if as_json else None,
            )
        except KeyboardInterrupt:
            _interrupted("replay stopped")
            return
    if as_json:
        emit_json(report.to_dict())
    else:
        _print_replay(report)
    if report.error:
        fail(report.error)
    # no fidelity: neither the recording nor the replay made a call - nothing diverged
    if report.fidelity not in (1.0, None) or not report.outcome_match:
        fail(
            f"the replay diverged: fidelity {_pct(report.fidelity)}"
            + ("" if report.outcome_match else ", outcome differs")
        )


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _print_replay(r: Any) -> None:
    from rich.table import Table

    from engine.terminal import in_markup

    out.print(
        f"[bold]fidelity of run {r.run_id}[/] (program, match {r.match}): request-match rate "
        f"[bold]{_pct(r.request_match_rate)}[/] (exact {_pct(r.exact_match_rate)}) over "
        f"{r.replayed_calls} of {r.recorded_calls} recorded calls",
        highlight=False,
    )
    t = Table(box=None, header_style="bold")
    for col in ("agent", "calls", "exact", "normalised"):
        t.add_column(col)
    for agent, a in r.per_agent.items():
        t.add_row(
            in_markup(agent, name=True),  # a program names its agents: data, never markup
            f"{a['replayed']}/{a['recorded']}",
            _pct(a["exact_match_rate"]),
            _pct(a["request_match_rate"]),
        )
    out.print(t)
    for d in r.divergences[:20]:
        if d["step"] is None:
            what = (
                f"{in_markup(d['agent'], name=True)} call {d['ordinal']}: no recorded counterpart"
            )
        else:
            what = (
                f"step {d['step']} ({in_markup(d['agent'], name=True)} call {d['ordinal']}):"
                f" {in_markup(d['field'])} differs"
            )
        out.print(f"[yellow]{what}[/]", highlight=False)
    if r.unrequested:
        out.print(f"recorded calls never requested: steps {', '.join(map(str, r.unrequested))}")
    rec, rep = r.outcome_recorded, r.outcome_replayed
    out.print(
        f"outcome: recorded {_verdict(rec)} (exit {rec['exit_status']}), replayed "
        f"{_verdict(rep)} (exit {rep['exit_status']}): "
        + ("[green]same[/]" if r.outcome_match else "[red]differs[/]"),
        highlight=False,
    )


def _verdict(o: dict[str, Any]) -> str:
    return "bad" if o.get("bad") else "good" if o.get("bad") is not None else "none"


def register(app: typer.Typer) -> None:
    """Add `record` and `replay` to `app`."""
    app.command("record")(record_cmd)
    app.command("replay")(replay_cmd)
