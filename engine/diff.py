"""What is the difference between two runs: the first step where they part, then word diffs.

Both runs are read through the public view, so a diff shows what anyone may see: messages and
tool usage, never a recorded request or the secret. Steps are aligned by their index; a step
differs when its agent, its message or its tool calls (tool, parameter, success, output)
differ. Works for a branch against its parent (they share the steps before the fork) and for
two unrelated runs alike.
"""

from __future__ import annotations

import difflib
import re
from typing import Any, Literal

import msgspec

from engine.journal import Journal
from engine.public import PublicRun, public_view

WordOp = Literal["equal", "delete", "insert"]
_TOKENS = re.compile(r"\s+|\S+\s*")


class ToolLine(msgspec.Struct, frozen=True):
    tool: str
    param: str
    success: bool
    output: str


class StepSide(msgspec.Struct, frozen=True):
    agent: str
    text: str
    tools: list[ToolLine]


class StepDiff(msgspec.Struct, frozen=True):
    step: int
    status: Literal["same", "changed", "only_a", "only_b"]
    a: StepSide | None
    b: StepSide | None
    words: list[tuple[WordOp, str]]  # the message, word by word (a -> b)
    tools_same: bool


class RunDiff(msgspec.Struct, frozen=True):
    run_a: str
    run_b: str
    relation: str  # "b forked from a at step k", "a forked from b ...", "siblings ...", "unrelated"
    steps_a: int
    steps_b: int
    first_divergence: int | None  # None: the runs are the same step for step
    reason: str | None  # what differs at the first diverging step
    same_before: int  # steps identical before the first divergence
    steps: list[StepDiff]  # every step from the first divergence on
    outcome_a: dict[str, Any] | None
    outcome_b: dict[str, Any] | None

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)  # type: ignore[no-any-return]


#: Word diffs cost up to (tokens of a) x (tokens of b) comparisons: a repetitive message of
#: 15,000 words against another took 86 s. Past this many (after the common head and tail are
#: set aside) the differing middle is shown as one deletion and one insertion.
MAX_DIFF_CELLS = 1_000_000


def word_diff(a: str, b: str) -> list[tuple[WordOp, str]]:
    """The message a -> b as runs of equal, deleted and inserted words (whitespace kept).

    The common head and tail are equal runs; the middle is diffed word by word unless that
    would take more than MAX_DIFF_CELLS comparisons (then it is one deletion, one insertion)."""
    ta, tb = _TOKENS.findall(a), _TOKENS.findall(b)
    ops: list[tuple[WordOp, str]] = []

    def add(op: WordOp, tokens: list[str]) -> None:
        text = "".join(tokens)
        if not text:
            return
        if ops and ops[-1][0] == op:
            ops[-1] = (op, ops[-1][1] + text)
        else:
            ops.append((op, text))

    head = 0
    while head < min(len(ta), len(tb)) and ta[head] == tb[head]:
        head += 1
    tail = 0
    while tail < min(len(ta), len(tb)) - head and ta[-1 - tail] == tb[-1 - tail]:
        tail += 1
    mid_a, mid_b = ta[head : len(ta) - tail], tb[head : len(tb) - tail]
    add("equal", ta[:head])
    if len(mid_a) * len(mid_b) > MAX_DIFF_CELLS:
        add("delete", mid_a)
        add("insert", mid_b)
    else:
        matcher = difflib.SequenceMatcher(None, mid_a, mid_b, autojunk=False)
        for tag, i1, i2, j1, j2 in matcher.get_opcodes():
            if tag == "equal":
                add("equal", mid_a[i1:i2])
            else:
                add("delete", mid_a[i1:i2])
                add("insert", mid_b[j1:j2])
    add("equal", ta[len(ta) - tail :])
    return ops


def _sides(run: PublicRun) -> dict[int, StepSide]:
    tools: dict[int, list[ToolLine]] = {}
    for t in run.tool_usage:
        shown = t.output if t.success else (t.error or t.output)
        tools.setdefault(t.step, []).append(ToolLine(t.tool, t.param, t.success, shown))
    return {m.step: StepSide(m.agent, m.text, tools.get(m.step, [])) for m in run.messages}


def _relation(journal: Journal, a: PublicRun, b: PublicRun) -> str:
    if a.run_id == b.run_id:
        return "the same run"
    if b.parent_run_id == a.run_id:
        return f"b forked from a at step {b.fork_step}"
    if a.parent_run_id == b.run_id:
        return f"a forked from b at step {a.fork_step}"
    if a.parent_run_id is not None and a.parent_run_id == b.parent_run_id:
        return f"siblings: both forked from {a.parent_run_id}"
    if any(seg.run_id == a.run_id for seg in journal.lineage(b.run_id)):
        return "b descends from a (a branch of a branch)"
    if any(seg.run_id == b.run_id for seg in journal.lineage(a.run_id)):
        return "a descends from b (a branch of a branch)"
    if journal.run(a.run_id).root_run_id == journal.run(b.run_id).root_run_id:
        return "related: branches of the same run"
    return "unrelated"


def _reason(x: StepSide | None, y: StepSide | None) -> str:
    if x is None:
        return "step only in b"
    if y is None:
        return "step only in a"
    what = []
    if x.agent != y.agent:
        what.append(f"agent ({x.agent} vs {y.agent})")
    if x.text != y.text:
        what.append("message")
    if x.tools != y.tools:
        what.append("tool calls")
    return ", ".join(what)


def diff_runs(journal: Journal, run_a: str, run_b: str) -> RunDiff:
    """The first step where run b departs from run a, and the step-by-step diff from there."""
    a, b = public_view(journal, run_a), public_view(journal, run_b)
    sa, sb = _sides(a), _sides(b)
    all_steps = sorted(set(sa) | set(sb))
    first: int | None = None
    rows: list[StepDiff] = []
    same_before = 0
    for k in all_steps:
        x, y = sa.get(k), sb.get(k)
        same = x == y
        if first is None:
            if same:
                same_before += 1
                continue
            first = k
        if x is None or y is None:
            status: Literal["same", "changed", "only_a", "only_b"] = (
                "only_b" if x is None else "only_a"
            )
        else:
            status = "same" if same else "changed"
        words = word_diff(x.text if x else "", y.text if y else "")
        rows.append(
            StepDiff(k, status, x, y, words, (x.tools if x else []) == (y.tools if y else []))
        )
    reason = None
    if first is not None:
        reason = _reason(sa.get(first), sb.get(first))
    return RunDiff(
        run_a=a.run_id,
        run_b=b.run_id,
        relation=_relation(journal, a, b),
        steps_a=a.steps,
        steps_b=b.steps,
        first_divergence=first,
        reason=reason,
        same_before=same_before,
        steps=rows,
        outcome_a=a.outcome,
        outcome_b=b.outcome,
    )
