"""Read models over the journal: run listings, transcripts, tool usage, state views.

Everything here only reads. What is not the reveal comes from `engine.public` (the one public
read model); the full fold and the secret event are shown only when a caller asks to reveal.
"""

from __future__ import annotations

from typing import Any

import msgspec

from engine import events as ev
from engine.journal import Journal, RunInfo, UnreadableRun
from engine.policies.base import ChatLine
from engine.public import PublicRun, public_error, public_state, public_steps, public_view
from engine.state import State, edit_transcript, next_agent, shown_state
from engine.terminal import shown_name


def fork_step(j: Journal, info: RunInfo) -> int | None:
    """The parent step a branch was forked at (from its opening intervention event)."""
    if info.parent_run_id is None or info.fork_seq is None:
        return None
    first = next(j.read(info.run_id, info.fork_seq, info.fork_seq + 1), None)
    if first is not None and first.kind == "intervention":
        return int(first.event.at)  # type: ignore[union-attr]
    return None


def run_summary(
    j: Journal, info: RunInfo, depth: int = 0, branches: int | None = None
) -> dict[str, Any]:
    """One run as `car runs` and `car show` describe it; `branches` is its number of forks
    when the caller has counted them (else they are looked up)."""
    status = j.status(info.run_id)
    outcome = _outcome_of(j, info.run_id) if status not in ("recording", "paused") else None
    return {
        "run_id": info.run_id,
        "scenario": info.scenario,
        "parent_run_id": info.parent_run_id,
        "fork_step": fork_step(j, info),
        "created_at": info.created_at,
        "steps": public_steps(j, info.run_id),
        "status": status,
        "outcome": outcome,
        "branches": len(j.children(info.run_id)) if branches is None else branches,
        "depth": depth,
        "label": info.label,
    }


def _outcome_of(j: Journal, run_id: str) -> dict[str, Any] | None:
    """The outcome the run ended with, as the public view gives it: None while it runs, and
    when it stopped or failed without one (a heist's); a recorded program's failed run has
    one (its exit status)."""
    ended = _ending_of(j, run_id)
    if ended is None or (ended[0] != "completed" and not ended[1]):
        return None
    return ended[1]


def _ending_of(j: Journal, run_id: str) -> tuple[str, dict[str, Any]] | None:
    """How the run ended (RunEnded's status and outcome), or None while it has not."""
    head = j.head(run_id)
    for stored in j.read(run_id, max(0, head - 4), head):
        e = stored.event
        if isinstance(e, ev.RunEnded):
            return e.status, dict(e.outcome)
    return None


def _error_of(j: Journal, run_id: str) -> str | None:
    """Why the run failed or stopped, whole (RunEnded's error; `--reveal` only: the public
    view has it through `public_error`)."""
    head = j.head(run_id)
    for stored in j.read(run_id, max(0, head - 4), head):
        if isinstance(stored.event, ev.RunEnded):
            return stored.event.error
    return None


def list_runs(
    j: Journal, *, include_branches: bool, limit: int
) -> tuple[list[dict[str, Any]], list[UnreadableRun]]:
    """The root runs (the newest `limit`), each followed by its branches with
    `include_branches`; and the runs rows that do not read (a cell retyped by hand), left out
    with every branch under them, so that one tampered row hides no other run."""
    all_runs, unreadable = j.listing()
    by_parent: dict[str, list[RunInfo]] = {}
    for r in all_runs:
        if r.parent_run_id is not None:
            by_parent.setdefault(r.parent_run_id, []).append(r)
    every_root = [r for r in all_runs if r.parent_run_id is None]
    # a run no root leads to (its parent chain loops: only an altered journal) is said too
    reached: set[str] = set()
    todo = [r.run_id for r in every_root]
    while todo:
        rid = todo.pop()
        if rid not in reached:
            reached.add(rid)
            todo.extend(c.run_id for c in by_parent.get(rid, []))
    parent_of = {r.run_id: r.parent_run_id for r in all_runs}

    def in_cycle(rid: str) -> bool:
        seen, at = {rid}, parent_of.get(rid)
        while at is not None and at not in seen:
            seen.add(at)
            at = parent_of.get(at)
        return at == rid

    # left out with every branch under them, as a row that does not read
    unreadable = list(unreadable) + [
        UnreadableRun(r.run_id, "parent_run_id", f"run {r.run_id!r} is in a parent cycle")
        for r in all_runs
        if r.run_id not in reached and in_cycle(r.run_id)
    ]
    roots = every_root[-limit:] if limit else []
    rows: list[dict[str, Any]] = []

    def walk(info: RunInfo, depth: int) -> None:
        children = by_parent.get(info.run_id, [])
        rows.append(run_summary(j, info, depth, len(children)))
        if include_branches:
            for c in children:
                walk(c, depth + 1)

    for r in roots:
        walk(r, 0)
    return rows, unreadable


