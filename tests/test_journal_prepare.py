"""A step is hashed and compacted before its write transaction, and a branch's writer starts
from what seeding learnt at its fork point, shared by every branch forked there. Neither may
change a stored byte: the rows of branches written by one journal (a warm fork point) are the
rows written by a fresh journal per branch (a cold one), and a step whose transaction never
started is written again as if it had never been prepared."""

from __future__ import annotations

import itertools
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest
from journal_helpers import StillClock, stored_rows

from engine import events as ev
from engine import journal as journal_module
from engine.errors import JournalError
from engine.heist.session import record_heist
from engine.interventions import DoResample, parent_info, run_branch
from engine.journal import Journal
from engine.policies.registry import make_policy
from engine.verify import verify_journal

NEW = "a new line past it " * 4


def _intact(path: Path) -> bool:
    with Journal(path, readonly=True) as j:
        return verify_journal(j).ok


def _say(step: int, text: str) -> list[ev.Event]:
    return [ev.ChatMessage(step=step, agent="a", text=text)]


def _ids(tag: str) -> Callable[[], str]:
    count = itertools.count()
    return lambda: f"{tag}{next(count):09d}"


def _heist(path: Path, version: int) -> str:
    with Journal(path, ids=_ids("run")) as j:
        j.write_version = version
        return record_heist(
            j, make_policy({"name": "sim"}), seed=7, rounds=2, clock=StillClock()
        ).run_id


def _branches(path: Path, run: str, fork_at: list[int], fresh: bool, version: int) -> list[str]:
    """Branches of `run` resampled at each step of `fork_at` (seed 100 + i), by one journal
    object for all of them or by a new one for each."""
    ids = []
    new_id = _ids("branch")
    j = Journal(path, ids=new_id)
    j.write_version = version
    try:
        for i, k in enumerate(fork_at):
            if fresh and i:
                j.close()
                j = Journal(path, ids=new_id)
                j.write_version = version
            parent = parent_info(j, run)
            ids.append(run_branch(j, parent, DoResample(k=k), 100 + i).run_id)
    finally:
        j.close()
    return ids


@pytest.mark.parametrize("version", [6, 5, 4])
def test_branches_at_a_warm_fork_point_store_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: int
) -> None:
    """Five branches, three of them at one fork point and two at another (the second and
    third at a step are seeded from the cache), store byte for byte the rows that five
    branches written each by a fresh journal store; and every row reads back."""
    # branches take the step loop's default clock
    monkeypatch.setattr("engine.runtime.episode.SystemClock", StillClock)
    fork_at = [3, 3, 7, 3, 7]
    rows = []
    for name, fresh in (("warm", False), ("cold", True)):
        path = tmp_path / f"{name}.db"
        run = _heist(path, version)
        ids = _branches(path, run, fork_at, fresh, version)
        rows.append([stored_rows(path, b) for b in ids])
        with Journal(path, readonly=True) as j:
            for b in ids:
                assert len(j.events(b)) == j.head(b)
        assert _intact(path)
    warm, cold = rows
    assert [len(r) for r in warm] == [len(r) for r in cold]
    assert all(len(r) > 5 for r in warm)
    assert {v for rs in warm for _s, v, _p in rs} == {version}
    assert warm == cold


def test_the_fork_cache_is_keyed_by_the_parents_head(tmp_path: Path) -> None:
    """A branch forked at a step of a parent that has grown since the last branch there is
    seeded again (its strings past the fork point are more): the same bytes as a fresh
    journal writes."""
    path = tmp_path / "grow.db"
    with Journal(path) as j:
        run = j.create_run("grow")
        head = 0
        for step in range(3):
            head = j.append(run, _say(step, f"line {step} " * 9), head)
        first = j.create_run("b1", parent_run_id=run, fork_seq=2)
        j.append(first, _say(2, "line 2 " * 9), 2)
        # the parent grows by a string the next branch repeats
        head = j.append(run, _say(3, NEW), head)
        second = j.create_run("b2", parent_run_id=run, fork_seq=2)
        j.append(second, _say(2, NEW), 2)
    with Journal(path) as j:
        third = j.create_run("b3", parent_run_id=run, fork_seq=2)
        j.append(third, _say(2, NEW), 2)
    assert stored_rows(path, second) == stored_rows(path, third)
    # and it refers to the parent's string past the fork instead of repeating it
    assert len(stored_rows(path, second)[0][2]) < len(NEW)
    assert _intact(path)


