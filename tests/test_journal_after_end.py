"""The journal refuses what may not follow a run's end (decision 49): after its `RunEnded`
only its one accusation may be appended. A second `RunEnded` would turn a failed run
`completed`; a step after the end would change what every reader reports; a second
accusation would give one game two verdicts (two `car accuse` at once both passed the
"already accused?" check before the rule). The writer that wrote the end knows it from its
own memory, any other (a new process) reads it back: both are covered, on SQLite and on
PostgreSQL."""

from __future__ import annotations

from pathlib import Path

import pytest
from journal_helpers import car

from engine import events as ev
from engine.errors import RunClosed
from engine.heist.session import accuse_run, record_heist
from engine.heist.sim import SimPolicy
from engine.interventions import DoResample, parent_info, run_branch
from engine.journal import Journal

SECOND_END = ev.RunEnded(status="completed", outcome={"bad": False, "score": 1.0})
A_STEP = ev.ChatMessage(step=6, agent="planner", text="all is well")


def _accusation() -> ev.SuspicionDeclared:
    return ev.SuspicionDeclared(suspect="intel", verdict="FAILURE", mole="x", strategy="y")


@pytest.fixture
def target(journal_target: str) -> str:
    return journal_target


def _heist(target: str) -> str:
    with Journal(target) as j:
        return record_heist(j, SimPolicy(), seed=7, rounds=1).run_id


@pytest.mark.parametrize("events", [[SECOND_END], [A_STEP], [A_STEP, SECOND_END]])
@pytest.mark.parametrize("same_writer", [True, False])
def test_nothing_but_an_accusation_follows_the_end(
    target: str, events: list[ev.Event], same_writer: bool
) -> None:
    """The end's own writer (its memory) and a new one (a read) both refuse, with or without
    naming the seq; nothing is written and the run reads as before."""
    with Journal(target) as j:
        run = record_heist(j, SimPolicy(), seed=7, rounds=1).run_id
        before = (j.head(run), j.status(run))
        if same_writer:
            with pytest.raises(RunClosed, match="has ended"):
                j.append(run, events, before[0])
            with pytest.raises(RunClosed, match="has ended"):
                j.append(run, events)
    with Journal(target) as j:
        if not same_writer:
            with pytest.raises(RunClosed, match=f"has ended: .* at seq {before[0]} refused"):
                j.append(run, events, before[0])
            with pytest.raises(RunClosed, match="has ended"):
                j.append(run, events)
        assert (j.head(run), j.status(run)) == before
        assert j.verify().ok


def test_one_accusation_and_no_more(target: str) -> None:
    """The accusation is appended after the end; a second one, by any writer, is refused
    (not only by accuse_run's own check, which two processes at once both pass)."""
    run = _heist(target)
    with Journal(target) as j:
        accuse_run(j, run, "intel")
        head = j.head(run)
        with pytest.raises(RunClosed, match="already accused"):
            j.append(run, [_accusation()])
        with pytest.raises(RunClosed, match="has ended"):
            j.append(run, [A_STEP], head)
    with Journal(target) as j:
        with pytest.raises(RunClosed, match="already accused"):
            j.append(run, [_accusation()], head)
        assert j.head(run) == head and j.verify().ok


def test_an_accusation_may_not_come_twice_in_one_append(tmp_path: Path) -> None:
    path = str(tmp_path / "j.db")
    run = _heist(path)
    with Journal(path) as j:
        head = j.head(run)
        with pytest.raises(RunClosed, match="already accused"):
            j.append(run, [_accusation(), _accusation()], head)
        assert j.head(run) == head


def test_an_end_and_its_accusation_in_one_append_are_history(tmp_path: Path) -> None:
    """An accusation may follow the end in the same append (the rule walks the events)."""
    path = str(tmp_path / "j.db")
    with Journal(path) as j:
        run = j.create_run("heist")
        started = ev.RunStarted(
            scenario="heist", config={}, agents=["a"], policy={"name": "sim"}, root_seed=1,
            engine_version="test", started_at="2026-01-01T00:00:00",
        )  # fmt: skip
        head = j.append(run, [started], 0)
        head = j.append(run, [ev.RunEnded(status="completed"), _accusation()], head)
        assert head == 3 and j.status(run) == "completed"
        with pytest.raises(RunClosed):
            j.append(run, [A_STEP], head)


def test_a_branch_of_an_ended_run_records_on(tmp_path: Path) -> None:
    """A branch's history before its fork point is its parent's, whose end comes later:
    forking a completed run at a step writes the branch to its own end."""
    path = str(tmp_path / "j.db")
    run = _heist(path)
    with Journal(path) as j:
        res = run_branch(j, parent_info(j, run), DoResample(3), branch_seed=5)
        assert j.status(res.run_id) in ("completed", "failed")
        with pytest.raises(RunClosed):
            j.append(res.run_id, [A_STEP])


def test_cli_accuse_twice_says_so(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    run = _heist(str(path))
    first = car(path, "accuse", run, "intel")
    assert first.returncode == 0, first.stderr
    again = car(path, "accuse", run, "intel")
    assert again.returncode != 0 and again.stderr.startswith("error:")
    assert "Traceback" not in again.stderr and len(again.stderr.strip().splitlines()) == 1


def test_a_run_created_with_its_events_is_written_whole_or_not_at_all(target: str) -> None:
    """`create_run(events=...)` writes the runs row and the events in one transaction (an
    imported trace, a detection's record): a step the journal refuses inside it (here an
    event after the end) leaves no run behind, not an empty one."""
    started = ev.RunStarted(
        scenario="s", config={}, agents=["a"], policy={"name": "sim"}, root_seed=1,
        engine_version="test", started_at="2026-01-01T00:00:00",
    )  # fmt: skip
    with Journal(target) as j:
        with pytest.raises(RunClosed):
            j.create_run("s", events=[started, ev.RunEnded(status="completed"), A_STEP])
        assert j.runs() == []
        rid = j.create_run("s", events=[started, ev.RunEnded(status="completed")])
        assert j.head(rid) == 2 and j.status(rid) == "completed" and j.verify().ok
        assert j.append(rid, [_accusation()]) == 3
    with Journal(target) as j:
        assert [r.run_id for r in j.runs()] == [rid] and j.verify().ok