def branch_tree(j: Journal, run_id: str) -> dict[str, Any]:
    info = j.run(run_id)
    node: dict[str, Any] = {"run_id": info.run_id, "fork_step": fork_step(j, info)}
    if info.parent_run_id is not None and info.fork_seq is not None:
        first = next(j.read(info.run_id, info.fork_seq, info.fork_seq + 1), None)
        node["op"] = first.event.op if first is not None and first.kind == "intervention" else None  # type: ignore[union-attr]
        ended = _ending_of(j, info.run_id)
        # a verdict only for a branch that completed: a stopped or failed one has no outcome
        # (it is not "ok"); its ending is said instead
        node["verdict"] = (
            ("bad" if ended[1].get("bad") else "ok")
            if ended is not None and ended[0] == "completed"
            else None
        )
        node["ended"] = ended[0] if ended is not None and ended[0] != "completed" else None
    node["children"] = [branch_tree(j, c.run_id) for c in j.children(info.run_id)]
    return node


def transcript_lines(j: Journal, run_id: str, *, reveal: bool = False) -> list[str]:
    lines: list[str] = []
    results: list[str] = []  # a step's tool results, shown under its message
    for stored in j.read(run_id):
        e = stored.event
        prefix = f"[{e.step}]" if e.step is not None else "   "
        if isinstance(e, ev.ChatMessage):
            lines.append(f"{prefix} {shown_name(e.agent)}: {e.text}")
            lines.extend(results)
            results = []
        elif isinstance(e, ev.ToolResult):
            shown = e.output if e.ok else f"FAILED: {e.error}"
            results.append(f"      -> {e.tool}({_clip(e.param, 60)}) = {_clip(shown, 140)}")
        elif isinstance(e, ev.Intervention):
            lines.append(f"--- fork: {e.op} at step {e.at} value={_clip(str(e.value), 120)}")
        elif isinstance(e, ev.Control):
            lines.append(f"--- control: {e.action} {e.reason}".rstrip())
        elif isinstance(e, ev.MoleAssigned) and reveal:
            if e.none:
                lines.append("--- secret: no mole")
            else:
                lines.append(f"--- secret: mole={shown_name(e.agent)} strategy={e.strategy}")
        elif isinstance(e, ev.SuspicionDeclared):
            lines.append(
                f"--- accused {shown_name(e.suspect) if e.suspect else '(nobody)'}: {e.verdict};"
                f" the mole was {shown_name(e.mole)} "
                f"({e.strategy})"
            )
        elif isinstance(e, ev.RunEnded) and e.error:
            lines.append(f"--- run {e.status}: {e.error if reveal else public_error(e.error)}")
    return lines


def _clip(text: str, n: int) -> str:
    text = text.replace("\n", " ")
    return text if len(text) <= n else text[: n - 1] + "…"


def public_lines(view: PublicRun) -> list[str]:
    """The transcript of a public view: each message followed by its tool results, forks,
    controls and the verdict, in journal order."""
    items: list[tuple[int, str]] = []
    results: dict[int, list[str]] = {}
    for t in view.tool_usage:
        shown = t.output if t.success else f"FAILED: {t.error}"
        results.setdefault(t.step, []).append(
            f"      -> {t.tool}({_clip(t.param, 60)}) = {_clip(shown, 140)}"
        )
    for m in view.messages:
        text = f"[{m.step}] {shown_name(m.agent)}: {m.text}"
        items.append((m.seq, "\n".join([text, *results.pop(m.step, [])])))
    for iv in view.interventions:
        items.append(
            (
                iv["seq"],
                f"--- fork: {iv['op']} at step {iv['at']} value={_clip(str(iv['value']), 120)}",
            )
        )
    for c in view.controls:
        items.append((c["seq"], f"--- control: {c['action']} {c['reason']}".rstrip()))
    lines = [line for _, block in sorted(items, key=lambda x: x[0]) for line in block.split("\n")]
    for rest in results.values():  # results of a step whose message is missing (a failure)
        lines.extend(rest)
    v = view.verdict
    if v is not None:
        lines.append(
            f"--- accused {shown_name(v['suspect']) if v['suspect'] else '(nobody)'}:"
            f" {v['verdict']}; the mole was {shown_name(v['mole'])} "
            f"({v['strategy']})"
        )
    return lines


