"""`car record -- CMD` under the signals a terminal sends, delivered as a terminal delivers them:
to car's whole process group (car is started as the leader of a group of its own, so the test
can signal that group as the terminal's foreground job without signalling pytest).

* Ctrl-C (SIGINT to the group): car's one line and exit 130, never the program's own
  KeyboardInterrupt traceback; the program and its children are gone, the run is closed
  `stopped` with every call journaled before it;
* the terminal closing (SIGHUP): the same, the run never left `recording`;
* Ctrl-Z (SIGTSTP): the program stops with car and goes on with it;
* a SIGKILL of car alone: the program gets SIGTERM from the kernel and ends;
* on a real (pseudo-)terminal: the program reads what is typed, and a typed Ctrl-C is car's
  one line.

Real processes, a real HTTP upstream (tests/program_helpers.py), a real SQLite journal."""

from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from program_helpers import SLOW_WHEN_FORKED, CannedServer

from engine import events as ev
from engine.journal import Journal

ROOT = Path(__file__).resolve().parent.parent
INTERRUPTED = "interrupted: the program was stopped; run closed as stopped"

# One call, a child process of its own, a line on stderr, then waits for `go` (or forever)
# and makes a second call.
PROGRAM = """
import json, os, subprocess, sys, time
from openai import OpenAI
here = sys.argv[1]
c = OpenAI(max_retries=0)
c.chat.completions.create(model="m", messages=[{"role": "user", "content": "one"}])
kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
with open(os.path.join(here, "pids.json"), "w") as f:
    json.dump({"program": os.getpid(), "child": kid.pid}, f)
print("the program's own stderr line", file=sys.stderr, flush=True)
print("called", flush=True)
while not os.path.exists(os.path.join(here, "go")):
    time.sleep(0.05)
c.chat.completions.create(model="m", messages=[{"role": "user", "content": "two"}])
kid.kill()
print("done", flush=True)
"""


@pytest.fixture(scope="module")
def canned() -> CannedServer:
    with CannedServer() as s:
        yield s


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "OPENAI_BASE_URL")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _start(tmp_path: Path, url: str) -> subprocess.Popen[str]:
    """`car record` as a terminal's foreground job: the leader of its own process group,
    once its program has made its first call and started its child."""
    prog = tmp_path / "prog.py"
    prog.write_text(PROGRAM)
    p = subprocess.Popen(
        [sys.executable, "-m", "cli", "--journal", str(tmp_path / "j.db"), "record",
         "--base-url", url, "--", sys.executable, str(prog), str(tmp_path)],
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        process_group=0,
    )  # fmt: skip
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "called"
    return p


def _pids(tmp_path: Path) -> dict[str, int]:
    got: dict[str, int] = json.loads((tmp_path / "pids.json").read_text())
    return got


def _state(pid: int) -> str | None:
    """The process's state letter (R, S, T, Z ...), None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def _wait_for(what: str, cond: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.05)


def _gone(pid: int) -> bool:
    return _state(pid) in (None, "Z")


def _kill_leftovers(*pids: int) -> None:
    for pid in pids:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)


def _check_run(tmp_path: Path, status: str, calls: int) -> list[ev.AnyEvent]:
    """The journal's one run has `status` and `calls` LLM calls; its events."""
    with Journal(tmp_path / "j.db") as j:
        (info,) = j.runs()
        assert j.status(info.run_id) == status
        events = j.events(info.run_id)
    assert sum(isinstance(e, ev.LlmCall) for e in events) == calls
    return events


def _check_stopped(tmp_path: Path, calls: int) -> None:
    end = _check_run(tmp_path, "stopped", calls)[-1]
    assert isinstance(end, ev.RunEnded) and end.status == "stopped"


@pytest.mark.parametrize(
    ("sig", "code"),
    [(signal.SIGINT, 130), (signal.SIGHUP, 130), (signal.SIGTERM, 130)],
    ids=["ctrl-c", "hangup", "term"],
)
def test_a_terminal_signal_is_car_s_one_line_and_stops_the_program(
    tmp_path: Path, canned: CannedServer, sig: int, code: int
) -> None:
    """SIGINT, SIGHUP or SIGTERM to the foreground job (car and, before, its program with it)
    while the program runs: the program printed its own stderr line untouched, then car says
    one line - no KeyboardInterrupt traceback of the program's - and exits 130; the program and
    the child it started are gone; the run is closed `stopped` with the call it made."""
    p = _start(tmp_path, canned.base_url)
    pids = _pids(tmp_path)
    try:
        os.killpg(p.pid, sig)
        stdout, stderr = p.communicate(timeout=60)
        assert p.returncode == code, stderr
        assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
        assert stderr.splitlines() == ["the program's own stderr line", INTERRUPTED]
        assert stdout == ""
        _wait_for("the program is gone", lambda: _gone(pids["program"]))
        _wait_for("the program's child is gone", lambda: _gone(pids["child"]))
    finally:
        p.kill()
        _kill_leftovers(pids["program"], pids["child"])
    _check_stopped(tmp_path, calls=1)


