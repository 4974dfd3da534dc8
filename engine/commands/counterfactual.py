"""The counterfactual commands: fidelity, fork, attribute, validate, accuse.

Flags mean one thing across commands (docs/decisions.md, "CLI flags"): `--at/-k` is a step,
`--runs/-K` forward runs per step, `-n` how many (branches, rows), `-c` concurrency. Every bad
value is a usage error (exit 2) on one line; Ctrl-C stops within a step, closes what is open
as stopped and exits 130 (engine/workers.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from engine.commands.common import JsonOpt, emit_json, fail, open_journal, out, progress
from engine.commands.executor_opts import ExecutorOpt, RayAddressOpt, WorkersOpt, executor_options
from engine.errors import InterventionError
from engine.terminal import in_markup, printable

OPS = ("resample", "action", "observation", "context", "policy")
METHODS = ("contrastive", "shapley")
PLAYERS = ("steps", "agents")
#: A --value-file larger than this is refused before it is read.
MAX_VALUE_FILE = 1 << 20
#: --runs/-K of attribute and validate at most: each forward run is a journaled branch (or,
#: for validate, a row held in memory), and this is already far past any useful precision.
MAX_RUNS = 100_000
#: --budget of attribute and validate at most (Shapley forward runs), for the same reason.
MAX_BUDGET = 10_000_000
#: Seeds of the forward runs (attribute, validate): what numpy's seeding and the journaled
#: branch seeds take, as `car detect --seed` does.
MAX_SEED = 2**63 - 1
#: --branches/-n of fork at most: each branch is a journaled run (its spec is made up front),
#: and the bound of --runs is already far past any useful precision.
MAX_BRANCHES = MAX_RUNS
#: --settle of attribute at most (engine.attribution.contrastive.MAX_SETTLE_ROUNDS; not
#: imported here: the command line loads only the command that runs)
MAX_SETTLE = 8

ConcurrencyOpt = Annotated[
    int, typer.Option("--concurrency", "-c", min=1, help="Branches (or steps) run at once.")
]
EstimateSeedOpt = Annotated[
    int,
    typer.Option("--seed", min=0, max=MAX_SEED, help="Seed of the forward runs (reproducible)."),
]
BaseUrlOpt = Annotated[
    str | None,
    typer.Option("--base-url", help="openai: run against this OpenAI-compatible server."),
]
ModelOpt = Annotated[str | None, typer.Option("--model", help="openai: model name.")]
TimeoutOpt = Annotated[
    float | None,
    typer.Option("--timeout", help="openai: seconds per call (finite, > 0)."),
]
RunsOpt = Annotated[
    int | None,
    typer.Option(
        "--runs",
        "-K",
        min=2,
        max=MAX_RUNS,
        help="Fixed K forward runs per step (the paper), at least 2; default adaptive.",
    ),
]
OldKOpt = Annotated[
    int | None,
    typer.Option("-k", hidden=True, help="Deprecated spelling of --runs/-K."),
]
AllStepsOpt = Annotated[
    bool,
    typer.Option(
        "--all-steps",
        help="Estimate every step, not only the scan from the end down to the locus.",
    ),
]


ProgramCmdArg = Annotated[
    list[str] | None,
    typer.Argument(
        help="A recorded program's command, after `--` (see car record).", metavar="-- CMD"
    ),
]


_F = TypeVar("_F", bound=Callable[..., Any])


def stoppable(fn: _F) -> _F:
    """Ctrl-C inside the command: its one line ("interrupted: ...") and exit 130, at once.

    Caught here because the CLI framework turns a KeyboardInterrupt into a silent exit 130."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from engine.workers import hard_exit

        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt as e:
            hard_exit(getattr(e, "message", "interrupted"))

    return wrapper  # type: ignore[return-value]


def _factual(bad: bool | None) -> str:
    """The parent's own outcome as `car fork` prints it: a run that ended without one (stopped,
    failed) has none, which is not the same as ok."""
    return "none" if bad is None else "bad" if bad else "ok"


def _choice(value: str, valid: tuple[str, ...], flag: str) -> str:
    if value not in valid:
        raise typer.BadParameter(
            f"{value!r} is not one of: {', '.join(valid)}", param_hint=f"'{flag}'"
        )
    return value


