"""`car diff`: the first step where two runs part, then word diffs step by step, for a branch
against its parent and for two unrelated runs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from otel_helpers import car, heist_with_branches

from engine.diff import diff_runs, word_diff
from engine.errors import UnknownRun
from engine.heist.session import record_heist
from engine.heist.sim import SimPolicy
from engine.journal import Journal
from engine.public import public_view


@pytest.mark.parametrize(
    ("a", "b", "ops"),
    [
        ("same words", "same words", [("equal", "same words")]),
        ("go at 01:00 now", "go at 02:30 now",
         [("equal", "go at "), ("delete", "01:00 "), ("insert", "02:30 "), ("equal", "now")]),
        ("", "new text", [("insert", "new text")]),
        ("old text", "", [("delete", "old text")]),
        ("a b c", "a c", [("equal", "a "), ("delete", "b "), ("equal", "c")]),
    ],
)  # fmt: skip
def test_word_diff(a: str, b: str, ops: list[tuple[str, str]]) -> None:
    """Word diffs group runs of equal, deleted and inserted words and keep the spacing."""
    got = word_diff(a, b)
    assert got == ops
    assert "".join(t for op, t in got if op != "insert") == a
    assert "".join(t for op, t in got if op != "delete") == b


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str, list[str], str]]:
    path = tmp_path_factory.mktemp("diff") / "j.db"
    with Journal(path) as j:
        run, branches = heist_with_branches(j, seed=6)
        other = record_heist(j, SimPolicy(), seed=99, rounds=2).run_id
    yield path, run, branches, other


def test_forced_branch_parts_at_its_fork_step(runs: tuple[Path, str, list[str], str]) -> None:
    """A do_action branch is identical to its parent before step 7 and differs at 7, whose
    word diff turns the parent's message into the forced one."""
    path, run, branches, _ = runs
    with Journal(path) as j:
        forced = next(b for b in branches if public_view(j, b).fork_step == 7)
        d = diff_runs(j, run, forced)
        parent = public_view(j, run)
    assert d.relation == "b forked from a at step 7"
    assert d.first_divergence == 7 and d.same_before == 7 and "message" in (d.reason or "")
    first = d.steps[0]
    assert first.step == 7 and first.status == "changed"
    before = "".join(t for op, t in first.words if op != "insert")
    after = "".join(t for op, t in first.words if op != "delete")
    assert before == next(m.text for m in parent.messages if m.step == 7)
    assert after == "We go in at 01:00. [TOOL:calculator:6*7]"
    assert [s.step for s in d.steps] == list(range(7, d.steps_a))


def test_diff_names_the_first_differing_step(runs: tuple[Path, str, list[str], str]) -> None:
    """For resample branches and for an unrelated run, every step before the first diverging
    one is the same in both (agent, message, tools) and that step is not."""
    path, run, branches, other = runs
    with Journal(path) as j:
        a = public_view(j, run)
        for rid in [*branches[:2], other]:
            d = diff_runs(j, run, rid)
            b = public_view(j, rid)
            k = d.first_divergence
            assert k is not None
            msgs_a = {m.step: (m.agent, m.text) for m in a.messages}
            msgs_b = {m.step: (m.agent, m.text) for m in b.messages}
            for step in range(k):
                assert msgs_a[step] == msgs_b[step]
            tools_k = [t for t in a.tool_usage if t.step == k] != [
                t for t in b.tool_usage if t.step == k
            ]
            assert msgs_a.get(k) != msgs_b.get(k) or tools_k
        assert diff_runs(j, run, other).relation == "unrelated"
        assert diff_runs(j, branches[0], branches[1]).relation.startswith("siblings")


def test_a_run_against_itself(runs: tuple[Path, str, list[str], str]) -> None:
    """A run diffed with itself has no diverging step."""
    path, run, _, _ = runs
    with Journal(path) as j:
        d = diff_runs(j, run, run)
    assert d.first_divergence is None and d.steps == [] and d.same_before == d.steps_a


def test_diff_cli(runs: tuple[Path, str, list[str], str]) -> None:
    """`car diff` prints the first diverging step and the marked words; --json is the same
    result; an unknown run is one error line."""
    path, run, branches, _ = runs
    with Journal(path) as j:
        forced = next(b for b in branches if public_view(j, b).fork_step == 7)
        expected = diff_runs(j, run, forced).to_dict()
    text = car(path, "diff", run, forced)
    assert text.returncode == 0, text.stderr
    assert "first diverging step: 7" in text.stdout and "{+We go in at 01:00." in text.stdout
    assert json.loads(car(path, "diff", run, forced, "--json").stdout) == json.loads(
        json.dumps(expected)
    )
    same = car(path, "diff", run, run)
    assert "no difference" in same.stdout
    bad = car(path, "diff", run, "nosuch")
    assert bad.returncode == 1 and bad.stderr.startswith("error: unknown run id 'nosuch'")
    with Journal(path) as j, pytest.raises(UnknownRun):
        diff_runs(j, run, "nosuch")
