"""`car export`, `car import`, `car diff`: runs as OpenTelemetry traces, and runs compared."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import typer

from engine.commands.common import JsonOpt, emit_json, fail, open_journal, out

FORMATS = ("otlp-json",)


def export_cmd(
    run_id: Annotated[str, typer.Argument(help="Run id or unique prefix.")],
    fmt: Annotated[
        str, typer.Option("--format", "-f", help="Export format: otlp-json (OTLP/JSON traces).")
    ] = "otlp-json",
    output: Annotated[
        Path | None,
        typer.Option(
            "-o",
            "--output",
            help="Write here instead of stdout (-: stdout). An existing directory: one file "
            "per trace (<run>.otlp.json; every branch's too with --branches), as Tempo "
            "imports them.",
        ),
    ] = None,
    branches: Annotated[
        bool,
        typer.Option("--branches", help="Also export every branch, each its own linked trace."),
    ] = False,
    endpoint: Annotated[
        str | None,
        typer.Option(
            "--otlp-endpoint",
            help="POST over OTLP/HTTP to this receiver instead (see --otlp-protocol), e.g. "
            "http://127.0.0.1:6006 (/v1/traces is appended unless given).",
        ),
    ] = None,
    protocol: Annotated[
        str,
        typer.Option(
            "--otlp-protocol",
            envvar="OTEL_EXPORTER_OTLP_PROTOCOL",
            help="With --otlp-endpoint: http/json (default) or http/protobuf (e.g. Phoenix).",
        ),
    ] = "http/json",
    as_json: JsonOpt = False,
) -> None:
    """Export a run as an OpenTelemetry trace (gen_ai.* and OpenInference attributes).

    One OTLP/JSON document: a span per agent turn (invoke_agent), per LLM call (chat) and per
    tool call (execute_tool). Only the public view is exported: never the mole, its strategy,
    its instructions, recorded prompts or seeds."""
    from engine.otel.exporter import dumps, export_runs, post, trace_document

    if fmt not in FORMATS:
        fail(f"unknown export format {fmt!r}; expected one of: {', '.join(FORMATS)}")
    if output is not None and str(output) == "-":
        output = None  # the usual name of stdout
    if endpoint is not None and output is not None:
        fail("give -o FILE or --otlp-endpoint URL, not both")
    # read-only, as every command that only reads: an older journal is not migrated by it
    with open_journal(create=False, readonly=True) as j:
        ids = export_runs(j, run_id, with_branches=branches)
        per_file = output is not None and output.is_dir()
        if per_file:
            written = []
            for rid in ids:
                path = output / f"{rid}.otlp.json"  # type: ignore[operator]
                _write(path, _shown(dumps(trace_document(j, [rid]))))
                written.append(str(path))
            summary: dict[str, Any] = {"runs": ids, "files": written}
        else:
            document = trace_document(j, ids)
            spans = sum(
                len(ss["spans"]) for rs in document["resourceSpans"] for ss in rs["scopeSpans"]
            )
            summary = {"runs": ids, "spans": spans}
            if endpoint is not None:
                summary["endpoint"] = post(document, endpoint, protocol=protocol)
            elif output is not None:
                _write(output, _shown(dumps(document)))
                summary["files"] = [str(output)]
            else:
                print(_shown(dumps(document)))
                return
    if as_json:
        emit_json(summary)
        return
    where = summary.get("endpoint") or ", ".join(summary.get("files", []))
    what = f"{len(ids)} trace" + ("s" if len(ids) != 1 else "")
    out.print(f"exported {what} ({', '.join(ids)}) to {where}", highlight=False)


def _shown(document: str) -> str:
    """An exported JSON document without a raw character a terminal would act on (C1
    controls, line separators, bidi overrides in a reply): \\u escapes, the same JSON value."""
    from engine.commands.common import _UNSAFE_IN_JSON

    return document.translate(_UNSAFE_IN_JSON)


def _write(path: Path, text: str) -> None:
    """Write whole or not at all (engine/output.py)."""
    from engine.output import write_whole

    try:
        write_whole(path, text + "\n")
    except OSError as e:
        fail(f"cannot write {str(path)!r}: {e.strerror or e}")


def import_cmd(
    file: Annotated[Path, typer.Argument(help="OTLP/JSON trace file (a document or JSON Lines).")],
    again: Annotated[
        bool,
        typer.Option(
            "--again",
            help="Import traces the journal holds already (same trace id and spans) once more, "
            "as new runs; without it they are named and skipped.",
        ),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Import OpenTelemetry traces of an LLM program as runs (one run per trace).

    Reads the gen_ai.* conventions and OpenInference's llm.* / input.value attributes, as
    written by OpenTelemetry's and OpenInference's instrumentations. The runs have scenario
    `imported`: show, state, diff and the detector read them; fork and replay cannot (there is
    no program to re-run). Importing a file again (after Ctrl-C, say) skips the traces the
    journal holds and names their runs; `--json` marks them `already_imported`."""
    from engine.otel.importer import import_file
    from engine.terminal import shown_name

    with open_journal() as j:
        runs = import_file(j, file, again=again)
    if as_json:
        emit_json([{**_builtins(r)} for r in runs])
        return
    for r in runs:
        if r.already_imported:
            out.print(
                f"trace {r.trace_id} is run {r.run_id} already: not imported again (--again "
                "imports it as a new run)",
                highlight=False,
                markup=False,
            )
            continue
        # agent names come from the trace: shown, never obeyed by the terminal
        agents = ", ".join(shown_name(a) for a in r.agents)
        out.print(
            f"imported trace {r.trace_id} as run {r.run_id}: {_n(r.steps, 'step')}, "
            f"{_n(r.tool_calls, 'tool call')}, agents {agents} ({r.status})",
            highlight=False,
            markup=False,
        )
    out.print(f"next: car show {runs[0].run_id}", highlight=False)


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _builtins(obj: Any) -> dict[str, Any]:
    import msgspec

    return msgspec.to_builtins(obj)  # type: ignore[no-any-return]