def test_a_step_whose_transaction_never_began_is_written_again_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step is prepared (hashed, compacted) and then its BEGIN IMMEDIATE fails because
    another connection holds the write lock: the writer forgets what preparing it learnt, so
    the same step appended again once the lock is free is stored as a cold writer stores it
    (a remembered string would have pointed at the step itself) and reads back."""
    text = "the vault door opens at midnight, and the guard changes at two"
    path = tmp_path / "locked.db"
    with Journal(path) as j:
        run = j.create_run("locked")
        head = j.append(run, [ev.ChatMessage(step=0, agent="a", text="first words of the run")], 0)
        monkeypatch.setattr(journal_module, "BUSY_TIMEOUT_S", 0.05)
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        step = [
            ev.ChatMessage(step=1, agent="a", text=text),
            ev.ChatMessage(step=1, agent="b", text=f"b: {text}"),
        ]
        with pytest.raises((JournalError, sqlite3.OperationalError)):
            j.append(run, step, head)
        other.execute("ROLLBACK")
        other.close()
        assert j.head(run) == head
        j.append(run, step, head)
        assert [e.text for e in j.events(run)[1:]] == [text, f"b: {text}"]
    cold = tmp_path / "cold.db"
    with Journal(cold) as j:
        run2 = j.create_run("locked")
        head = j.append(run2, [ev.ChatMessage(step=0, agent="a", text="first words of the run")], 0)
        j.append(run2, step, head)
    assert [r[2] for r in stored_rows(path, run)] == [r[2] for r in stored_rows(cold, run2)]
    assert _intact(path)


FAR = "a string the parent holds past the fork point, long enough to be referred to"


def _state(c: ev.Compactor) -> dict[str, object]:
    """A deep copy of everything a compactor learns."""
    import copy

    fields = ("strings", "heads", "tails", "more_heads", "more_tails", "far", "requests",
              "last_request", "_keys")  # fmt: skip
    return {f: copy.deepcopy(getattr(c, f)) for f in fields}


def _llm(step: int, agent: str, request: list[dict[str, str]], response: str) -> bytes:
    return ev.encode(
        ev.LlmCall(
            step=step, agent=agent, request=request, seed=1, model="m", response=response,
            finish_reason="stop",
        )
    )  # fmt: skip


def test_a_clones_learning_never_reaches_the_seeded_original() -> None:
    """A compactor seeded with history and strings past a fork point is cloned twice. The
    first clone compacts new events (new strings, a request that replaces an agent's base)
    and then forgets everything at the memory bound; the original is unchanged throughout,
    and the second clone compacts the same events to the same bytes as the first did."""
    system = {"role": "system", "content": "You are a, the planner of a small crew; be brief."}
    history = [system, {"role": "user", "content": "the vault opens at midnight, says intel"}]
    seeded = ev.Compactor()
    seeded.compact(0, _llm(0, "a", history, "noted: the vault opens at midnight"))
    seeded.learn_far(5, ev.encode(ev.ChatMessage(step=5, agent="b", text=FAR)))
    before = _state(seeded)
    assert FAR in seeded.far
    later = [
        _llm(1, "a", [*history, {"role": "user", "content": "b: the guard changes at two"}],
             "then we go at two past midnight"),
        ev.encode(ev.ChatMessage(step=1, agent="a", text="then we go at two past midnight, crew")),
        ev.encode(ev.ChatMessage(step=2, agent="b", text=FAR)),
    ]  # fmt: skip
    first = seeded.clone()
    out1 = [first.compact(1 + i, p) for i, p in enumerate(later)]
    assert _state(seeded) == before
    # the memory bound: the clone forgets its own memory, not the original's
    first.strings.update({f"filler string number {i:06d}": (0, 0) for i in range(20_001)})
    first.compact(9, ev.encode(ev.ChatMessage(step=3, agent="a", text="one more line to keep")))
    assert first.far == {} and _state(seeded) == before
    second = seeded.clone()
    assert [second.compact(1 + i, p) for i, p in enumerate(later)] == out1
    assert len(out1[2]) < len(FAR)  # the string past the fork is a reference, not repeated


def _rows_of(path: Path, runs: list[str]) -> list[list[tuple[int, int, bytes]]]:
    return [stored_rows(path, r) for r in runs]


def _reads_back(path: Path, runs: list[str]) -> bool:
    with Journal(path, readonly=True) as j:
        return all(len(j.events(r)) == j.head(r) for r in runs) and verify_journal(j).ok


def _line(i: int) -> str:
    return f"branch {i} says a long line of its own, which the other branch never says"


def _two_branches(path: Path, own: Callable[[int], list[str]]) -> list[str]:
    """A three-event run and two branches of it at seq 2, branch i saying the lines own(i)."""
    with Journal(path) as j:
        run = j.create_run("r")
        head = 0
        for step in range(3):
            head = j.append(run, _say(step, f"the parent's line number {step} of three"), head)
        kids = [j.create_run(f"k{i}", parent_run_id=run, fork_seq=2) for i in range(2)]
        for i, kid in enumerate(kids):
            j.append(kid, [e for t in own(i) for e in _say(2, t)], 2)
    return kids


def test_grandchildren_of_two_branches_at_one_seq_learn_their_own_lineage(
    tmp_path: Path,
) -> None:
    """Two branches of one run, of the same length, each branched again at the same seq by
    one journal object: the second grandchild then writes the first branch's own line. Its
    writer learnt from its own parent, which never said it, so the line is stored inline and
    reads back (learning from the other branch would have made it a reference to a row that
    holds something else in this lineage)."""
    path = tmp_path / "grand.db"
    kids = _two_branches(path, lambda i: [_line(i), f"and a second line, from branch {i}"])
    with Journal(path) as j:
        grand = [j.create_run(f"g{i}", parent_run_id=k, fork_seq=4) for i, k in enumerate(kids)]
        j.append(grand[0], _say(4, "the first grandchild's words"), 4)
        j.append(grand[1], _say(4, _line(0)), 4)
    with Journal(path, readonly=True) as j:
        assert [e.text for e in j.events(grand[1])][2:] == [
            _line(1),
            "and a second line, from branch 1",
            _line(0),
        ]
        assert verify_journal(j).ok


def test_resumed_branches_at_one_seq_learn_their_own_events(tmp_path: Path) -> None:
    """Two branches of one parent at one fork point, each resumed past its own events by the
    same journal object; the second then writes the first's own line. What each writer learns
    includes its own events only, so the line is stored inline and reads back."""
    path = tmp_path / "resume.db"
    kids = _two_branches(path, lambda i: [_line(i)])
    with Journal(path) as j:
        j.append(kids[0], _say(3, "the first branch goes on"), 3)
        j.append(kids[1], _say(3, _line(0)), 3)
    with Journal(path, readonly=True) as j:
        assert [e.text for e in j.events(kids[1])][2:] == [_line(1), _line(0)]
        assert verify_journal(j).ok


def test_more_fork_points_than_the_cache_keeps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Branches at more fork points than SEEDED_FORKS, and back at the first: the oldest
    seed is forgotten and made again, and every branch stores what a fresh journal stores."""
    from engine.journal import SEEDED_FORKS

    monkeypatch.setattr("engine.runtime.episode.SystemClock", StillClock)
    fork_at = [*range(1, SEEDED_FORKS + 2), 1]
    rows = []
    for name, fresh in (("warm", False), ("cold", True)):
        path = tmp_path / f"{name}.db"
        run = _heist(path, 5)
        ids = _branches(path, run, fork_at, fresh, 5)
        assert _reads_back(path, ids)
        rows.append(_rows_of(path, ids))
    assert rows[0] == rows[1]


QUOTE = "a line the crew said at step 3, at length, and then once more"


def test_a_step_appended_without_its_seq_is_stored_as_with_it(tmp_path: Path) -> None:
    """A writer that does not name the seq (the head is read under the lock) and has no
    memory of the run yet learns the history before the head, as one that names it does: the
    step's stored bytes are the same either way."""
    import shutil

    base = tmp_path / "base.db"
    with Journal(base) as j:
        run = j.create_run("r")
        head = 0
        for step in range(4):
            head = j.append(
                run, _say(step, f"a line the crew said at step {step}, at length"), head
            )
    # it quotes the latest step's line: a writer that learnt less (the history before step 3
    # rather than before seq 4) writes it inline
    step = _say(3, QUOTE)
    stored = []
    for name, seq in (("named", head), ("unnamed", None)):
        path = tmp_path / f"{name}.db"
        shutil.copyfile(base, path)
        with Journal(path) as j:
            assert j.append(run, step, seq) == head + 1
        stored.append(stored_rows(path, run)[-1])
    assert stored[0] == stored[1]
    assert len(stored[0][2]) < len(QUOTE)


def test_a_lost_race_names_the_seq_that_was_taken(tmp_path: Path) -> None:
    """Two writers of one run prepare the same seq; the one that inserts second gets
    ConcurrencyError naming that seq (not the step, which differs from it), and nothing of
    its step is written."""
    from engine.errors import ConcurrencyError

    path = tmp_path / "race.db"
    with Journal(path) as a, Journal(path) as b:
        run = a.create_run("r")
        head = a.append(run, [*_say(0, "one line"), *_say(0, "and another line")], 0)
        a.append(run, _say(1, "the first writer's step"), head)
        taken = rf"^run {run!r}: seq {head} was already written"
        with pytest.raises(ConcurrencyError, match=taken):
            b.append(run, _say(1, "the second writer's step"), head)
        assert [e.text for e in a.events(run)][-1] == "the first writer's step"
        assert a.head(run) == head + 1
