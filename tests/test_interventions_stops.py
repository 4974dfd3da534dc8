"""The stop and failure paths of engine/interventions.py, run in this process (so mutation
testing links them): closing branches left `recording`, a stop requested in the middle of a
fork, a branch stuck in a call to a server that never answers, and branches whose policy fails.

The stop request is `STOP.set()`, exactly what the command's SIGINT handler does
(engine/workers.py); the real-signal tests of the same promises are in test_interrupts.py.

Tests whose branches log errors capture the log (structlog.testing.capture_logs): the logger
writes to the stderr it found when it was first configured, which a test runner that runs
pytest more than once in one process (mutmut) has closed by the second run."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from engine import events as ev
from engine import interventions as iv_mod
from engine.heist.session import record_heist
from engine.heist.sim import SimPolicy
from engine.interventions import (
    BranchRunner,
    BranchSpec,
    DoPolicy,
    DoResample,
    _branch_in,
    branch_base,
    branch_key,
    branch_label,
    branch_seed_for,
    close_open_branches,
    close_stopped,
    fork_many,
    parent_info,
)
from engine.journal import Journal
from engine.workers import STOP, Interrupted


@pytest.fixture
def recorded(tmp_path: Path) -> Iterator[tuple[Journal, str]]:
    j = Journal(tmp_path / "j.db")
    r = record_heist(j, SimPolicy(), seed=4, rounds=1)
    yield j, r.run_id
    j.close()


@pytest.fixture(autouse=True)
def no_stop_left() -> Iterator[None]:
    """Every test starts and ends without a stop request (STOP is process-wide)."""
    STOP.clear()
    yield
    STOP.clear()


def open_branch(j: Journal, run: str, k: int, label: str) -> str:
    """A branch whose writer went away after its opening: forked, Intervention journaled,
    never ended (what a killed worker leaves behind)."""
    base = branch_base(j, parent_info(j, run), k)
    child = j.fork(run, base.fork_seq, label=label)
    opening = ev.Intervention(step=k, op="resample", at=k, value=None, branch_seed=1)
    j.append(child, [opening], base.fork_seq)
    return child


def own_tail(j: Journal, run: str, n: int) -> list[ev.AnyEvent]:
    return j.events(run)[-n:]


def test_close_stopped_ends_a_recording_branch(recorded: tuple[Journal, str]) -> None:
    """A branch left recording is closed with Control(stop, "interrupted") and
    RunEnded(stopped), appended after its own events; closing it again appends nothing."""
    j, run = recorded
    child = open_branch(j, run, 2, "x")
    head = j.head(child)
    assert j.status(child) == "recording"
    assert close_stopped(j, child) is True
    assert j.status(child) == "stopped"
    assert j.head(child) == head + 2
    stop, end = own_tail(j, child, 2)
    assert isinstance(stop, ev.Control) and (stop.action, stop.reason) == ("stop", "interrupted")
    assert isinstance(end, ev.RunEnded) and end.status == "stopped"
    assert close_stopped(j, child) is False
    assert j.head(child) == head + 2
    assert j.verify().ok


def test_close_stopped_of_a_paused_branch_with_a_reason(recorded: tuple[Journal, str]) -> None:
    """A paused branch is open too: it is closed, with the reason given."""
    j, run = recorded
    child = open_branch(j, run, 1, "y")
    j.append(child, [ev.Control(action="pause", reason="")], j.head(child))
    assert j.status(child) == "paused"
    assert close_stopped(j, child, reason="writer gone") is True
    stop, end = own_tail(j, child, 2)
    assert isinstance(stop, ev.Control) and stop.reason == "writer gone"
    assert isinstance(end, ev.RunEnded) and end.status == "stopped"


def test_close_stopped_leaves_ended_runs_alone(recorded: tuple[Journal, str]) -> None:
    """A completed run (the parent) is not touched."""
    j, run = recorded
    head = j.head(run)
    assert close_stopped(j, run) is False
    assert (j.head(run), j.status(run)) == (head, "completed")


def test_close_open_branches_picks_by_label_time_and_result(recorded: tuple[Journal, str]) -> None:
    """After an interrupt only this command's open branches are closed: those with one of its
    labels, created at or after its start (the boundary included), without a result. Others
    stay as they are, and the count says how many were closed."""
    j, run = recorded
    before = open_branch(j, run, 1, "mine")  # an older command's branch with the same label
    time.sleep(0.002)
    at_start = open_branch(j, run, 1, "mine")
    since = j.run(at_start).created_at
    later = open_branch(j, run, 2, "mine")
    other = open_branch(j, run, 2, "not mine")
    finished = open_branch(j, run, 3, "mine")
    assert j.run(before).created_at < since
    n = close_open_branches(j, run, {"mine"}, since, {finished})
    assert n == 2
    assert j.status(at_start) == j.status(later) == "stopped"
    assert j.status(before) == j.status(other) == j.status(finished) == "recording"


def test_stop_between_branches_ends_the_fork(recorded: tuple[Journal, str]) -> None:
    """A stop requested after the first of three branches ends the fork with Interrupted:
    the branch that finished stays completed, no later branch is started, nothing is left
    recording."""
    j, run = recorded
    parent = parent_info(j, run)
    specs = [BranchSpec(DoResample(2), branch_seed_for(3, i)) for i in range(3)]
    seen: list[int] = []

    def progress(done: int, total: int) -> None:
        seen.append(done)
        STOP.set()

    with pytest.raises(Interrupted) as caught, BranchRunner(j, parent) as runner:
        runner.run(specs, progress)
    assert caught.value.message == "interrupted: 0 open branches closed as stopped"
    assert str(caught.value) == caught.value.message
    children = j.children(run)
    assert seen == [1] and len(children) == 1
    assert j.status(children[0].run_id) == "completed"


def test_stop_closes_a_branch_a_lost_worker_left_open(recorded: tuple[Journal, str]) -> None:
    """A branch of this fork left recording by a worker that is gone (planted here: the
    second spec's branch, made after the runner started) is found by its label and closed on
    the stop, and the fork counts it."""
    j, run = recorded
    parent = parent_info(j, run)
    specs = [BranchSpec(DoResample(2), branch_seed_for(3, i)) for i in range(2)]
    runner = BranchRunner(j, parent)
    time.sleep(0.002)
    key = branch_key(run, specs[1].iv, specs[1].branch_seed, None, None)
    planted = open_branch(j, run, 2, branch_label(specs[1].iv, key))
    with pytest.raises(Interrupted) as caught, runner:
        runner.run(specs, lambda done, total: STOP.set())
    assert caught.value.message == "interrupted: 1 open branches closed as stopped"
    assert j.status(planted) == "stopped"
    assert [j.status(c.run_id) for c in j.children(run)].count("completed") == 1


def test_stop_inside_a_branch_closes_it_stopped(recorded: tuple[Journal, str]) -> None:
    """A stop requested while a branch runs (here: right after its opening is journaled; the
    journal's append is wrapped only to pick that moment) ends that branch at its next step
    as stopped, and the fork says one branch was closed."""
    j, run = recorded
    parent = parent_info(j, run)
    specs = [BranchSpec(DoResample(2), branch_seed_for(3, i)) for i in range(2)]
    real_append = j.append

    def append(run_id: str, events: list[ev.Event], *a: object, **kw: object) -> int:
        head = real_append(run_id, events, *a, **kw)  # type: ignore[arg-type]
        if any(isinstance(e, ev.Intervention) for e in events):
            STOP.set()  # as SIGINT would, between two steps of the branch
        return head

    j.append = append  # type: ignore[method-assign]
    try:
        with pytest.raises(Interrupted) as caught, BranchRunner(j, parent) as runner:
            runner.run(specs)
    finally:
        del j.append
    assert caught.value.message == "interrupted: 1 open branches closed as stopped"
    (child,) = j.children(run)
    assert j.status(child.run_id) == "stopped"
    fork_seq = j.run(child.run_id).fork_seq
    own = [s.event for s in j.read(child.run_id, fork_seq or 0)]
    assert [type(e).__name__ for e in own] == ["Intervention", "Control", "RunEnded"]
    assert isinstance(own[1], ev.Control) and own[1].reason == "interrupted"


def test_branch_of_a_bad_policy_override_fails_without_a_run(
    recorded: tuple[Journal, str],
) -> None:
    """A policy override the policy cannot take makes the branch job fail with the reason,
    before any branch is forked."""
    j, run = recorded
    before = len(j.children(run))
    r = _branch_in(j, parent_info(j, run), BranchSpec(DoResample(1), 5), {"drift": 7.0})
    assert (r.run_id, r.status, r.bad, r.reused) == ("", "failed", None, False)
    assert r.error == (
        "bad sim policy spec {'name': 'sim', 'drift': 7.0}: "
        "drift must be a probability in [0, 1], got 7.0"
    )
    assert len(j.children(run)) == before


def _dead_port() -> int:
    """A local port nothing listens on (bound, then closed: connections are refused)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


def test_do_policy_branches_whose_server_is_gone_fail(recorded: tuple[Journal, str]) -> None:
    """do_policy to a server that refuses connections: every branch is journaled as failed
    with the server's address in its error, has no outcome, and the report scores none."""
    j, run = recorded
    url = f"http://127.0.0.1:{_dead_port()}/v1"
    spec = {"name": "openai", "base_url": url, "model": "m", "max_retries": 0, "timeout": 5.0}
    with capture_logs():  # what is logged depends on the level other tests set
        rep = fork_many(j, run, DoPolicy(2, spec), 2, seed=1)
    assert [b.status for b in rep.branches] == ["failed", "failed"]
    assert all(b.bad is None and b.run_id for b in rep.branches)
    assert all((b.error or "").startswith(f"LLM server {url!r}") for b in rep.branches)
    assert (rep.scored, rep.bad, rep.bad_rate, rep.ci) == (0, 0, None, None)
    for b in rep.branches:
        assert j.status(b.run_id) == "failed"
        *_, call, end = j.events(b.run_id)
        assert isinstance(end, ev.RunEnded) and end.error == b.error
        # the failed request is journaled with the server it went to
        assert isinstance(call, ev.LlmCall) and call.server == url


class Hang:
    """A real TCP server that accepts connections and never answers."""

    def __init__(self) -> None:
        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(8)
        self.accepted: list[socket.socket] = []
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}/v1"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                self.accepted.append(self.server.accept()[0])

    def close(self) -> None:
        self.server.close()
        for s in self.accepted:
            with contextlib.suppress(OSError):
                s.close()


def test_stop_while_a_do_policy_branch_hangs(recorded: tuple[Journal, str]) -> None:
    """do_policy with a server-backed policy runs its branches in threads, so a stop while a
    call hangs still ends the fork within a few seconds, and the fork itself closes the branch
    stuck in its call: stopped, with Control(stop, "interrupted"), nothing left recording,
    even after the stuck call returns and its writer finds the run closed."""
    j, run = recorded
    hang = Hang()
    spec = {"name": "openai", "base_url": hang.url, "model": "m", "max_retries": 0}
    spec["timeout"] = 30.0

    def stop_once_inside() -> None:
        deadline = time.monotonic() + 20
        while not hang.accepted and time.monotonic() < deadline:
            time.sleep(0.02)
        STOP.set()

    threading.Thread(target=stop_once_inside, daemon=True).start()
    t0 = time.monotonic()
    # the stuck branch's writer logs what it could not write once its call returns
    with capture_logs():
        try:
            with pytest.raises(Interrupted) as caught:
                fork_many(j, run, DoPolicy(2, spec), 2, seed=1)
            took = time.monotonic() - t0
        finally:
            hang.close()
            deadline = time.monotonic() + 20
            while iv_mod._open and time.monotonic() < deadline:  # the stuck call returns
                time.sleep(0.02)
    assert hang.accepted, "no request reached the server"
    assert took < 10, f"the fork took {took:.1f} s to stop"
    assert caught.value.message == "interrupted: 1 open branches closed as stopped"
    children = j.children(run)
    assert len(children) == 1
    child = children[0].run_id
    assert j.status(child) == "stopped"
    own = [e for e in j.events(child) if isinstance(e, ev.Control | ev.RunEnded)]
    assert isinstance(own[-2], ev.Control) and own[-2].reason == "interrupted"
    assert isinstance(own[-1], ev.RunEnded) and own[-1].status == "stopped"
    assert not iv_mod._open
    assert j.verify().ok


def test_core_branch_of_a_programs_run_is_refused(recorded: tuple[Journal, str]) -> None:
    """A run of a recorded program (its scenario drives its own steps) cannot be branched by
    the core's step loop: the branch job fails in one line saying what refused and why, and
    no branch is made."""
    import msgspec

    j, run = recorded
    events = j.events(run)
    started = msgspec.structs.replace(
        events[0], scenario="program", config={"command": ["python", "x.py"]}
    )
    prog = j.create_run("program")
    j.append(prog, [started, *(e for e in events[1:] if not isinstance(e, ev.MoleAssigned))], 0)
    r = _branch_in(j, parent_info(j, prog), BranchSpec(DoResample(1), 5), None)
    assert (r.run_id, r.status) == ("", "failed")
    assert (r.error or "").startswith(
        "a branch of the core's step loop rebuilds each step from s_k, and a 'program' run "
        "drives its own steps: "
    )
    assert "\n" not in (r.error or "") and j.children(prog) == []


class Seeing:
    """The local executor, also keeping the labels each map call was given."""

    name = "seeing"

    def __init__(self) -> None:
        from engine.executors.local import LocalExecutor

        self.inner = LocalExecutor("inline", 1)
        self.labels: list[set[str]] = []

    def map(self, journal, parent, job, args, on_done, labels=()):  # type: ignore[no-untyped-def]
        self.labels.append(set(labels))
        self.inner.map(journal, parent, job, args, on_done, labels)

    def stats(self):  # type: ignore[no-untyped-def]
        return self.inner.stats()

    def close(self, interrupted: bool = False) -> None:
        self.inner.close(interrupted)


def test_executor_is_told_the_branch_labels(recorded: tuple[Journal, str]) -> None:
    """A lent executor is given the labels of the branches it runs (a remote one closes a
    lost worker's branches by them): one per spec, as the branches are then labelled."""
    j, run = recorded
    parent = parent_info(j, run)
    specs = [BranchSpec(DoResample(2), branch_seed_for(8, i)) for i in range(2)]
    seeing = Seeing()
    with BranchRunner(j, parent, executor=seeing) as runner:  # type: ignore[arg-type]
        out = runner.run(specs)
        assert runner.mode == "seeing"
    want = {branch_label(s.iv, branch_key(run, s.iv, s.branch_seed, None, None)) for s in specs}
    assert seeing.labels == [want]
    assert {j.run(b.run_id).label for b in out} == want


def test_a_ctrl_c_behind_another_error_ends_the_fork_as_a_stop(
    recorded: tuple[Journal, str],
) -> None:
    """A Ctrl-C that reaches the fork as another error (Python 3.11 re-raises one that lands
    while a class body's descriptor is named, as in a module imported lazily, as RuntimeError;
    produced here for real from the progress callback after the first branch) ends it as a
    Ctrl-C does: Interrupted with its line, the finished branch kept, nothing left recording."""
    j, run = recorded
    parent = parent_info(j, run)
    specs = [BranchSpec(DoResample(2), branch_seed_for(3, i)) for i in range(3)]

    class Named:
        def __set_name__(self, owner: type, name: str) -> None:
            raise KeyboardInterrupt

    def progress(done: int, total: int) -> None:
        type("Module", (), {"field": Named()})

    with pytest.raises(Interrupted) as caught, BranchRunner(j, parent) as runner:
        runner.run(specs, progress)
    assert caught.value.message == "interrupted: 0 open branches closed as stopped"
    statuses = [j.status(c.run_id) for c in j.children(run)]
    assert statuses == ["completed"]