def diff_cmd(
    run_a: Annotated[str, typer.Argument(help="First run (id or unique prefix).")],
    run_b: Annotated[str, typer.Argument(help="Second run (id or unique prefix).")],
    context: Annotated[
        int, typer.Option("--steps", "-n", min=0, help="Show at most N steps after the first.")
    ] = 20,
    as_json: JsonOpt = False,
) -> None:
    """Compare two runs: the first step where they part, then word diffs step by step.

    Works for a branch against its parent and for two unrelated runs. Deleted words are shown
    as [-word-], inserted ones as {+word+}."""
    from engine.diff import diff_runs
    from engine.terminal import in_markup, printable

    with open_journal(create=False, readonly=True) as j:
        d = diff_runs(j, run_a, run_b)
    if as_json:
        emit_json(d.to_dict())
        return
    out.print(
        f"[bold]a[/] = {d.run_a} ({d.steps_a} steps)  [bold]b[/] = {d.run_b} ({d.steps_b} steps)"
        f"  {d.relation}",
        highlight=False,
    )
    if d.first_divergence is None:
        out.print(f"no difference: {d.same_before} steps, the same step for step")
        return
    out.print(
        # the reason names the agents of both sides: names from an imported trace are data
        f"[bold]first diverging step: {d.first_divergence}[/] ({in_markup(d.reason)}); "
        f"{d.same_before} identical steps before it",
        highlight=False,
    )
    for s in d.steps[: context + 1]:
        # names from an imported trace: data, never markup or terminal control
        agent = in_markup(s.a.agent, name=True) if s.a else "?"
        if s.b and (s.a is None or s.a.agent != s.b.agent):
            b = in_markup(s.b.agent, name=True)
            agent = f"{agent} -> {b}" if s.a else b
        if s.status == "same":
            out.print(f"[dim][{s.step}] {agent}: same[/]", highlight=False)
            continue
        label = {"changed": "", "only_a": " (only in a)", "only_b": " (only in b)"}[s.status]
        out.print(f"[bold][{s.step}] {agent}[/]{label}: ", end="", highlight=False)
        out.print(_render(s.words), highlight=False)
        if not s.tools_same:
            for side, name in ((s.a, "a"), (s.b, "b")):
                for t in side.tools if side else []:
                    shown = t.output if t.success else f"FAILED: {t.output}"
                    shown = printable(" ".join(shown.split()))
                    shown = shown if len(shown) <= 100 else shown[:99] + "…"
                    out.print(
                        f"      {name}: {printable(t.tool)}({printable(t.param)}) = {shown}",
                        highlight=False,
                        markup=False,
                    )
    if len(d.steps) > context + 1:
        out.print(f"... {len(d.steps) - context - 1} more steps (--steps or --json for all)")
    for name, o in (("a", d.outcome_a), ("b", d.outcome_b)):
        if o:
            verdict = "BAD" if o.get("bad") else "OK"
            out.print(f"outcome {name}: {verdict} score={o.get('score', 0):.3f}", highlight=False)


def _render(words: Sequence[tuple[str, str]]) -> Any:
    """Word diff for the terminal: deletions red [-...-], insertions green {+...+}."""
    from rich.text import Text

    from engine.terminal import printable

    text = Text()
    for op, chunk in words:
        chunk = printable(chunk, keep_newlines=True)  # a model's words: shown, never obeyed
        if op == "equal":
            text.append(chunk)
        elif op == "delete":
            text.append(f"[-{chunk}-]", style="red")
        else:
            text.append(f"{{+{chunk}+}}", style="green")
    return text


def register(app: typer.Typer) -> None:
    app.command("export")(export_cmd)
    app.command("import")(import_cmd)
    app.command("diff")(diff_cmd)
