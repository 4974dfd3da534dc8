"""Ctrl-C and kill -9 of the counterfactual commands, as real processes with real signals.

Every test starts `car` as a subprocess in its own session, waits until it is doing real work
(branches appear in the journal), then signals it and checks: the exit status and the single
line on stderr, how long it took, that no process of its session survives, and that no branch
is left `recording`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from engine.heist.session import record_heist
from engine.heist.sim import SimPolicy
from engine.journal import Journal

ROOT = Path(__file__).resolve().parent.parent


def start(journal: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "cli", "--journal", str(journal), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: we can find every child it made
    )


def session_pids(sid: int) -> list[int]:
    """Live processes of session `sid` (zombies excluded)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        state, session = fields[0], int(fields[3])
        if session == sid and state != "Z":
            pids.append(int(entry.name))
    return pids


def branch_count(journal: Path, run: str) -> int:
    with Journal(journal, create=False) as j:
        return len(j.children(run))


def wait_for_branches(journal: Path, run: str, before: int, proc: subprocess.Popen[str]) -> None:
    """Until the command has made at least two new branches (it is in the middle of its work)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if branch_count(journal, run) >= before + 2:
            return
        time.sleep(0.05)
    raise AssertionError("the command made no branches within 60 s")


def open_branches(journal: Path, run: str) -> list[str]:
    with Journal(journal, create=False) as j:
        return [c.run_id for c in j.children(run) if j.status(c.run_id) == "recording"]


def gone_within(sid: int, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = session_pids(sid)
        if not left:
            return []
        time.sleep(0.05)
    return session_pids(sid)


COMMANDS = [
    ("fork -c 2", ["fork", "RUN", "--at", "2", "--do", "resample", "-n", "400", "-c", "2"]),
    ("fork -c 1", ["fork", "RUN", "--at", "2", "--do", "resample", "-n", "400"]),
    ("attribute -c 2", ["attribute", "RUN", "--all-steps", "--seed", "SEED", "-c", "2"]),
    ("attribute -c 1", ["attribute", "RUN", "--all-steps", "--seed", "SEED"]),
]


@pytest.mark.parametrize(("name", "argv"), COMMANDS, ids=[c[0] for c in COMMANDS])
def test_ctrl_c_stops_quickly_and_closes_open_branches(
    failed_heist: tuple[Path, str], name: str, argv: list[str]
) -> None:
    """SIGINT in the middle of the work: exit 130 within 2 s with one line on stderr, no
    process of the command left, and every branch it opened closed as stopped."""
    journal, run = failed_heist
    seed = str(zlib.crc32(name.encode()) % 10_000)
    args = [run if a == "RUN" else seed if a == "SEED" else a for a in argv]
    before = branch_count(journal, run)
    proc = start(journal, *args)
    wait_for_branches(journal, run, before, proc)
    t0 = time.monotonic()
    # the terminal sends SIGINT to the whole foreground process group
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=10)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 130, stderr
    assert elapsed < 2.0, f"{name}: took {elapsed:.2f} s to stop"
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("interrupted"), stderr
    assert "Traceback" not in stderr
    assert gone_within(proc.pid, 2.0) == []
    assert open_branches(journal, run) == []
    with Journal(journal, create=False) as j:
        stopped = [c for c in j.children(run) if j.status(c.run_id) == "stopped"]
        for c in stopped[-3:]:
            kinds = [s.kind for s in j.read(c.run_id)][-2:]
            assert kinds == ["control", "run_ended"], kinds
        assert j.verify().ok


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_term_or_hangup_stops_like_ctrl_c(failed_heist: tuple[Path, str], sig: int) -> None:
    """SIGTERM (a supervisor) and SIGHUP (the terminal closed) in the middle of a fork end it
    as Ctrl-C does: one line, no process left, every branch it opened closed as stopped (a
    SIGHUP killed the command outright and left its open branches `recording`)."""
    journal, run = failed_heist
    before = branch_count(journal, run)
    proc = start(journal, "fork", run, "--at", "2", "--do", "resample", "-n", "400", "-c", "2")
    wait_for_branches(journal, run, before, proc)
    os.killpg(proc.pid, sig)
    _, stderr = proc.communicate(timeout=10)
    assert proc.returncode == 130, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("interrupted"), stderr
    assert gone_within(proc.pid, 2.0) == []
    assert open_branches(journal, run) == []


def test_kill_9_of_attribute_leaves_no_worker(failed_heist: tuple[Path, str]) -> None:
    """SIGKILL of `car attribute -c 2` (nothing can run in the killed process): its worker
    process notices and exits within a few seconds, closing its branch as stopped; the branch
    the command was running itself reads as abandoned (its writer is gone), never as
    recording."""
    journal, run = failed_heist
    for attempt in range(3):
        before = branch_count(journal, run)
        proc = start(journal, "attribute", run, "--all-steps", "--seed", str(500 + attempt))
        proc.kill()  # too early: nothing started yet, nothing may remain either
        proc.wait()
        assert gone_within(proc.pid, 3.0) == []
        proc = start(
            journal, "attribute", run, "--all-steps", "--seed", str(600 + attempt), "-c", "2"
        )
        wait_for_branches(journal, run, before, proc)
        assert len(session_pids(proc.pid)) >= 2  # the command and its worker
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        left = gone_within(proc.pid, 3.0)
        assert left == [], f"attempt {attempt}: worker processes {left} outlived the command"
    assert open_branches(journal, run) == []


def loaded(pid: int, library: str) -> bool:
    try:
        return library in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.parametrize("delay", [0.0, 0.02, 0.05, 0.1, 0.2])
def test_ctrl_c_while_starting_is_one_line(failed_heist: tuple[Path, str], delay: float) -> None:
    """SIGINT while the command is still importing and opening its journal: one line on
    stderr and exit 130, never a traceback. The signal is sent `delay` seconds after the
    program's own imports began (msgspec, the first compiled module it loads, is mapped);
    before that Python itself is still starting and reports a signal its own way."""
    journal, run = failed_heist
    proc = start(journal, "fork", run, "--at", "2", "--do", "resample", "-n", "5")
    deadline = time.monotonic() + 30
    while not loaded(proc.pid, "msgspec") and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    time.sleep(delay)
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=10)
    if proc.returncode == 0:
        return  # it finished before the signal arrived: nothing to interrupt
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert gone_within(proc.pid, 2.0) == []


@pytest.fixture(scope="module")
def long_heist(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A 9,000-step heist: long enough that re-executing it takes several seconds even on an
    idle, fast machine (1,800 steps took 1.0 s at -c 1, less than the wait before the signal)."""
    path = tmp_path_factory.mktemp("interrupts-long") / "j.db"
    with Journal(path) as j:
        run = record_heist(j, SimPolicy(), seed=3, rounds=1500).run_id
    return path, run