def show_run(j: Journal, run_id: str, *, reveal: bool = False) -> dict[str, Any]:
    """What `car show` prints. Without `reveal` everything comes from the public view (no
    seeds, no secret); with it, the full journal including the secret event."""
    info = j.run(run_id)
    if not reveal:
        view = public_view(j, info.run_id)
        return {
            "run": {
                "run_id": view.run_id,
                "scenario": view.scenario,
                "parent_run_id": view.parent_run_id,
                "created_at": info.created_at,
                "label": info.label,
            },
            "status": view.status,
            "steps": view.steps,
            "fork_step": view.fork_step,
            "started": {"policy": view.policy, "agents": view.agents, "rounds": view.rounds},
            "outcome": view.outcome,
            "error": view.error,
            "lines": public_lines(view),
            "branches": branch_tree(j, info.run_id),
        }
    summary = run_summary(j, info)
    started = None
    for stored in j.read(info.run_id, 0, 1):
        e = stored.event
        if isinstance(e, ev.RunStarted):
            started = {
                "policy": e.policy.get("name"),
                "root_seed": e.root_seed,
                "agents": e.agents,
                "rounds": e.rounds,
            }
    return {
        "run": msgspec.to_builtins(info),
        "status": summary["status"],
        "steps": summary["steps"],
        "fork_step": summary["fork_step"],
        "started": started,
        "outcome": summary["outcome"],
        "error": _error_of(j, info.run_id) if summary["status"] != "recording" else None,
        "lines": transcript_lines(j, info.run_id, reveal=reveal),
        "branches": branch_tree(j, info.run_id),
    }


def state_dict(state: State, *, reveal: bool = False) -> dict[str, Any]:
    data = msgspec.to_builtins(state)
    if not reveal:
        for ctx in data["contexts"].values():
            ctx.pop("secret", None)
            ctx.pop("strategy", None)
    data["acting_agent"] = next_agent(state)
    data["round"] = state.round
    return data


def state_view(j: Journal, run_id: str, k: int, *, reveal: bool = False) -> dict[str, Any]:
    """s_k for `car state`: the public projection unless `reveal` (then the whole fold).

    k runs from 0 (before the first step) to the number of steps (after the last one)."""
    n = j.steps(run_id)
    if not 0 <= k <= n:
        from engine.errors import InterventionError

        raise InterventionError(
            f"step {k} is out of range: run {j.run(run_id).run_id!r} has states 0..{n} "
            f"(s_k is the state before step k; {n}: after its last step)"
        )
    if not reveal:
        return public_state(j, run_id, k)
    info = j.run(run_id)
    s = shown_state(j, info.run_id, k)
    data = state_dict(s, reveal=reveal)
    data["run_id"] = info.run_id
    data["k"] = k
    return data


def conversation(j: Journal, run_id: str, stop: int | None = None) -> list[ChatLine]:
    """The full public conversation of a run's history (events with seq < stop), with any
    do_context edits applied where they were made."""
    lines: list[ChatLine] = []
    for stored in j.read(run_id, 0, stop):
        e = stored.event
        if isinstance(e, ev.ChatMessage):
            lines.append(ChatLine(step=e.step or 0, agent=e.agent, text=e.text))
        elif isinstance(e, ev.Intervention) and e.op == "context":
            lines = edit_transcript(lines, e.value, e.at)
    return lines


def tool_usage(j: Journal, run_id: str) -> list[dict[str, Any]]:
    """The blog's tool_usage view: one row per tool result (agent, tool, param, success)."""
    return [
        {
            "step": t.step,
            "agent": t.agent,
            "tool_name": t.tool,
            "param": t.param,
            "success": t.success,
        }
        for t in public_view(j, run_id).tool_usage
    ]