def _runs(runs: int | None, old_k: int | None) -> int | None:
    if old_k is not None:
        raise typer.BadParameter(
            "-k is the step flag (--at) of fork and state; forward runs per step is --runs/-K",
            param_hint="'-k'",
        )
    return runs


def _timeout(value: float | None) -> float | None:
    if value is not None and not (math.isfinite(value) and 0.1 <= value <= 86400):
        raise typer.BadParameter(
            f"must be a finite number of seconds within [0.1, 86400], got {value}",
            param_hint="'--timeout'",
        )
    return value


def _policy_override(
    base_url: str | None, model: str | None, timeout: float | None, drift: float | None = None
) -> dict[str, Any] | None:
    override: dict[str, Any] = {}
    if base_url:
        override["base_url"] = base_url
    if model:
        override["model"] = model
    if _timeout(timeout) is not None:
        override["timeout"] = timeout
    if drift is not None:
        if not (math.isfinite(drift) and 0.0 <= drift <= 1.0):
            raise typer.BadParameter(f"must lie within [0, 1], got {drift}", param_hint="'--drift'")
        override["drift"] = drift
    return override or None


def _read_value_file(path: Path) -> str:
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise typer.BadParameter(
                f"{str(path)!r} is not a regular file", param_hint="'--value-file'"
            )
        if size > MAX_VALUE_FILE:
            raise typer.BadParameter(
                f"{str(path)!r} is {size} bytes; the limit is {MAX_VALUE_FILE}",
                param_hint="'--value-file'",
            )
        with path.open("rb") as f:  # bounded: the file may have grown since the stat
            data = f.read(MAX_VALUE_FILE + 1)
        if len(data) > MAX_VALUE_FILE:
            raise typer.BadParameter(
                f"{str(path)!r} is over {MAX_VALUE_FILE} bytes; the limit is {MAX_VALUE_FILE}",
                param_hint="'--value-file'",
            )
    except OSError as e:
        raise typer.BadParameter(
            f"cannot read {str(path)!r}: {e.strerror}", param_hint="'--value-file'"
        ) from e
    if not data:
        raise typer.BadParameter(
            f"{str(path)!r} is empty; the value must be text", param_hint="'--value-file'"
        )
    if b"\x00" in data:
        raise typer.BadParameter(
            f"{str(path)!r} is binary (it contains NUL bytes); the value must be text",
            param_hint="'--value-file'",
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise typer.BadParameter(
            f"{str(path)!r} is not UTF-8 text (byte {e.start})", param_hint="'--value-file'"
        ) from e


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _fmt_ci(ci: list[float] | tuple[float, float]) -> str:
    return f"[{ci[0]:+.3f}, {ci[1]:+.3f}]"


def _clip(text: str, n: int) -> str:
    from engine.projections import _clip as clip

    return clip(text, n)


# ----------------------------------------------------------------- commands


@stoppable
def ensure_rerunnable(j: Any, run_id: str) -> None:
    """Imported runs (OTLP traces) have no program to re-run: one line, before any work."""
    from engine.otel.imported import ensure_rerunnable as check

    check(j, run_id)


def fidelity_cmd(
    run_id: Annotated[str, typer.Argument(help="Run id or unique prefix.")],
    base_url: BaseUrlOpt = None,
    model: ModelOpt = None,
    timeout: TimeoutOpt = None,
    drift: Annotated[
        float | None,
        typer.Option("--drift", help="sim only: probability of ignoring the seed (test knob)."),
    ] = None,
    concurrency: ConcurrencyOpt = 1,
    as_json: JsonOpt = False,
) -> None:
    """Re-execute every step with its recorded seed and context: the action-match rate."""
    from engine.replay import fidelity
    from engine.workers import interruptible

    override = _policy_override(base_url, model, timeout, drift)
    with interruptible(), open_journal(create=False) as j, progress() as bar:
        ensure_rerunnable(j, run_id)
        task = bar.add_task("re-executing steps", total=None)
        report = fidelity(
            j,
            run_id,
            policy_override=override,
            concurrency=concurrency,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
        )
    data = report.to_dict()
    if as_json:
        emit_json(data)
        return
    swaps = "".join(
        f", {in_markup(str(s['policy'].get('name')))} from step {s['step']}"
        for s in report.policy_swaps
    )
    out.print(
        f"[bold]fidelity of run {report.run_id}[/] "
        f"(policy {in_markup(str(report.policy.get('name')))}{swaps}): "
        f"action-match rate [bold]{_pct(report.action_match_rate)}[/] "
        f"(exact {_pct(report.exact_match_rate)}) over "
        f"{report.steps - report.skipped} re-executed steps"
        + (f", {report.skipped} forced/failed skipped" if report.skipped else ""),
        highlight=False,
    )
    table = _table(box=None, header_style="bold")
    for col in ("agent", "steps", "exact", "normalised"):
        table.add_column(col)
    for agent, a in report.per_agent.items():
        table.add_row(
            in_markup(agent, name=True),
            str(a["steps"]),
            _pct(a["exact_match_rate"]),
            _pct(a["action_match_rate"]),
        )
    out.print(table)
    for d in report.divergences[:20]:
        out.print(
            f"[yellow]step {d['step']} ({in_markup(d['agent'], name=True)})[/]: "
            f"{in_markup(d['provenance']['explanation'])}",
            highlight=False,
        )
        out.print(f"    {d['diff']}", highlight=False, markup=False)
    if len(report.divergences) > 20:
        out.print(f"... {len(report.divergences) - 20} more divergences (--json for all)")


@stoppable
def fork_cmd(
    run_id: Annotated[str, typer.Argument(help="Run id or unique prefix of the parent.")],
    at: Annotated[int, typer.Option("--at", "-k", help="Step k to intervene on.")],
    do: Annotated[
        str,
        typer.Option("--do", help="resample | action | observation | context | policy"),
    ],
    value: Annotated[
        str | None,
        typer.Option(
            "--value",
            help="action: the message; observation: the tool result; context: a message to add,"
            ' or {"step": j, "text": t} to replace step j; policy: sim | sim-honest | '
            "openai[:key=value,...] (keys: model, base_url, temperature, max_tokens, timeout,"
            " max_retries).",
        ),
    ] = None,
    value_file: Annotated[
        Path | None, typer.Option("--value-file", help="Read --value from a text file.")
    ] = None,
    n: Annotated[
        int,
        typer.Option(
            "--branches",
            "-n",
            min=1,
            max=MAX_BRANCHES,
            help="Number of branches (at most 100,000).",
        ),
    ] = 20,
    seed: EstimateSeedOpt = 0,
    concurrency: ConcurrencyOpt = 1,
    base_url: BaseUrlOpt = None,
    model: ModelOpt = None,
    timeout: TimeoutOpt = None,
    executor: ExecutorOpt = "local",
    ray_address: RayAddressOpt = None,
    workers: WorkersOpt = None,
    as_json: JsonOpt = False,
    command: ProgramCmdArg = None,
) -> None:
    """Fork N branches at step k with one do() intervention; the outcome distribution.

    With --do policy, --base-url, --model and --timeout configure the policy
    swapped in. With `-- CMD` the run is a recorded program (car record): CMD is
    re-run per branch, calls before k answered from the journal, live after k.
    Every fork adds N new branches: the same --seed gives the same outcomes
    again, but it is not read back from earlier branches (car attribute does
    that). Exits 1 when every branch failed."""
    from engine.branching import fork
    from engine.interventions import parse_intervention
    from engine.scenario import Rerun
    from engine.workers import interruptible

    _choice(do, OPS, "--do")
    if value_file is not None:
        if value is not None:
            raise typer.BadParameter("give --value or --value-file, not both")
        value = _read_value_file(value_file)
    try:
        iv = parse_intervention(do, at, value)
    except InterventionError as e:
        raise typer.BadParameter(str(e), param_hint="'--value'") from e
    override = _policy_override(base_url, model, timeout)
    where = executor_options(executor, ray_address, workers)
    with interruptible(), open_journal(create=False) as j, progress() as bar:
        ensure_rerunnable(j, run_id)
        task = bar.add_task(f"branches do_{do}@{at}", total=n)
        report = fork(
            j,
            run_id,
            iv,
            n,
            seed=seed,
            rerun=Rerun(concurrency, override, executor=where, command=tuple(command or ())),
            progress=lambda done, total: bar.update(task, completed=done, total=total),
        )
    failed = [b for b in report.branches if b.bad is None]
    if as_json:
        emit_json(report.to_dict())
    else:
        out.print(
            f"[bold]do_{report.op}({report.at})[/] on run {report.parent} "
            f"(factual outcome: {_factual(report.factual_bad)})",
            highlight=False,
        )
        if report.bad_rate is not None and report.ci is not None:
            out.print(
                f"bad rate [bold]{report.bad_rate:.3f}[/] ({report.bad}/{report.scored} "
                f"branches), 95% CI [{report.ci[0]:.3f}, {report.ci[1]:.3f}] (Wilson)",
                highlight=False,
            )
        if failed:
            out.print(f"[red]{len(failed)} branches failed[/]: ", end="", highlight=False)
            out.print(str(failed[0].error), markup=False, highlight=False)
        _print_executor(report.executor)
        out.print("branches: " + " ".join(b.run_id for b in report.branches if b.run_id))
    if failed and len(failed) == len(report.branches):
        fail(f"every branch failed ({len(failed)} of {len(failed)}): {failed[0].error}")


@stoppable
def validate_cmd(
    files: Annotated[
        list[Path] | None,
        typer.Argument(help="SCM model files (YAML) to add to the built-ins.", metavar="FILE"),
    ] = None,
    seed: EstimateSeedOpt = 0,
    runs: RunsOpt = None,
    old_k: OldKOpt = None,
    budget: Annotated[
        int,
        typer.Option(
            "--budget", min=1, max=MAX_BUDGET, help="Shapley forward-run budget per model."
        ),
    ] = 4000,
    players: Annotated[str, typer.Option("--players", help="steps | agents")] = "steps",
    alpha: Annotated[
        float,
        typer.Option("--alpha", help="Family-wise error rate of the check (Bonferroni)."),
    ] = 0.05,
    all_steps: AllStepsOpt = False,
    no_builtin: Annotated[bool, typer.Option("--no-builtin", help="Only the given files.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Run both estimators on synthetic causal models and compare with exact ground truth.

    Exit status 1 when an exact value lies outside its interval. All intervals
    form one family at error rate --alpha (Bonferroni: each at 1 - alpha/m),
    so correct estimators pass with probability >= 1 - alpha."""
    from engine.attribution.scm import builtin_models, load_scm
    from engine.attribution.validate import AlphaError, family_rule, validate

    k = _runs(runs, old_k)
    _choice(players, PLAYERS, "--players")
    if not (math.isfinite(alpha) and 0 < alpha < 1):
        raise typer.BadParameter(
            f"must lie strictly between 0 and 1, got {alpha}", param_hint="'--alpha'"
        )
    models = [] if no_builtin else builtin_models()
    models += [load_scm(f) for f in files or []]
    if not models:
        fail("no models to validate (give model files or drop --no-builtin)")
    try:
        rule = family_rule(models, players, alpha)
    except AlphaError as e:
        raise typer.BadParameter(str(e), param_hint="'--alpha'") from e
    with progress() as bar:
        task = bar.add_task("forward runs", total=None)
        reports = validate(
            models,
            seed,
            k,
            budget,
            players=players,
            alpha=alpha,
            all_steps=all_steps,
            progress=lambda done, _total: bar.update(task, completed=done),
        )
    if as_json:
        emit_json([r.to_dict() for r in reports])
    else:
        for r in reports:
            _print_validation(r.to_dict())
        out.print(f"\n{rule.describe()} (seed {seed})", highlight=False, soft_wrap=True)
    missed = [r.scm for r in reports if not r.ok]
    if missed:
        fail(
            f"estimates missed the exact ground truth on: {', '.join(missed)} (seed {seed}; "
            f"a correct estimator misses somewhere with probability <= {alpha:g})"
        )
    if not as_json:
        out.print("[green]passed[/]: every exact value lies inside its interval", highlight=False)


def _print_validation(d: dict[str, Any]) -> None:
    status = "[green]ok[/]" if d["ok"] else "[red]MISSED[/]"
    # names and text from a model file are data: terminal control escaped, markup as text
    out.print(f"\n[bold]{in_markup(d['scm'])}[/] {status}: ", end="", highlight=False)
    out.print(printable(d["description"], keep_newlines=True), highlight=False, markup=False)
    loc = d["locus"]
    out.print(
        f"  locus: estimated {in_markup(loc['estimated_label'])} vs exact "
        f"{in_markup(loc['exact_label'])} "
        f"({'right' if loc['ok'] else 'WRONG'}); {d['forward_runs']} forward runs "
        f"({d['mode']} contrastive {d['contrastive_runs']}, shapley {d['shapley_runs']}"
        + (", partial" if d["partial"] else "")
        + f"); intervals at {100 * d['level']:.3f}%",
        highlight=False,
    )
    t = _table(box=None, header_style="bold")
    for col in ("step", "effect", "CI", "n", "exact", "covered"):
        t.add_column(col)
    for c in d["contrastive"]:
        t.add_row(
            in_markup(c["label"]),
            f"{c['effect']:+.3f}",
            _fmt_ci(c["ci"]),
            str(c["n"]),
            f"{c['exact']:+.3f}",
            "yes" if c["covered"] else "[red]NO[/]",
        )
    out.print(t)
    t = _table(box=None, header_style="bold")
    for col in ("player", "phi", "CI", "exact", "covered"):
        t.add_column(col)
    for c in d["shapley"]:
        t.add_row(
            in_markup(c["player"], name=True),
            f"{c['phi']:.3f}",
            _fmt_ci(c["ci"]),
            f"{c['exact']:.3f}",
            "yes" if c["covered"] else "[red]NO[/]",
        )
    out.print(t)
    e = d["efficiency"]
    out.print(
        f"  efficiency: sum phi {e['estimated']:.3f} vs exact v(all)-v(none) {e['exact']:.3f} "
        f"(estimated from runs {e['forward_runs_estimate']:.3f})",
        highlight=False,
    )


@stoppable
def attribute_cmd(
    run_id: Annotated[str, typer.Argument(help="A completed, failed heist (id or prefix).")],
    method: Annotated[str, typer.Option("--method", help="contrastive | shapley")] = "contrastive",
    players: Annotated[str, typer.Option("--players", help="shapley: steps | agents")] = "steps",
    runs: RunsOpt = None,
    old_k: OldKOpt = None,
    budget: Annotated[
        int, typer.Option("--budget", min=1, max=MAX_BUDGET, help="shapley: forward-run budget.")
    ] = 2000,
    half_width: Annotated[
        float,
        typer.Option("--half-width", help="contrastive adaptive: target CI half-width (0-0.5)."),
    ] = 0.1,
    all_steps: AllStepsOpt = False,
    settle: Annotated[
        int,
        typer.Option(
            "--settle",
            min=1,
            max=MAX_SETTLE,
            help="contrastive: scan up to N times until the locus is settled against the later "
            "steps; each scan at 1/N of the error rate (95% in all), a later one with forward "
            "runs of its own at the --half-width (or -K) the one before suggested. 1: one scan.",
        ),
    ] = 1,
    seed: EstimateSeedOpt = 0,
    concurrency: ConcurrencyOpt = 1,
    top: Annotated[int, typer.Option("--top", "-n", min=1, help="Rows of the ranked table.")] = 12,
    executor: ExecutorOpt = "local",
    ray_address: RayAddressOpt = None,
    workers: WorkersOpt = None,
    as_json: JsonOpt = False,
    base_url: BaseUrlOpt = None,
    command: ProgramCmdArg = None,
) -> None:
    """Which step (or agent) caused the failure: counterfactual forward runs, ranked.

    Contrastive scans from the last step back to the point of commitment.
    --all-steps estimates every step. The same command with the same --seed
    reads back the branches it made before instead of adding new ones. With
    `-- CMD` the run is a recorded program (car record), re-run per forward run."""
    from engine.branching import attribute
    from engine.scenario import Rerun
    from engine.workers import interruptible

    k = _runs(runs, old_k)
    _choice(method, METHODS, "--method")
    _choice(players, PLAYERS, "--players")
    if method == "contrastive" and players != "steps":
        raise typer.BadParameter("applies to --method shapley only", param_hint="'--players'")
    if method != "contrastive" and settle != 1:
        raise typer.BadParameter("applies to --method contrastive only", param_hint="'--settle'")
    if not (math.isfinite(half_width) and 0 < half_width < 0.5):
        raise typer.BadParameter(
            f"must lie strictly between 0 and 0.5, got {half_width}", param_hint="'--half-width'"
        )
    if method == "contrastive" and k is None:
        from engine.attribution.contrastive import adaptive_schedule
        from engine.errors import ConfigError

        try:  # a width no number of runs reaches (1e-300): refused before the run is opened
            adaptive_schedule(0.95, half_width, 1, 1)
        except ConfigError as unreachable:
            raise typer.BadParameter(str(unreachable), param_hint="'--half-width'") from None
    where = executor_options(executor, ray_address, workers)
    with interruptible(), open_journal(create=False) as j, progress() as bar:
        ensure_rerunnable(j, run_id)
        task = bar.add_task(f"{method} forward runs", total=None)
        data = attribute(
            j,
            run_id,
            method=method,
            players=players,
            k=k,
            budget=budget,
            seed=seed,
            half_width=half_width,
            all_steps=all_steps,
            settle=settle,
            rerun=Rerun(
                concurrency,
                {"base_url": base_url} if base_url else None,
                executor=where,
                command=tuple(command or ()),
            ),
            progress=lambda done, total: bar.update(task, completed=done, total=total),
        )
    if as_json:
        emit_json(data)
        return
    t = _table(box=None, header_style="bold")
    if method == "contrastive":
        for col, width in (("step", 4), ("agent", 11), ("effect", 6), ("95% CI", 16), ("n", 4)):
            t.add_column(col, no_wrap=True, min_width=width)
        t.add_column("message", no_wrap=True, overflow="ellipsis", max_width=44)
        for r in data["ranked"][:top]:
            mark = " *" if r["step"] == data["locus"] else ""
            t.add_row(
                f"{r['step']}{mark}",
                in_markup(r["agent"] or "", name=True),
                f"{r['effect']:+.3f}",
                _fmt_ci(r["ci"]),
                str(r["n"]),
                in_markup(_clip(r["message"], 70)),
            )
        out.print(t)
        if data["locus"] is None:
            out.print("causal locus: [bold]none[/] (no step's interval excludes zero)")
            weakest = min((r["ci"][0] for r in data["ranked"]), default=None)
            if weakest is not None and weakest < 0:
                out.print(
                    f"  an effect down to {weakest:+.3f} is not excluded at any step: a smaller "
                    "--half-width (or a larger -K) looks closer",
                    highlight=False,
                )
        else:
            out.print(
                f"causal locus (point of commitment): [bold]step {data['locus']}[/] "
                f"({in_markup(data['locus_agent'], name=True)}): ",
                end="",
                highlight=False,
            )
            out.print(printable(_clip(data["locus_message"], 100)), highlight=False, markup=False)
            if data.get("locus_settled") is False:
                out.print(_unsettled_line(data), highlight=False)
        if data.get("settle"):
            out.print(_settle_line(data["settle"]), highlight=False)
        first = data.get("first_estimated")
        if not data.get("all_steps") and first:
            out.print(
                f"scan from the end stopped at step {first}; steps 0..{first - 1} not estimated "
                "(--all-steps)",
                highlight=False,
            )
    else:
        for col, width in (("player", 14), ("agent", 11), ("phi", 6), ("95% CI", 16)):
            t.add_column(col, no_wrap=True, min_width=width)
        t.add_column("message", no_wrap=True, overflow="ellipsis", max_width=40)
        for r in data["ranked"][:top]:
            t.add_row(
                in_markup(r["player"], name=True),
                in_markup(r["agent"] or "", name=True),
                f"{r['phi']:+.3f}",
                _fmt_ci(r["ci"]),
                in_markup(_clip(r["message"] or "", 60)),
            )
        out.print(t)
        e = data["efficiency"]
        out.print(
            f"efficiency: sum phi {e['sum_phi']:.3f} vs v(all)-v(none) {e['difference']:.3f} "
            f"{_fmt_ci(e['difference_ci'])}; {data['permutations']} permutations"
            + (" [yellow](partial: budget reached)[/]" if data["partial"] else ""),
            highlight=False,
        )
    out.print(
        f"forward runs spent: {data['forward_runs']} ({data['branches_added']} new branches, "
        f"{data['branches_reused']} reused from an earlier run with seed {seed})",
        highlight=False,
    )
    _print_executor(data.get("executor"))


def _unsettled_line(data: dict[str, Any]) -> str:
    """Why a locus is not settled, and what would settle it (markup)."""
    effect = next(r["effect"] for r in data["ranked"] if r["step"] == data["locus"])
    later = _spans(data["not_excluded"])
    line = (
        f"  [yellow]not settled[/]: {later} rescued no run, but "
        f"{'its interval admits' if len(data['not_excluded']) == 1 else 'their intervals admit'}"
        f" an effect as strong as step {data['locus']}'s ({effect:+.3f})"
    )
    fix = data.get("to_settle")
    if fix is None:
        return line + "; no budget within reach settles it"
    flag = f"--half-width {fix['half_width']:g}" if "half_width" in fix else f"-K {fix['runs']}"
    return line + f"; {flag} would settle it (~{fix['runs_per_step']} forward runs a step)"


def _settle_line(settle: dict[str, Any]) -> str:
    """What settling did: the scans made, at what level each, and how the last one ended."""
    scans = settle["scans"]
    last = scans[-1]
    each = f"each at {100 * settle['confidence_each']:.4g}%, {100 * settle['confidence']:g}% in all"
    runs = sum(s["forward_runs"] for s in scans)
    made = f"{len(scans)} scan{'s' if len(scans) > 1 else ''} of at most {settle['rounds']}"
    widths = ", ".join(
        f"--half-width {s['half_width']:g}" if s["half_width"] is not None
        else f"-K {s['runs_per_step']}"
        for s in scans
    )  # fmt: skip
    if last["settled"]:
        how = "[green]settled[/]"
    elif last["locus"] is None:
        how = "no locus"
    elif len(scans) < settle["rounds"]:
        how = "[yellow]not settled[/], no budget within reach settles it"
    else:
        how = "[yellow]not settled[/]"
    return f"settling: {how} after {made} ({widths}; {each}; {runs} forward runs)"


def _spans(steps: list[int]) -> str:
    """`step 4`, `steps 19-23`, `steps 5, 7-9`: consecutive steps as ranges."""
    parts: list[str] = []
    for step in sorted(steps):
        if parts and parts[-1].split("-")[-1] == str(step - 1):
            parts[-1] = f"{parts[-1].split('-')[0]}-{step}"
        else:
            parts.append(str(step))
    return ("step " if len(steps) == 1 else "steps ") + ", ".join(parts)


def _print_executor(stats: dict[str, Any] | None) -> None:
    """Where the forward runs ran, and what lost workers cost (only when not local)."""
    if not stats or stats["name"] == "local":
        return
    line = f"executor {stats['name']}: {stats['workers']} workers"
    if stats["retried"]:
        line += f"; {stats['retried']} forward runs lost their worker and were run again"
    if stats["lost"]:
        line += f"; {stats['lost']} failed (worker lost twice)"
    if stats["closed"]:
        line += f"; {stats['closed']} half-run branches closed as stopped"
    out.print(line, highlight=False)


def accuse_cmd(
    run_id: Annotated[str, typer.Argument(help="Run id or unique prefix.")],
    agent: Annotated[str | None, typer.Argument(help="Your suspect (omit to give up).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Name the mole: SUCCESS (right), FAILURE (wrong agent), BUSTED (nobody named)."""
    from engine.heist.session import accuse_run

    with open_journal(create=False) as j:
        result = accuse_run(j, run_id, agent)
    if as_json:
        emit_json(
            {
                "run_id": result.run_id,
                "suspect": result.suspect,
                "verdict": result.verdict,
                "mole": result.mole,
                "strategy": result.strategy,
            }
        )
        return
    out.print(f"[bold]{result.verdict}[/]", highlight=False)
    out.print(
        f"the mole was {in_markup(result.mole, name=True)} (strategy {in_markup(result.strategy)})",
        highlight=False,
    )


def register(app: typer.Typer) -> None:
    """Add the counterfactual commands to `app`."""
    app.command("accuse")(accuse_cmd)
    app.command("fidelity")(fidelity_cmd)
    app.command("fork")(fork_cmd)
    app.command("validate")(validate_cmd)
    app.command("attribute")(attribute_cmd)


def _table(**options: Any) -> Any:
    """A rich Table, imported when a command prints one (not at the CLI's start-up)."""
    from rich.table import Table

    return Table(**options)