def _interrupt(journal: Path, argv: list[str], wait: float, within: float) -> None:
    """Start `car` with `argv`, send SIGINT `wait` seconds after its own start, and check that
    it stopped within `within` seconds with one line, exit 130 and no process left."""
    proc = start(journal, *argv)
    # the program's own start (msgspec mapped: its imports run, its SIGINT handler is set), not
    # a fixed delay: on a loaded machine Python itself may still be starting after a second
    deadline = time.monotonic() + 30
    while not loaded(proc.pid, "msgspec") and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(wait)
    if proc.poll() is not None:
        pytest.fail(f"finished before the signal: {proc.communicate()}")
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=10)
    assert proc.returncode == 130, stderr
    assert time.monotonic() - t0 < within
    assert stderr.strip() == "interrupted", stderr
    assert gone_within(proc.pid, 2.0) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["validate", "--budget", "2000000"],
        ["fidelity", "RUN", "-c", "2"],
        ["fidelity", "RUN"],
    ],
    ids=["validate", "fidelity -c 2", "fidelity"],
)
def test_ctrl_c_of_validate_and_fidelity(long_heist: tuple[Path, str], argv: list[str]) -> None:
    """validate and fidelity stop within 2 s of SIGINT with one line and exit 130."""
    journal, run = long_heist
    _interrupt(journal, [run if a == "RUN" else a for a in argv], wait=1.2, within=2.0)


@pytest.mark.parametrize(
    "argv",
    [
        ["attribute", "RUN"],
        ["fork", "RUN", "--at", "8000", "--do", "resample", "-n", "4"],
        ["fidelity", "RUN"],
    ],
    ids=["attribute", "fork", "fidelity"],
)
def test_ctrl_c_while_a_long_run_is_read_stops_at_once(
    long_heist: tuple[Path, str], argv: list[str]
) -> None:
    """Before its first forward run a command reads the whole parent run (its actions, its
    branch bases, every request): seconds for the 9,000-step heist, and Ctrl-C then stops it
    within a second, not once the reading is done (1.2-2.2 s after the signal, before each
    pass asked between two events). The signal comes 0.5 s after its imports, in the reading."""
    journal, run = long_heist
    _interrupt(journal, [run if a == "RUN" else a for a in argv], wait=0.5, within=1.0)


