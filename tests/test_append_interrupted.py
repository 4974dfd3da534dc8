"""An interrupt inside the journal's append, and the recorder closing the run after it.

The embedded policy is fast, so a recording commits several steps in one group; Ctrl-C (or
SIGTERM, which every command treats as Ctrl-C) can land anywhere inside that group's append:
while its rows are compacted against the run's history, or during its commit. Found by a real
SIGTERM into `car detect-eval` (tests/test_cli_hostile_paths.py): the writer kept the
requests it had noted for the group that never committed, and the closing flush wrote the
same group again as deltas of rows that were not there, which `car verify` then called
tampering.

The interrupt is raised by a fault in the journal's own methods (a subclass), because a signal
cannot be aimed at one bytecode of a real process; the real signal is the CLI test's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.heist.session import record_heist
from engine.heist.sim import SimPolicy
from engine.journal import Journal
from engine.verify import verify_journal


class InterruptedWhileCompacting(Journal):
    """Raises KeyboardInterrupt from its `after`-th compaction, once the rows are compacted
    (the compactor has noted the step's request) and before the transaction begins."""

    after = 0

    def _compact(self, run_id: str, rows: Any) -> Any:
        out = super()._compact(run_id, rows)
        type(self).after -= 1
        if type(self).after == 0:
            raise KeyboardInterrupt
        return out


class InterruptedAfterCommit(Journal):
    """Raises KeyboardInterrupt from its `after`-th write transaction, once it has committed
    (a Ctrl-C that arrived during COMMIT is raised at the next bytecode, after it)."""

    after = 0

    @contextlib.contextmanager
    def _tx(self) -> Iterator[Any]:
        with super()._tx() as cur:
            yield cur
        type(self).after -= 1
        if type(self).after == 0:
            raise KeyboardInterrupt


def _record(journal: Journal) -> str:
    with pytest.raises(KeyboardInterrupt):
        # every step commits on its own: the `after`-th append is the one interrupted
        record_heist(journal, SimPolicy(), seed=3, group_ms=0.0)
    (run,) = journal.runs()
    return run.run_id


@pytest.mark.parametrize("after", [2, 3, 4, 6])
def test_an_interrupt_while_a_group_is_compacted_leaves_a_journal_that_verifies(
    tmp_path: Path, after: int
) -> None:
    """The run ends `stopped` with the interrupted step written after all (the closing flush
    commits it), and every stored row resolves: before, the closing flush wrote the step's
    request as a delta of itself, and verify reported "request of seq 2 based on seq 26" and
    the like after a real signal."""
    InterruptedWhileCompacting.after = after
    with InterruptedWhileCompacting(tmp_path / "j.db") as j:
        run = _record(j)
        report = verify_journal(j)
        assert report.ok, report.problems[:3]
        assert j.status(run) == "stopped"
        kinds = [type(e).__name__ for e in j.events(run)]
        assert kinds[-1] == "RunEnded"
        assert kinds.count("LlmCall") == after - 1  # the interrupted step was kept


@pytest.mark.parametrize("after", [1, 2, 3])
def test_an_interrupt_after_the_commit_still_closes_the_run(tmp_path: Path, after: int) -> None:
    """The group is in the journal though its append raised; the closing RunEnded goes after it
    (the recorder's head was behind it: the run was left `recording`, its closing refused as
    a lost race). `after=1` is the transaction that creates the run with its opening."""
    InterruptedAfterCommit.after = after
    with InterruptedAfterCommit(tmp_path / "j.db") as j:
        run = _record(j)
        assert j.status(run) == "stopped"
        report = verify_journal(j)
        assert report.ok, report.problems[:3]
        assert [type(e).__name__ for e in j.events(run)].count("RunEnded") == 1


def test_an_interrupt_as_a_recorded_programs_run_is_created_closes_it(tmp_path: Path) -> None:
    """`car record`: the run and its RunStarted commit, then the Ctrl-C comes out of the COMMIT
    (before the program starts). The run was left `recording` without a single event (made in
    one transaction, its RunStarted appended in the next); now it is made with its RunStarted
    and closed `stopped`. The upstream only has to accept connections: no call is made."""
    import socket
    import sys

    from engine.program.session import record

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        InterruptedAfterCommit.after = 1
        with InterruptedAfterCommit(tmp_path / "j.db") as j:
            with pytest.raises(KeyboardInterrupt):
                record(j, [sys.executable, "-c", "pass"], upstream=f"http://127.0.0.1:{port}/v1")
            (run,) = j.runs()
            assert j.status(run.run_id) == "stopped"
            kinds = [type(e).__name__ for e in j.events(run.run_id)]
            assert kinds == ["RunStarted", "RunEnded"], kinds
            report = verify_journal(j)
            assert report.ok, report.problems[:3]


class LostBeforeCommit(Journal):
    """Raises KeyboardInterrupt from its next insert once `lose` is set, after the rows were
    inserted and before the COMMIT: the step is rolled back."""

    lose = False

    def _insert(self, cur: Any, run_id: str, rows: Any, texts: Any, state: int) -> int:
        head = super()._insert(cur, run_id, rows, texts, state)
        if LostBeforeCommit.lose:
            LostBeforeCommit.lose = False
            raise KeyboardInterrupt
        return head


def test_an_append_past_a_step_that_was_rolled_back_is_refused(tmp_path: Path) -> None:
    """A caller that takes a rolled-back step for written and appends after it gets one error
    naming the missing event. The writer kept the chain hash its insert had cached for the
    lost rows, chained the next step to them and wrote it past a gap (`car verify`: "events
    1..2 removed")."""
    from engine import events as ev
    from engine.errors import JournalError

    with LostBeforeCommit(tmp_path / "j.db") as j:
        run = j.create_run("x")
        head = j.append(run, [ev.ChatMessage(step=0, agent="a", text="one")], 0)
        LostBeforeCommit.lose = True
        lost = [ev.ChatMessage(step=1, agent="a", text=t) for t in ("two", "three")]
        with pytest.raises(KeyboardInterrupt):
            j.append(run, lost, head)
        with pytest.raises(JournalError, match="has no event at seq 2"):
            j.append(run, [ev.ChatMessage(step=2, agent="a", text="four")], head + 2)
        assert j.head(run) == head
        report = verify_journal(j)
        assert report.ok, report.problems[:3]
