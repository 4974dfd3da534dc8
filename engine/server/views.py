"""What the server shows of a run: its public view, tool statistics, listings and branch diffs.

Everything here is built from public events only (see `public_feed`), except the run rows
themselves (ids, parents, creation time), which carry nothing secret.
"""

from __future__ import annotations

from typing import Any

import msgspec

from engine import events as ev
from engine import public
from engine.heist.session import SCENARIO as HEIST
from engine.journal import Journal, RunInfo
from engine.projections import fork_step
from engine.server.public_feed import public_events


def public_view(journal: Journal, run_id: str) -> dict[str, Any]:
    """The public transcript and tool usage of a run (the verdict only once accused), with
    per-agent tool statistics."""
    view = public.public_view(journal, run_id)
    data: dict[str, Any] = msgspec.to_builtins(view)
    info = journal.run(view.run_id)
    _, _, error = _ending(journal, view.run_id)
    data["session_id"] = data.pop("run_id")
    # an empty outcome (a run nobody scored: an imported trace) is none, not a good one
    data["outcome"] = data["outcome"] or None
    data["created_at"] = info.created_at
    data["error"] = error
    data["tool_stats"] = tool_stats(view.agents, data["tool_usage"])
    return data


def tool_stats(agents: list[str], tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per agent: calls, successes, failures, success rate and calls per tool."""
    stats: dict[str, dict[str, Any]] = {
        a: {"calls": 0, "ok": 0, "failed": 0, "success_rate": None, "by_tool": {}} for a in agents
    }
    for t in tools:
        s = stats.setdefault(
            t["agent"], {"calls": 0, "ok": 0, "failed": 0, "success_rate": None, "by_tool": {}}
        )
        s["calls"] += 1
        s["ok" if t["success"] else "failed"] += 1
        by = s["by_tool"].setdefault(t["tool"], {"calls": 0, "ok": 0})
        by["calls"] += 1
        by["ok"] += int(bool(t["success"]))
    for s in stats.values():
        s["success_rate"] = round(s["ok"] / s["calls"], 3) if s["calls"] else None
    return stats


def _ending(
    journal: Journal, run_id: str
) -> tuple[dict[str, Any] | None, dict[str, Any] | None, str | None]:
    """(outcome, verdict, error) from the last events of a run: they sit at its very end."""
    head = journal.head(run_id)
    outcome = verdict = None
    error: str | None = None
    for stored in journal.read(run_id, max(0, head - 3), head):
        if stored.kind == "run_ended":
            e = stored.event
            assert isinstance(e, ev.RunEnded)
            # a run that was never scored (an imported trace) ends with no outcome: none
            outcome = dict(e.outcome) if e.status == "completed" and e.outcome else None
            error = public.public_error(e.error)
        elif stored.kind == "suspicion_declared":
            s = stored.event
            assert isinstance(s, ev.SuspicionDeclared)
            verdict = {
                "suspect": s.suspect,
                "verdict": s.verdict,
                "mole": s.mole,
                "strategy": s.strategy,
            }
    if head > 0 and journal.status(run_id) in ("recording", "paused"):
        outcome = None  # an ancestor's end is not this branch's outcome
    return outcome, verdict, error


def session_summary(journal: Journal, info: RunInfo, branches: int | None = None) -> dict[str, Any]:
    """One run of a listing; `branches` is its number of forks when the caller has counted
    them (else they are looked up)."""
    started: dict[str, Any] = {}
    for _seq, e in public_events(journal, info.run_id):
        if e["kind"] == "run_started":
            started = e
        break
    status = journal.status(info.run_id)
    outcome, verdict, _ = _ending(journal, info.run_id)
    return {
        "session_id": info.run_id,
        "created_at": info.created_at,
        "status": status,
        "steps": public.public_steps(journal, info.run_id),
        "agents": started.get("agents", []),
        "policy": started.get("policy"),
        "outcome": None
        if outcome is None
        else {"bad": outcome.get("bad"), "score": outcome.get("score")},
        "verdict": verdict,
        "branches": len(journal.children(info.run_id)) if branches is None else branches,
    }


def list_sessions(journal: Journal, limit: int, offset: int) -> dict[str, Any]:
    """Root runs of heists, newest first, one page (the journal holds other runs too: the
    detector's journaled LLM calls, recorded programs). A runs row that was tampered with is
    left out of the page and named in `unreadable`, so that one bad row hides no other run."""
    infos, unreadable = journal.listing()
    roots = [r for r in infos if r.parent_run_id is None and r.scenario == HEIST]
    roots.sort(key=lambda r: (r.created_at, r.run_id), reverse=True)
    page = roots[offset : offset + limit]
    forks: dict[str, int] = {}
    for r in infos:
        if r.parent_run_id is not None:
            forks[r.parent_run_id] = forks.get(r.parent_run_id, 0) + 1
    return {
        "total": len(roots),
        "limit": limit,
        "offset": offset,
        "sessions": [session_summary(journal, r, forks.get(r.run_id, 0)) for r in page],
        "unreadable": [u.run_id for u in unreadable],
    }


def branch_tree(journal: Journal, run_id: str) -> dict[str, Any]:
    """The run's whole family, from its root: each node with its fork step, intervention and
    outcome (ok/bad), children in creation order."""
    root = journal.run(journal.run(run_id).root_run_id)
    by_parent: dict[str, list[RunInfo]] = {}
    for r in journal.runs():
        if r.root_run_id == root.run_id and r.parent_run_id is not None:
            by_parent.setdefault(r.parent_run_id, []).append(r)

    def node(info: RunInfo) -> dict[str, Any]:
        op = value = None
        if info.parent_run_id is not None and info.fork_seq is not None:
            first = next(journal.read(info.run_id, info.fork_seq, info.fork_seq + 1), None)
            if first is not None and first.kind == "intervention":
                iv = first.event
                assert isinstance(iv, ev.Intervention)
                op, value = iv.op, iv.value
        outcome, _, _ = _ending(journal, info.run_id)
        kids = by_parent.get(info.run_id, [])
        return {
            "session_id": info.run_id,
            "fork_step": fork_step(journal, info),
            "op": op,
            "value": value if op in ("action", "observation", "context", "policy") else None,
            "status": journal.status(info.run_id),
            "verdict": None if outcome is None else ("bad" if outcome.get("bad") else "ok"),
            "descendants": _count(kids, by_parent),
            "children": [node(c) for c in kids],
        }

    return node(root)


def _count(kids: list[RunInfo], by_parent: dict[str, list[RunInfo]]) -> int:
    return sum(1 + _count(by_parent.get(k.run_id, []), by_parent) for k in kids)


def word_diff(a: str, b: str) -> list[dict[str, str]]:
    """Word-level diff as segments: equal / delete (only in a) / insert (only in b), words
    joined by one space; bounded as `car diff`'s (`engine.diff.word_diff`: a long repetitive
    message is one deletion and one insertion, not minutes of difflib)."""
    from engine.diff import word_diff as words

    out: list[dict[str, str]] = []
    for op, text in words(a, b):
        joined = " ".join(text.split())
        if joined:
            out.append({"op": op, "text": joined})
    return out


def branch_diff(journal: Journal, run_id: str) -> dict[str, Any]:
    """A branch against its parent: the first step whose message differs, and a word diff of
    every step that differs (public messages only)."""
    info = journal.run(run_id)
    if info.parent_run_id is None:
        raise NotABranch(f"session {info.run_id!r} is not a branch (it has no parent)")
    mine = {m["step"]: m for m in public_view(journal, info.run_id)["messages"]}
    parent_view = public_view(journal, info.parent_run_id)
    theirs = {m["step"]: m for m in parent_view["messages"]}
    start = fork_step(journal, info) or 0
    steps: list[dict[str, Any]] = []
    for k in sorted(set(mine) | set(theirs)):
        if k < start:
            continue
        a = theirs.get(k, {}).get("text", "")
        b = mine.get(k, {}).get("text", "")
        if a == b:
            continue
        steps.append(
            {
                "step": k,
                "agent": (mine.get(k) or theirs.get(k) or {}).get("agent"),
                "parent_text": a,
                "branch_text": b,
                "diff": word_diff(a, b),
            }
        )
    outcome, _, _ = _ending(journal, info.run_id)
    return {
        "session_id": info.run_id,
        "parent_id": info.parent_run_id,
        "fork_step": start,
        "first_diverging_step": steps[0]["step"] if steps else None,
        "differing_steps": len(steps),
        "steps": steps,
        "parent_outcome": parent_view["outcome"],
        "branch_outcome": outcome,
    }


class NotABranch(ValueError):
    """The diff of a run that has no parent."""
