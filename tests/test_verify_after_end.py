"""Nothing but its one accusation follows a run's end: a second `RunEnded` (another status,
another outcome) or a step appended after it, with a chain as valid as any, changes what
`car runs` and `car show` report, and `car verify` names it."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

from journal_helpers import car

from engine import events as ev
from engine.heist.session import accuse_run, record_heist
from engine.heist.sim import SimPolicy
from engine.journal import Journal


def _heist(path: Path) -> str:
    with Journal(path) as j:
        return record_heist(j, SimPolicy(), seed=7, rounds=1).run_id


def test_an_accusation_after_the_end_is_history(tmp_path: Path) -> None:
    """The one event a writer appends to an ended run: `car verify` says OK."""
    path = tmp_path / "j.db"
    run = _heist(path)
    with Journal(path) as j:
        accuse_run(j, run, "intel")
    res = car(path, "verify")
    assert res.returncode == 0 and res.stdout.startswith("OK"), res.stdout + res.stderr


def _forging() -> mock._patch[object]:
    """A writer without the journal's end rule (an older `car`, or anyone writing the file
    with their own code): `Journal.append` itself refuses these events (decision 49), so
    they are forged by switching its rule off, the one way to write them with this code."""
    return mock.patch("engine.journal.after_end", lambda _run, _events, state, _seq: state)


def test_an_end_or_a_step_after_the_end_is_a_finding(tmp_path: Path) -> None:
    """A second RunEnded (the failed heist made `completed` with a good outcome), a message
    after the end, and a second accusation, written by a forger: each a finding naming its
    seq, exit 1."""
    cases = {
        "second end": [ev.RunEnded(status="completed", outcome={"bad": False, "score": 1.0})],
        "a step": [ev.ChatMessage(step=6, agent="planner", text="all is well")],
    }
    for name, events in cases.items():
        path = tmp_path / f"{name.replace(' ', '-')}.db"
        run = _heist(path)
        with Journal(path) as j, _forging():
            head = j.head(run)
            j.append(run, events, head)
        res = car(path, "verify")
        assert res.returncode == 1, (name, res.stdout, res.stderr)
        assert f"seq {head}" in res.stdout + res.stderr and "after the run's end" in res.stdout
    path = tmp_path / "twice.db"
    run = _heist(path)
    with Journal(path) as j:
        accuse_run(j, run, "intel")
        head = j.head(run)
        again = ev.SuspicionDeclared(suspect=None, verdict="FAILURE", mole="x", strategy="y")
        with _forging():
            j.append(run, [again], head)
    res = car(path, "verify")
    assert res.returncode == 1 and "suspicion_declared after the run's end" in res.stdout