def test_a_sigkill_of_car_alone_ends_the_program_too(tmp_path: Path, canned: CannedServer) -> None:
    """SIGKILL to car's process only (not its group: an OOM killer, `kill -9 PID`), which car
    cannot catch to stop its program: the kernel sends the program SIGTERM (its parent-death
    signal, set by the launcher before the program's exec), so it does not wait on a proxy that
    is gone; the run is left for the writer lease to tell (`abandoned`) with its one call."""
    p = _start(tmp_path, canned.base_url)
    pids = _pids(tmp_path)
    try:
        assert _state(pids["program"]) is not None
        os.kill(p.pid, signal.SIGKILL)
        # wait, not communicate: the program's child holds car's output pipes open
        assert p.wait(timeout=60) == -signal.SIGKILL
        _wait_for("the program is gone", lambda: _gone(pids["program"]))
    finally:
        p.kill()
        _kill_leftovers(pids["program"], pids["child"])
    _check_run(tmp_path, "abandoned", calls=1)


def test_ctrl_z_stops_the_program_with_car_and_fg_continues_both(
    tmp_path: Path, canned: CannedServer
) -> None:
    """SIGTSTP to the foreground job stops car and its program (and its child), SIGCONT (`fg`)
    continues them: the program then makes its second call and the run completes with both.
    (The program runs in a session of its own, so car passes the stop on.)"""
    p = _start(tmp_path, canned.base_url)
    pids = _pids(tmp_path)
    try:
        os.killpg(p.pid, signal.SIGTSTP)
        for who in ("program", "child"):
            _wait_for(f"the {who} is stopped", lambda w=who: _state(pids[w]) == "T")  # type: ignore[misc]
        _wait_for("car is stopped", lambda: _state(p.pid) == "T")
        (tmp_path / "go").touch()
        time.sleep(0.5)
        assert _state(pids["program"]) == "T"  # stopped, it cannot have seen `go`
        os.killpg(p.pid, signal.SIGCONT)
        stdout, stderr = p.communicate(timeout=60)
        assert p.returncode == 0, stderr
        assert stdout.splitlines()[0] == "done", stdout
    finally:
        p.kill()
        _kill_leftovers(pids["program"], pids["child"])
    _check_run(tmp_path, "completed", calls=2)


def test_ctrl_c_during_a_fork_is_one_line_without_the_branch_s_traceback(
    tmp_path: Path, canned: CannedServer
) -> None:
    """Ctrl-C to the foreground job while a fork's branch program runs: exit 130, car's one
    line, no traceback of the branch program's; the branch is closed `stopped`."""
    prog = tmp_path / "slow.py"
    prog.write_text(SLOW_WHEN_FORKED)
    journal = tmp_path / "j.db"
    r = subprocess.run(
        [sys.executable, "-m", "cli", "--journal", str(journal), "record", "--base-url",
         canned.base_url, "--json", "--", sys.executable, str(prog)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    run_id = json.loads(r.stdout)["run_id"]
    p = subprocess.Popen(
        [sys.executable, "-m", "cli", "--journal", str(journal), "fork", run_id, "--at", "1",
         "--do", "resample", "-n", "3", "--", sys.executable, str(prog)],
        cwd=ROOT, env={**_env(), "SLOW": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, process_group=0,
    )  # fmt: skip
    try:
        assert p.stderr is not None
        assert p.stderr.readline().strip() == "called"
        os.killpg(p.pid, signal.SIGINT)
        _, stderr = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert len(stderr.strip().splitlines()) == 1, stderr
    assert stderr.strip().startswith("interrupted"), stderr
    with Journal(journal) as j:
        (kid,) = j.children(run_id)
        assert j.status(kid.run_id) == "stopped"


READS_THE_TERMINAL = """
import sys
from openai import OpenAI
OpenAI(max_retries=0).chat.completions.create(model="m", messages=[{"role": "user", "content": ""}])
print("tty", sys.stdin.isatty(), flush=True)
print("got", repr(input("name? ")), flush=True)
input("again? ")
"""


def test_on_a_real_terminal_the_program_reads_it_and_a_typed_ctrl_c_is_one_line(
    tmp_path: Path, canned: CannedServer
) -> None:
    """`car record` on a pseudo-terminal that is its controlling terminal, as in a shell: the
    program (in a session of its own) still reads what is typed there, and a Ctrl-C typed
    there (the terminal's own SIGINT to its foreground job) gives car's one line, no traceback
    of the program's, exit 130 and the run closed `stopped` with its call."""
    prog = tmp_path / "ask.py"
    prog.write_text(READS_THE_TERMINAL)
    master, slave = os.openpty()

    def controlling_terminal() -> None:
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    p = subprocess.Popen(
        [sys.executable, "-m", "cli", "--journal", str(tmp_path / "j.db"), "record",
         "--base-url", canned.base_url, "--", sys.executable, str(prog)],
        cwd=ROOT, env=_env(), stdin=slave, stdout=slave, stderr=slave,
        preexec_fn=controlling_terminal,  # two syscalls between fork and exec
    )  # fmt: skip
    os.close(slave)
    seen = bytearray()

    def read_until(text: bytes, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in seen:
            assert time.monotonic() < deadline, f"no {text!r} in {bytes(seen)!r}"
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    seen.extend(os.read(master, 4096))
                except OSError:  # the terminal's last writer is gone
                    assert text in seen, bytes(seen)

    try:
        read_until(b"name? ")
        os.write(master, b"alice\n")
        read_until(b"again? ")
        os.write(master, b"\x03")  # Ctrl-C, typed
        read_until(b"closed as stopped")
        assert p.wait(timeout=60) == 130
    finally:
        p.kill()
        os.close(master)
    text = bytes(seen).decode().replace("\r\n", "\n")
    assert "tty True\n" in text and "got 'alice'\n" in text, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    assert text.endswith("interrupted: the program was stopped; run closed as stopped\n"), text
    _check_stopped(tmp_path, calls=1)
