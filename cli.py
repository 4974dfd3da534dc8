"""`car`: the command line of Causal Agent Replay. It parses and prints; the engine decides."""

# ruff: noqa: E402  (the SIGINT handler below must be installed before the slow imports)
from __future__ import annotations

import _signal  # the C module: importing `signal` itself takes a while (it builds enums)
import contextlib
import os


def _interrupted_while_starting(*_: object) -> None:
    # Ctrl-C while the imports below run (the first ~0.3 s): nothing is open yet, so leave
    # at once with one line instead of a KeyboardInterrupt traceback from inside a library
    os.write(2, b"interrupted\n")
    os._exit(130)


_signal.signal(_signal.SIGINT, _interrupted_while_starting)
import signal
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from engine import projections as views
from engine.commands import coerce, lazy
from engine.commands.common import (
    EXIT_PIPE_CLOSED,
    JsonOpt,
    emit_json,
    fail,
    journal_target,
    open_journal,
    options,
    out,
)
from engine.errors import ConfigError, EngineError, interrupt_behind
from engine.terminal import in_markup, printable, shown_name

# plain values (str, int, float) are converted without importing pydantic (~0.15 s)
coerce.install()

app = typer.Typer(
    # the commands of engine/commands are imported and built only when they run (lazy.py)
    cls=lazy.LazyGroup,
    # plain click help: rich help shows every flag as `<bool>` and wraps it at 80 columns
    rich_markup_mode=None,
    help="Causal Agent Replay: record multi-agent runs, replay and fork them, find the step "
    "that caused a failure and the agent that sabotaged it.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _print_version(value: bool) -> None:
    if value:
        from engine.version import engine_version

        out.print(f"car {engine_version()}", highlight=False)
        raise typer.Exit()


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
    log_level: Annotated[
        str,
        typer.Option(
            "--log-level",
            envvar="CAR_LOG_LEVEL",
            help="Engine log level on stderr (DEBUG, INFO, WARNING, ERROR, CRITICAL).",
        ),
    ] = "CRITICAL",
    version: Annotated[
        bool,
        typer.Option(
            "--version", is_eager=True, callback=_print_version, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    options.journal_target = journal
    from engine.logging import set_level

    # the CLI's own output is the interface; engine logs are for debugging (CAR_LOG_LEVEL=INFO)
    set_level(log_level)


# ----------------------------------------------------------------- show


@app.command("show")
def show_cmd(
    run_id: Annotated[str, typer.Argument(help="Run id or unique prefix.")],
    reveal: Annotated[
        bool, typer.Option("--reveal", help="Also show secret events (the mole) and seeds.")
    ] = False,
    depth: Annotated[
        int, typer.Option("--depth", min=0, help="Levels of the branch tree to print (0: none).")
    ] = 2,
    limit: Annotated[
        int, typer.Option("--limit", min=1, help="Branches to print under each run at most.")
    ] = 20,
    as_json: JsonOpt = False,
) -> None:
    """Show a run: its header, transcript, outcome and branch tree."""
    with open_journal(create=False, readonly=True) as j:
        data = views.show_run(j, run_id, reveal=reveal)
    if as_json:
        emit_json(data)
        return
    h = data["run"]
    out.print(
        f"[bold]run {h['run_id']}[/]  scenario={in_markup(h['scenario'])}  "
        f"status={data['status']}  steps={data['steps']}",
        highlight=False,
    )
    if h["parent_run_id"]:
        out.print(f"forked from {h['parent_run_id']} at step {data['fork_step']}", highlight=False)
    start = data.get("started") or {}
    if start:
        seed = f"  seed={start['root_seed']}" if "root_seed" in start else ""
        out.print(
            f"policy={in_markup(start.get('policy'))}{seed}  "
            f"agents={', '.join(in_markup(a, name=True) for a in start.get('agents', []))}",
            highlight=False,
        )
    for line in data["lines"]:
        out.print(printable(line, keep_newlines=True), highlight=False, markup=False)
    if data.get("outcome"):
        o = data["outcome"]
        out.print(
            f"[bold]outcome[/]: {'BAD' if o.get('bad') else 'OK'} score={o.get('score', 0):.3f}",
            highlight=False,
        )
        for reason in o.get("reasons", []):
            out.print(f"  - {printable(str(reason))}", highlight=False, markup=False)
    if data.get("error"):
        # why it failed or stopped: a model server's words only with --reveal (public_error)
        out.print(f"{data['status']}: {printable(data['error'])}", highlight=False, markup=False)
    tree_data = data["branches"]
    if tree_data["children"] and depth > 0:
        from rich.tree import Tree  # ~40 ms at import: only when a tree is printed

        tree = Tree(f"[bold]{tree_data['run_id']}[/]")
        _add_branches(tree, tree_data["children"], depth, limit)
        out.print(tree)


def _add_branches(node: Any, children: list[dict[str, Any]], depth: int, limit: int) -> None:
    """Print `limit` branches a level and `depth` levels; say how many were left out."""
    for c in children[:limit]:
        end = c.get("verdict") or c.get("ended") or ""
        label = f"{c['run_id']} @step {c['fork_step']} {c.get('op') or ''} {end}"
        child = node.add(label.strip())
        if depth > 1:
            _add_branches(child, c["children"], depth - 1, limit)
        elif c["children"]:
            child.add(f"[dim]{_count(c['children'])} more below (--depth)[/]")
    if len(children) > limit:
        node.add(f"[dim]… {len(children) - limit} more branches (--limit, or --json for all)[/]")


def _count(children: list[dict[str, Any]]) -> int:
    return sum(1 + _count(c["children"]) for c in children)


@app.command("state")
def state_cmd(
    run_id: Annotated[str, typer.Argument(help="Run id or unique prefix.")],
    at: Annotated[int, typer.Option("--at", "-k", help="Step k: the state before step k.")],
    reveal: Annotated[
        bool, typer.Option("--reveal", help="The full fold: seeds and the mole's secret context.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Reconstruct s_k (the state before step k) from the journal (public unless --reveal)."""
    with open_journal(create=False, readonly=True) as j:
        data = views.state_view(j, run_id, at, reveal=reveal)
    if as_json:
        emit_json(data)
        return
    if not reveal:
        _print_public_state(at, data)
        return
    out.print(
        f"[bold]s_{at}[/] of run {data['run_id']}: {data['seq']} events folded, {_turn(data)}",
        highlight=False,
    )
    seeds = ", ".join(f"step {k}: {seed}" for k, seed in data["seeds"])
    out.print(f"seeds in window: {seeds or 'none'}", highlight=False)
    out.print("[bold]conversation (window)[/]")
    for m in data["transcript"]:
        line = f"  [{m['step']}] {shown_name(m['agent'])}: {m['text']}"
        out.print(printable(line, keep_newlines=True), highlight=False, markup=False)
    out.print("[bold]private contexts[/]")
    for agent, ctx in data["contexts"].items():
        out.print(
            f"  {shown_name(agent)}: turns={ctx['turns']} observations={len(ctx['observations'])}"
            + (f" secret={ctx['secret']!r}" if ctx.get("secret") else ""),
            highlight=False,
            markup=False,
        )


def _turn(data: dict[str, Any]) -> str:
    """Whose turn it is at a shown state, or that the run has none left (markup)."""
    if data["acting_agent"] is None:
        return f"no next agent, status {data['status']}"
    return (
        f"next agent {in_markup(data['acting_agent'], name=True)} (round {data['round']}), "
        f"status {data['status']}"
    )


def _print_public_state(at: int, data: dict[str, Any]) -> None:
    out.print(f"[bold]s_{at}[/] of run {data['run_id']}: {_turn(data)}", highlight=False)
    out.print("[bold]conversation (window)[/]")
    for m in data["transcript"]:
        line = f"  [{m['step']}] {shown_name(m['agent'])}: {m['text']}"
        out.print(printable(line, keep_newlines=True), highlight=False, markup=False)
    out.print("[bold]agents[/] (config order; seeds and secrets only with --reveal)")
    for a in data["per_agent"]:
        failed = sum(1 for t in a["tool_usage"] if not t["success"])
        out.print(
            f"  {shown_name(a['agent'])}: turns={a['turns']} tool results={len(a['tool_usage'])} "
            f"failed={failed}",
            highlight=False,
            markup=False,
        )


# ----------------------------------------------------------------- heist


def _policy_from_options(
    policy: str, base_url: str | None, model: str | None, generation: dict[str, Any]
) -> Any:
    from engine.policies.registry import make_policy

    spec: dict[str, Any] = {"name": policy}
    given = {k: v for k, v in generation.items() if v is not None}
    if policy == "openai":
        spec["base_url"] = base_url or "http://localhost:1234/v1"
        spec["model"] = model or "local-model"
        spec.update(given)
        try:
            return make_policy(spec)
        except ConfigError as e:  # a flag's value out of range (--timeout nan, ...)
            raise typer.BadParameter(str(e)) from e
    elif base_url or model or given:
        raise typer.BadParameter(
            "--base-url, --model, --max-tokens, --temperature, --timeout and --max-reply-bytes "
            "apply to --policy openai only"
        )
    return make_policy(spec)


def _print_step(k: int, agent: str, events: list[Any]) -> None:
    """Stream one step: the agent's message, then what its tool calls returned. Text from a
    model or a tool is data: never markup, never terminal control."""
    from rich.text import Text

    from engine import events as ev
    from engine.terminal import printable

    for e in events:
        if isinstance(e, ev.ChatMessage):
            line = Text(f"[{k:>2}] {printable(agent)}", style="bold cyan")
            line.append(": " + printable(e.text, keep_newlines=True))
            out.print(line, highlight=False)
    for e in events:
        if isinstance(e, ev.ToolResult):
            shown = e.output if e.ok else f"FAILED: {e.error}"
            tool = f"{printable(e.tool)}({views._clip(printable(e.param), 50)})"
            out.print(
                Text(f"      -> {tool}: {views._clip(printable(shown), 90)}", style="dim"),
                highlight=False,
            )


#: Seconds an interrupted command may take to close what it has open before the process
#: ends without waiting any longer (a journal call the server does not answer: a lock held by
#: another session, a server that stopped responding).
WIND_DOWN = 3.0


def _interrupted(line: str = "interrupted") -> None:
    """Exit 130 with one line once everything is closed. The interpreter's own teardown of
    the loaded libraries is skipped: under load it alone takes a second or more, and a user
    who pressed Ctrl-C waits for it. Through `hard_exit`, so that a wind-down deadline firing
    at the same moment cannot add a second line."""
    try:
        from engine.workers import hard_exit
    except ImportError:
        # a signal handler's call while engine.workers itself is being imported (its module
        # is there, half made): nothing else can be writing a line yet
        os.write(2, (line + "\n").encode())
        os._exit(130)
    hard_exit(line)


def _exit_after(seconds: float) -> None:
    """End the process with `interrupted` if it is still running `seconds` from now. Called
    from a signal handler, which may run while any module is half imported: what the timer
    needs is imported when it fires."""
    import threading

    timer = threading.Timer(seconds, _interrupted)
    timer.daemon = True
    timer.start()


@app.command("heist")
def heist_cmd(
    config: Annotated[
        Path | None, typer.Option("--config", help="Crew YAML (default: the six built-in agents).")
    ] = None,
    rounds: Annotated[int, typer.Option("--rounds", min=1, help="Turns per agent.")] = 4,
    seed: Annotated[
        int | None,
        typer.Option(
            "--seed",
            min=0,
            max=2**63 - 1,
            help="Root seed (default: 63 random bits, recorded, secret). It draws the world and"
            " the mole: whoever knows or guesses it can replay the draw.",
        ),
    ] = None,
    policy: Annotated[
        str, typer.Option("--policy", help="sim (embedded, no server) | sim-honest | openai.")
    ] = "sim",
    base_url: Annotated[
        str | None, typer.Option("--base-url", help="OpenAI-compatible server URL.")
    ] = None,
    model: Annotated[
        str | None, typer.Option("--model", help="Model name for --policy openai.")
    ] = None,
    max_tokens: Annotated[
        int | None, typer.Option("--max-tokens", min=1, help="openai: tokens per reply (160).")
    ] = None,
    temperature: Annotated[
        float | None, typer.Option("--temperature", min=0.0, help="openai: sampling (0.8).")
    ] = None,
    timeout: Annotated[
        float | None,
        typer.Option(
            "--timeout",
            help="openai: the most one model call may take in seconds, retries included (60).",
        ),
    ] = None,
    max_reply_bytes: Annotated[
        int | None,
        typer.Option(
            "--max-reply-bytes", help="openai: largest reply accepted, also after gzip (262144)."
        ),
    ] = None,
    mole: Annotated[str | None, typer.Option("--mole", help="Make this agent the mole.")] = None,
    strategy: Annotated[
        str | None, typer.Option("--strategy", help="Mole strategy, e.g. FALSE_INFO.")
    ] = None,
    no_mole: Annotated[bool, typer.Option("--no-mole", help="Play without a mole.")] = False,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Do not stream the transcript.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Record one heist: six agents plan, one is secretly the mole; ends with the outcome."""
    if no_mole and (mole is not None or strategy is not None):
        raise typer.BadParameter(
            "--no-mole cannot be combined with --mole or --strategy", param_hint="'--no-mole'"
        )
    import signal

    # Ctrl-C stops the run where its last whole step ended (an LLM call in flight is
    # aborted), journals the stop and exits 130. Until the run can be stopped that way -
    # while importing, or while a brand-new journal file is being created - nothing of value
    # is open, so Ctrl-C leaves at once (a new journal's creation is one transaction that a
    # kill rolls back).
    interrupts: list[str] = []
    pol: Any = None
    control: Any = None
    leave_at_once = True

    def on_sigint(*_: object) -> None:
        if leave_at_once:
            os.write(2, b"interrupted\n")
            os._exit(130)
        if interrupts:  # pressed again: the user will not wait for the wind-down
            _interrupted()
        interrupts.append("interrupted")
        # the stop takes effect at the next step; a step stuck in a journal call the server
        # does not answer would otherwise hold the exit for as long as the server does
        _exit_after(WIND_DOWN)
        if control is not None:
            control.request("stop", "interrupted")
        cancel = getattr(pol, "cancel", None)
        if callable(cancel):
            cancel()

    # SIGTERM (a supervisor) and SIGHUP (the terminal closed) end a heist as Ctrl-C does: the
    # run closed as stopped, rather than left to be found abandoned
    stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, on_sigint) for s in stops}
    try:
        import importlib

        # opening a journal needs alembic (~0.5 s to import): imported while Ctrl-C still
        # leaves at once, so that the open itself is short
        for module in ("alembic.command", "alembic.config", "alembic.runtime.migration",
                       "alembic.script"):  # fmt: skip
            importlib.import_module(module)
        from engine.heist.config import load_agents_config
        from engine.heist.mole import parse_strategy
        from engine.heist.session import record_heist
        from engine.runtime.control import ControlChannel
        from engine.runtime.seeds import fresh_seed

        crew = load_agents_config(config)  # a bad file is a bad file (exit 1), not a bad flag
        if mole is not None and mole not in crew.names:
            raise typer.BadParameter(
                f"unknown agent {mole!r}; agents are: {', '.join(crew.names)}",
                param_hint="'--mole'",
            )
        if strategy is not None:
            try:
                parse_strategy(strategy)
            except ConfigError as e:
                raise typer.BadParameter(str(e), param_hint="'--strategy'") from e

        control = ControlChannel()
        pol = _policy_from_options(
            policy,
            base_url,
            model,
            {
                "max_tokens": max_tokens,
                "temperature": temperature,
                "timeout": timeout,
                "max_reply_bytes": max_reply_bytes,
            },
        )
        root_seed = seed if seed is not None else fresh_seed()
        stream = None if (quiet or as_json) else _print_step
        target = journal_target()
        # opening an existing journal may upgrade it: that is not cut short
        leave_at_once = "://" not in target and not os.path.exists(Path(target).expanduser())
        with open_journal() as j:
            leave_at_once = False
            if interrupts:  # before the run exists: nothing to close
                _interrupted()
            result = record_heist(
                j,
                pol,
                seed=root_seed,
                rounds=rounds,
                config=crew,
                mole=mole,
                strategy=strategy,
                no_mole=no_mole,
                control=control,
                on_step=stream,
                server=base_url if policy == "openai" else None,
            )
            agents = list(j.events(result.run_id, 1)[0].agents)  # type: ignore[union-attr]
        from engine.public import public_error
        from engine.terminal import printable

        outcome = result.outcome
        data = {
            "run_id": result.run_id,
            "agents": agents,
            "steps": result.steps,
            # a drawn seed stays in the journal: the mole is drawn from it, so replaying it
            # elsewhere would name the mole (`car show RUN --reveal` shows it)
            "seed": seed,
            "policy": policy,
            "status": result.status,
            "outcome": {
                "bad": outcome.get("bad"),
                "score": outcome.get("score"),
                "reasons": outcome.get("reasons", []),
                "plan": outcome.get("plan", {}),
            },
            # a model server's words may count the mole's longer prompt: --reveal shows them
            "error": public_error(result.error),
        }
        if as_json:
            emit_json(data)
        else:
            given = "" if seed is None else f", seed {seed}"
            out.print(
                f"\n[bold]run {result.run_id}[/] ({result.status}, {result.steps} steps{given})",
                highlight=False,
            )
            if result.status == "completed":
                verdict = (
                    "[red]BAD: the plan would fail[/]" if outcome.get("bad") else "[green]OK[/]"
                )
                out.print(
                    f"outcome: {verdict}  score={outcome.get('score', 0):.3f}", highlight=False
                )
                for r in outcome.get("reasons", []):
                    out.print(f"  - {printable(str(r))}", highlight=False, markup=False)
                out.print(
                    f"next: car accuse {result.run_id} AGENT   |   car fidelity {result.run_id}",
                    highlight=False,
                )
        if result.status == "failed":
            fail(
                f"run {result.run_id} failed and was closed in the journal:"
                f" {public_error(result.error)}"
            )
        if result.status == "stopped":
            _interrupted(f"stopped: run {result.run_id} was closed after {result.steps} steps")
        if interrupts:
            _interrupted(f"interrupted: run {result.run_id} had already {result.status}")
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


# the command groups of engine/commands are listed in engine/commands/lazy.py (COMMANDS) and
# imported only when one of their commands runs; the commands above are built when they run
lazy.defer(app)


def _output_closed() -> bool:
    """Whether the CLI framework met a closed pipe on stdout (it then wraps the streams so that
    the final flush is quiet, and exits 1)."""
    return type(sys.stdout).__name__ == "PacifyFlushWrapper"


def leave(code: int) -> None:
    """End a command that ran to its end: its output flushed and the exit hooks run, then out
    at once, without the interpreter's teardown (freeing every module and object: 6-48 ms of
    a short command, and serial time in a parallel one; docs/decisions.md, 45). Daemon
    threads (a lease's heartbeat) end with the process either way; with a non-daemon thread
    alive, the normal exit, which waits for it."""
    # the command is over: a Ctrl-C now must not break into the exit hooks (main's `finally`
    # ignores it from here on, the exit status stays the command's)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as before the command: it ends the process
    import threading

    main = threading.main_thread()
    if any(t is not main and not t.daemon for t in threading.enumerate()):
        sys.exit(code)
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if stream is None:  # started with it closed (`2>&-`): nothing to flush
            continue
        try:
            stream.flush()
        except OSError as e:
            if _cannot_write(e):  # a full disk, not a reader gone: an error, said
                _say_cannot_write(e)
                code = code or 1
            else:  # a closed pipe (`car runs | head`)
                code = code or EXIT_PIPE_CLOSED
        except ValueError:  # a closed stream
            code = code or EXIT_PIPE_CLOSED
    os._exit(code)


def _cannot_write(e: BaseException) -> bool:
    """An output that cannot take more (a full disk, `/dev/full`, an I/O error): not a closed
    pipe, whose reader went away on purpose."""
    import errno

    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO)


def _say_cannot_write(e: BaseException) -> None:
    with contextlib.suppress(Exception):
        if sys.stderr is not None:
            sys.stderr.write(f"error: cannot write output: {getattr(e, 'strerror', e)}\n")
            sys.stderr.flush()


_interrupts_seen = 0


def _keyboard_interrupt(signum: int, frame: object) -> None:
    """SIGINT/SIGTERM of a command without handlers of its own: a KeyboardInterrupt, as
    `signal.default_int_handler` raises, with a deadline for the wind-down it starts; a
    second signal ends the process at once."""
    global _interrupts_seen
    _interrupts_seen += 1
    if _interrupts_seen > 1:
        _interrupted()
    _exit_after(WIND_DOWN)
    raise KeyboardInterrupt


def main() -> None:
    """Entry point: engine errors and usage errors become one clean line and a non-zero exit."""
    try:
        try:  # typer vendors click in recent releases; older ones use click itself
            from typer._click import exceptions as click_exc
        except ImportError:  # pragma: no cover
            from click import exceptions as click_exc  # type: ignore[no-redef]

        def hard_exit(message: str) -> None:
            # engine.workers brings multiprocessing (~40 ms): imported only on an interrupt
            from engine.workers import hard_exit as exit_now

            exit_now(message)

        # from here on Ctrl-C is a KeyboardInterrupt that the handlers below turn into one line
        # (also while the command's own module is imported, which happens inside app());
        # one that comes out inside a driver call which then waits on for the server (psycopg
        # finishing a pipeline) must not hold the exit: a deadline, and a second one ends it
        signal.signal(signal.SIGINT, _keyboard_interrupt)
        # SIGTERM (a supervisor, `kill PID`) ends every command as Ctrl-C does: one line and
        # exit 130 (it ended `car detect` or `car import` silently, by the signal); the
        # commands that record or fork install their own handlers for both
        signal.signal(signal.SIGTERM, _keyboard_interrupt)

        try:
            rv = app(standalone_mode=False)
        except click_exc.NoArgsIsHelpError as e:
            if e.ctx is not None:
                out.print(e.ctx.get_help(), highlight=False, markup=False)
            sys.exit(0)
        except click_exc.UsageError as e:
            hint = f" (see `{e.ctx.command_path} --help`)" if e.ctx is not None else ""
            fail(e.format_message() + hint, code=2)
        except click_exc.ClickException as e:
            fail(e.format_message())
        except SystemExit as e:
            if e.code == EXIT_PIPE_CLOSED or _output_closed():
                leave(EXIT_PIPE_CLOSED)
            raise
        except typer.Abort:
            hard_exit("interrupted")
        except EngineError as e:
            # a Ctrl-C inside a driver call can come out as the journal's error about it
            # ("append ... failed: cannot exit pipeline mode while busy"): still a Ctrl-C
            ki = interrupt_behind(e)
            if ki is not None:
                hard_exit(getattr(ki, "message", "interrupted"))
            fail(str(e))
        except (KeyboardInterrupt, Exception) as e:
            # a Ctrl-C, also one that came out as another error (inside an import, say)
            ki = interrupt_behind(e)
            if ki is None:
                if _cannot_write(e):
                    # stdout on a full disk or a broken device (`> /dev/full`): said once
                    _say_cannot_write(e)
                    os._exit(1)
                raise
            # no atexit hooks: they would wait for threads stuck in a network call
            hard_exit(getattr(ki, "message", "interrupted"))
        if rv == 130:  # the CLI framework's answer to a KeyboardInterrupt: say so
            hard_exit("interrupted")
        leave(rv if isinstance(rv, int) else 0)
    finally:
        # the command is over (its output written, its journal committed) and the interpreter
        # shuts down, putting back the default SIGINT handler: a Ctrl-C then would end the
        # process by the signal, with no line. Ignored, the exit status stays the command's.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


if __name__ == "__main__":
    main()
