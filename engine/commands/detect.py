"""`car detect` and `car detect-eval`: which agent sabotaged a run, and how often that is right."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.text import Text

from engine.commands.common import (
    JsonOpt,
    emit_json,
    fail,
    open_journal,
    options,
    out,
    progress,
)
from engine.commands.executor_opts import ExecutorOpt, RayAddressOpt, WorkersOpt, executor_options
from engine.executors.base import ExecutorOptions
from engine.terminal import in_markup, printable, shown_name

METHOD_HELP = "rules | llm | rules+llm | causal | replay"
EVAL_JOURNAL = "recordings/detect-eval.db"


def _detect_options(
    seed: int | None, k_max: int | None, fixed: bool, timeout: float | None
) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    if seed is not None:
        opts["seed"] = seed
    if k_max is not None:
        opts["k_max"] = k_max
    if fixed:
        opts["sequential"] = False
    if timeout is not None:
        opts["timeout"] = timeout
    return opts


#: the widest an agent's name is shown in a table of `car detect`
AGENT_WIDTH = 40


def _f(x: float | None) -> str:
    return "" if x is None else f"{x:.3f}"


def _print_analysis(d: dict[str, Any]) -> None:
    calibrated = "" if d["confidence_calibrated"] else ", uncalibrated"
    out.print(
        f"[bold]run {in_markup(d['session_id'])}[/] ({d['method']}): suggested mole "
        # an agent's name is data (an imported trace names its agents): never markup
        f"[bold]{in_markup(d['suggested_mole'], name=True)}[/] (confidence {d['confidence']:.2f}"
        f"{calibrated})",
        highlight=False,
    )
    t = _table(box=None, header_style="bold")
    method = d["method"]
    signals = method not in ("causal", "replay")  # their score is not the rules' (--json has it)
    cols = ["agent", "tool", "timing", "message", "info"] if signals else ["agent"]
    if "llm" in d["methods_run"]:
        cols.append("llm")
    if method == "causal":
        cols += ["runs", "P(bad | replaced)", "95% CI"]
    if method == "replay":
        cols += ["steps", "match rate", "95% CI"]
    cols.append("score")
    # an agent's name may be any length (an imported trace names its agents): it is cut
    # (--json has it whole), never the scores beside it
    t.add_column(cols[0], no_wrap=True, overflow="ellipsis", max_width=AGENT_WIDTH)
    for c in cols[1:]:
        t.add_column(c, no_wrap=True)
    for agent in d["ranking"]:
        b = d["score_breakdown"][agent]
        row: list[str | Text] = [Text(shown_name(agent))]
        if signals:
            row += [
                _f(b["tool_usage"]),
                _f(b["timing"]),
                _f(b["message_anomaly"]),
                _f(b["information_quality"]),
            ]
        if "llm" in d["methods_run"]:
            row.append(_f(b["llm"]))
        if method == "causal":
            c = d["causal"][agent]
            row += [str(c["runs"]), _f(c["p_bad_replaced"]), _ci(c["p_bad_ci"])]
        if method == "replay":
            r = d["replay"][agent]
            row += [str(r["steps"]), _f(r["match_rate"]), _ci(r["match_rate_ci"])]
        row.append(_f(b["combined"]))
        t.add_row(*row)
    out.print(t)
    line = f"methods run: {', '.join(d['methods_run'])}"
    if "forward_runs" in d:
        line += f"; forward runs: {d['forward_runs']}"
    if method == "causal":
        line += "; separated" if d["separated"] else "; not separated"
    out.print(line, highlight=False)
    for w in d["warnings"]:
        # a warning may quote the model's answer: data, never markup or terminal control
        out.print(Text.assemble(("warning", "yellow"), ": " + printable(w)), highlight=False)


def _ci(ci: list[float]) -> str:
    return f"[{ci[0]:.3f}, {ci[1]:.3f}]"


def _print_eval(report: dict[str, Any]) -> None:
    out.print(
        f"[bold]detect-eval[/]: {report['games']} games"
        + (
            f" ({len(report['skipped_without_mole'])} without a mole skipped)"
            if report["skipped_without_mole"]
            else ""
        ),
        highlight=False,
    )
    for f in report.get("failed_games", []):
        out.print(f"[yellow]game not recorded[/]: {f}", highlight=False)
    for method, m in report["methods"].items():
        out.print(
            f"\n[bold]{method}[/]: top-1 {m['hits']}/{m['n']} = {_f(m['accuracy'])} "
            f"95% CI {_ci(m['ci95'])} vs random {_f(m['random_baseline'])}; "
            f"AUROC {_f(m['auroc'])}; Brier {_f(m['brier'])}"
            + ("" if m["calibrated"] else " (confidence uncalibrated)")
            + f"; {m['forward_runs_per_game']} forward runs and "
            f"{m['seconds_per_game']:.3f} s per game"
            + (f"; LLM unusable in {m['degraded']} games" if m["degraded"] else ""),
            highlight=False,
        )
        t = _table(box=None, header_style="bold")
        for c in ("strategy", "games", "top-1", "95% CI", "AUROC"):
            t.add_column(c, no_wrap=True)
        for s, r in m["per_strategy"].items():
            t.add_row(s, str(r["n"]), _f(r["accuracy"]), _ci(r["ci95"]), _f(r["auroc"]))
        out.print(t)
        t = _table(box=None, header_style="bold", title="reliability of confidence")
        for c in ("confidence", "games", "mean conf.", "hit rate"):
            t.add_column(c, no_wrap=True)
        for r in m["reliability"]:
            t.add_row(r["bin"], str(r["games"]), _f(r["mean_confidence"]), _f(r["accuracy"]))
        out.print(t)
        agents = sorted({a for row in m["confusion"].values() for a in row} | set(m["confusion"]))
        t = _table(box=None, header_style="bold", title="confusion (true mole x suggested)")
        t.add_column("mole \\ suggested", no_wrap=True)
        for a in agents:
            t.add_column(a, no_wrap=True)
        for mole in agents:
            row = m["confusion"].get(mole, {})
            if row:
                t.add_row(mole, *[str(row.get(a, 0)) for a in agents])
        out.print(t)


def register(app: typer.Typer) -> None:
    @app.command("detect")
    def detect_cmd(
        run_id: Annotated[str, typer.Argument(help="Run id or unique prefix (an ended heist).")],
        method: Annotated[str, typer.Option("--method", "-m", help=METHOD_HELP)] = "rules",
        base_url: Annotated[
            str | None,
            typer.Option("--base-url", help="llm: OpenAI-compatible server (LM Studio default)."),
        ] = None,
        model: Annotated[str | None, typer.Option("--model", help="llm: model name.")] = None,
        seed: Annotated[
            int | None,
            typer.Option(
                "--seed", min=0, max=2**63 - 1, help="llm: request seed; causal: branch seeds."
            ),
        ] = None,
        k_max: Annotated[
            int | None, typer.Option("--k-max", min=1, help="causal: runs per agent at most (20).")
        ] = None,
        fixed: Annotated[
            bool, typer.Option("--fixed", help="causal: run all --k-max per agent, no early stop.")
        ] = False,
        timeout: Annotated[
            float | None,
            typer.Option(
                "--timeout", min=0.1, max=24 * 3600.0, help="llm: seconds for the answer."
            ),
        ] = None,
        concurrency: Annotated[
            int, typer.Option("--concurrency", "-c", min=1, help="causal: forward runs at once.")
        ] = 1,
        executor: ExecutorOpt = "local",
        ray_address: RayAddressOpt = None,
        workers: WorkersOpt = None,
        reveal: Annotated[
            bool,
            typer.Option(
                "--reveal",
                help="replay: read the recorded step seeds, as secret as the mole (without it"
                " replay runs only on an accused run).",
            ),
        ] = False,
        as_json: JsonOpt = False,
    ) -> None:
        """Which agent sabotaged the run? Reads the public view only (causal also re-executes
        the crew; replay re-decides each step with its recorded seed, so it needs an accused
        run or --reveal); `confidence` is a calibrated probability."""
        from engine.detect import analyze

        where = executor_options(executor, ray_address, workers)
        with open_journal(create=False) as j, progress() as bar:
            task = bar.add_task(f"detect ({method})", total=None)
            opts = _detect_options(seed, k_max, fixed, timeout)
            if method == "causal":
                opts.update(concurrency=concurrency, executor=where)
            if method in ("causal", "replay"):
                opts["progress"] = lambda done, total: bar.update(task, completed=done, total=total)
            data = analyze(
                j, run_id, method=method, base_url=base_url, model=model, reveal=reveal, **opts
            )
        if as_json:
            emit_json(data)
            return
        _print_analysis(data)

    @app.command("detect-eval")
    def detect_eval_cmd(
        games: Annotated[
            int, typer.Option("--games", "-n", min=1, help="Heists to record and score.")
        ] = 20,
        seed: Annotated[
            int, typer.Option("--seed", min=0, max=2**63 - 1, help="Game i gets root seed S + i.")
        ] = 0,
        config: Annotated[
            Path | None, typer.Option("--config", help="Crew YAML (default: the built-in six).")
        ] = None,
        method: Annotated[
            list[str] | None,
            typer.Option("--method", "-m", help=f"{METHOD_HELP}; repeat for several (rules)."),
        ] = None,
        policy: Annotated[
            str, typer.Option("--policy", help="Policy that plays the games: sim | openai.")
        ] = "sim",
        base_url: Annotated[
            str | None, typer.Option("--base-url", help="OpenAI-compatible server URL.")
        ] = None,
        model: Annotated[str | None, typer.Option("--model", help="Model name.")] = None,
        rounds: Annotated[
            int | None, typer.Option("--rounds", min=1, help="Turns per agent (4).")
        ] = None,
        runs: Annotated[
            list[str] | None,
            typer.Option("--runs", help="Score these recorded runs instead (repeatable)."),
        ] = None,
        k_max: Annotated[
            int | None, typer.Option("--k-max", min=1, help="causal: runs per agent at most.")
        ] = None,
        concurrency: Annotated[
            int, typer.Option("--concurrency", "-c", min=1, help="causal: forward runs at once.")
        ] = 1,
        executor: ExecutorOpt = "local",
        ray_address: RayAddressOpt = None,
        workers: WorkersOpt = None,
        reveal: Annotated[
            bool,
            typer.Option(
                "--reveal",
                help="--runs: also score games nobody has accused yet (the report shows their "
                "moles).",
            ),
        ] = False,
        as_json: JsonOpt = False,
    ) -> None:
        """Accuracy of the detector over many games: top-1 with a 95% interval vs random,
        AUROC, calibration (Brier, reliability), confusion, cost. Records into --journal, or
        recordings/detect-eval.db when none is given. --runs scores recorded games that were
        accused or recorded by detect-eval (others with --reveal: the report shows moles)."""
        from engine.detect.evaluate import check_methods, evaluate, record_games
        from engine.journal import Journal
        from engine.policies.registry import make_policy

        # every check that can fail comes before the first game is recorded
        methods = check_methods(method or ["rules"])
        where = executor_options(executor, ray_address, workers)
        causal_opts: dict[str, Any] = {"k_max": k_max} if k_max else {}
        if "causal" in methods:
            causal_opts.update(concurrency=concurrency, executor=where)
        if policy not in ("sim", "openai"):
            fail(f"--policy must be sim or openai, got {policy!r}")
        spec: dict[str, Any] = {"name": policy}
        if policy == "openai":
            spec["base_url"] = base_url or "http://localhost:1234/v1"
            spec["model"] = model or "local-model"
        target = options.journal_target or EVAL_JOURNAL
        if where is not None and where.kind == "ray" and "causal" in methods:
            from engine.executors.base import RAY_NEEDS_A_SERVER
            from engine.journal import is_sqlite_target

            if is_sqlite_target(target):
                fail(RAY_NEEDS_A_SERVER)  # before the journal is opened: no file made for it
        if "://" not in target:
            Path(target).parent.mkdir(parents=True, exist_ok=True)
        failures: list[str] = []
        with Journal(target, create=not runs) as j, progress() as bar:
            run_ids = _given_runs(j, runs, reveal) if runs else []
            if where is not None and "causal" in methods:
                # one set of workers for every game, not one per game; made (and the journal
                # checked for it) before the first game is recorded
                from engine.executors.base import make_executor

                causal_opts["executor"] = make_executor(where, j, concurrency=concurrency)
            try:
                if not runs:
                    task = bar.add_task(f"recording {games} games", total=games)
                    run_ids = record_games(
                        j,
                        games,
                        seed=seed,
                        policy=make_policy(spec),
                        config_path=config,
                        rounds=rounds,
                        server=spec.get("base_url"),
                        progress=lambda d, t: bar.update(task, completed=d, total=t),
                        failures=failures,
                    )
                    bar.remove_task(task)
                    if not run_ids:
                        fail(f"no game completed; first failure: {failures[0]}")
                task = bar.add_task("detecting", total=len(run_ids) * len(methods))
                report = evaluate(
                    j,
                    run_ids,
                    methods,
                    base_url=base_url,
                    model=model,
                    options=causal_opts or None,
                    progress=lambda d, t: bar.update(task, completed=d, total=t),
                )
            finally:
                lent = causal_opts.get("executor")
                if lent is not None and not isinstance(lent, ExecutorOptions):
                    lent.close()
        from engine.journal import redacted_url

        report["journal"] = redacted_url(target)  # never the password of a server URL
        report["failed_games"] = failures
        report["seed"] = seed if not runs else None
        if as_json:
            emit_json(report)
            return
        _print_eval(report)


def _given_runs(journal: Any, runs: list[str], reveal: bool) -> list[str]:
    """The runs of --runs as full ids: each game once, and (without --reveal) only games whose
    mole is no secret any more — scoring shows it (confusion table, per-strategy rows)."""
    from engine.detect.evaluate import unrevealed

    ids = [journal.run(r).run_id for r in runs]
    twice = next((r for i, r in enumerate(ids) if r in ids[:i]), None)
    if twice is not None:
        fail(f"run {twice!r} is given twice: a game is scored once")
    hidden = [] if reveal else unrevealed(journal, ids)
    if hidden:
        more = f" (and {len(hidden) - 1} more)" if len(hidden) > 1 else ""
        fail(
            f"run {hidden[0]!r}{more} is a game nobody has accused yet, and scoring it would "
            "show its mole: accuse it first (`car accuse`), or pass --reveal"
        )
    return ids


def _table(**options: Any) -> Any:
    """A rich Table, imported when a command prints one (not at the CLI's start-up)."""
    from rich.table import Table

    return Table(**options)