@pytest.mark.parametrize("concurrency", ["1", "2"])
def test_ctrl_c_while_the_server_hangs(failed_heist: tuple[Path, str], concurrency: str) -> None:
    """do_policy branches against a server that accepts the connection and never answers (a
    real socket, a real hang): Ctrl-C still ends the command within 2 s, exit 130, and the
    branches stuck in their call are closed as stopped by the command itself."""
    import socket
    import threading

    journal, run = failed_heist
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    accepted: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                accepted.append(server.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    url = f"http://127.0.0.1:{server.getsockname()[1]}/v1"
    try:
        before = branch_count(journal, run)
        proc = start(
            journal, "fork", run, "--at", "3", "--do", "policy", "--value",
            "openai:max_retries=0", "--base-url", url, "--timeout", "600", "-n", "4",
            "-c", concurrency,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while len(accepted) < int(concurrency):  # the branches are inside their call now
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no request reached the server"
            time.sleep(0.05)
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=10)
        assert proc.returncode == 130, stderr
        assert time.monotonic() - t0 < 2.0
        assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr
        assert gone_within(proc.pid, 2.0) == []
        assert branch_count(journal, run) >= before + int(concurrency)
        assert open_branches(journal, run) == []
    finally:
        server.close()
        for s in accepted:
            s.close()


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    """`code` run by this Python in a process of its own, from the project's root."""
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_two_threads_ending_the_process_write_one_line() -> None:
    """The wind-down timer and the command itself may both end the process on one Ctrl-C:
    only the first writes its line. The window between the first's line and the process's end
    is widened to 0.3 s (os._exit delayed in the child: the race is otherwise a matter of
    microseconds), and a second thread calls hard_exit inside it."""
    code = (
        "import os, threading, time\n"
        "from engine import workers\n"
        "real = os._exit\n"
        "def slow(code):\n"
        "    time.sleep(0.3)\n"
        "    real(code)\n"
        "os._exit = slow\n"
        "t = threading.Thread(target=workers.hard_exit, args=('from the timer',))\n"
        "threading.Timer(0.1, t.start).start()\n"
        "workers.hard_exit('interrupted')\n"
    )
    res = run_python(code)
    assert res.returncode == 130
    assert res.stderr.splitlines() == ["interrupted"]


def test_ctrl_c_as_the_command_ends_is_never_a_death_by_signal(
    failed_heist: tuple[Path, str],
) -> None:
    """SIGINT in the last moments of a command, around the time it takes to run: its output is
    written and its journal committed, and the interpreter is shutting down (when Python puts
    back the default SIGINT handler). The exit is 0 (the work was done) or 130 with one line,
    never death by the signal (-2) with no line. 30 signals spread over +-60 ms of the end."""
    journal, run = failed_heist
    argv = ["fork", run, "--at", "2", "--do", "resample", "-n", "3"]
    took = []
    for _ in range(3):
        t0 = time.monotonic()
        proc = start(journal, *argv)
        proc.communicate(timeout=60)
        assert proc.returncode == 0
        took.append(time.monotonic() - t0)
    end = sorted(took)[1]
    codes = []
    for i in range(30):
        proc = start(journal, *argv)
        time.sleep(max(0.0, end - 0.06 + 0.004 * i))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=10)
        codes.append(proc.returncode)
        if proc.returncode == 130:
            assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert all(c in (0, 130) for c in codes), codes
    assert open_branches(journal, run) == []


def _set_name_interrupted() -> BaseException:
    """What Python makes of a Ctrl-C that lands while a class body's descriptor is named (as
    in rich's ConsoleThreadLocals, imported lazily by a command that prints): on 3.11 a
    RuntimeError raised from the KeyboardInterrupt."""

    class Named:
        def __set_name__(self, owner: type, name: str) -> None:
            raise KeyboardInterrupt

    try:
        type("Owner", (), {"field": Named()})
    except BaseException as e:  # whatever this Python makes of it
        return e
    raise AssertionError("__set_name__ was not called")


def test_a_ctrl_c_that_came_out_as_another_error_is_found() -> None:
    """`interrupt_behind` finds the KeyboardInterrupt behind such an error (its cause, or the
    exception it was raised while handling), and nothing behind an ordinary error."""
    from engine.errors import interrupt_behind

    wrapped = _set_name_interrupted()
    found = interrupt_behind(wrapped)
    assert isinstance(found, KeyboardInterrupt)
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise ImportError("half an import") from None
    except ImportError as e:
        # `from None` hides the context from tracebacks, but it is still the user's Ctrl-C
        assert isinstance(interrupt_behind(e), KeyboardInterrupt)
    try:
        try:
            raise ValueError("first")
        except ValueError as inner:
            raise RuntimeError("second") from inner
    except RuntimeError as e:
        assert interrupt_behind(e) is None
    cyclic = RuntimeError("a")
    other = RuntimeError("b")
    cyclic.__context__, other.__context__ = other, cyclic
    assert interrupt_behind(cyclic) is None


def test_ctrl_c_while_the_workers_module_is_half_imported() -> None:
    """The CLI's SIGINT handler starts the wind-down deadline; it imported engine.workers to
    do so, and a Ctrl-C that arrived while that very module was being imported (a fork
    command starting) failed in the handler with "cannot import name 'hard_exit' from
    partially initialized module", a traceback and exit 1 (seen once in a fresh-clone CI).
    Here the half-imported module is stood in by an empty one (a signal cannot be aimed at
    one import): the handler still raises KeyboardInterrupt, and the deadline ends the
    process with one line and exit 130."""
    code = (
        "import sys, time, types\n"
        "import cli\n"
        "sys.modules['engine.workers'] = types.ModuleType('engine.workers')\n"
        "try:\n"
        "    cli._keyboard_interrupt(2, None)\n"
        "except KeyboardInterrupt:\n"
        "    pass\n"
        "time.sleep(30)\n"
    )
    r = run_python(code)
    assert r.returncode == 130, r.stderr
    assert r.stderr == "interrupted\n", r.stderr
