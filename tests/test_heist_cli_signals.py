"""`car heist` as a user runs it, in a real subprocess with real signals:

* text from a model or a tool is printed as data - never rich markup, never terminal control;
* Ctrl-C (SIGINT) at any moment, from the imports to the middle of an LLM call, exits 130
  within 2 s with one line on stderr and no traceback, and closes the run as `stopped`;
* a step is printed only once it is committed, so a kill (SIGKILL) never takes back a step
  the user already saw.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from servers import FaultyLLMServer, Request

from engine import events as ev
from engine.journal import Journal

CAR = Path(sys.executable).with_name("car")
HOSTILE = (
    "[/dim] [bold red]red?[/bold red] \x1b[2J\x1b]0;owned\x07 bell\x07 c1\x9b31m "
    "[TOOL:file_reader:rou\x1btes\x07.txt] [link=file:///etc/passwd]x[/link]"
)
STEP_LINE = re.compile(r"^\[\s*(\d+)\] ", re.M)
ENV = {**os.environ, "COLUMNS": "400"}  # no wrapping, so the text can be compared


def start(args: list[str], cwd: Path, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(CAR), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env={**ENV, **env},
    )


def hang(_: object, __: Request, release: object) -> None:
    release.wait(60)  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- printing


@pytest.mark.parametrize("color", [False, True], ids=["pipe", "force-color"])
def test_model_text_is_printed_as_data(tmp_path: Path, color: bool) -> None:
    """A model reply with rich markup, ANSI/OSC escapes, BEL and C1 controls is printed
    literally with every control character escaped: the run completes, the markup shows as
    typed, and no byte of the reply's control sequences reaches the terminal."""
    db = tmp_path / "j.db"
    with FaultyLLMServer(hang, good=100, good_text=HOSTILE) as server:
        proc = subprocess.run(
            [str(CAR), "--journal", str(db), "heist", "--policy", "openai", "--base-url",
             server.base_url, "--model", "m", "--rounds", "1", "--seed", "1"],
            capture_output=True, text=True, timeout=120, cwd=tmp_path,
            env={**ENV, **({"FORCE_COLOR": "1"} if color else {"NO_COLOR": "1"})},
        )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.count("[/dim] [bold red]red?[/bold red] ") == 6, out
    assert out.count(r"\x1b[2J\x1b]0;owned\x07 bell\x07 c1\x9b31m") == 6, out
    assert "[link=file:///etc/passwd]x[/link]" in out
    for raw in ("\x1b[2J", "\x1b]", "\x07", "\x9b"):
        assert raw not in out + proc.stderr, repr(raw)
    if not color:
        assert "\x1b" not in out
    # the tool result line escapes the parameter too
    assert out.count(r"-> file_reader(rou\x1btes\x07.txt): FAILED: no such file") == 6, out
    with Journal(db, create=False) as j:
        (run,) = j.runs()
        texts = [e.text for e in j.events(run.run_id) if isinstance(e, ev.ChatMessage)]
    assert texts == [HOSTILE] * 6  # the journal keeps the reply exactly


# --------------------------------------------------------------------------- SIGINT


@pytest.fixture(scope="module")
def interpreter_startup() -> float:
    """Seconds this machine's Python takes before it runs any of car's code: the interpreter's
    start (site included), what the `car` entry script imports first (re, sys) and compiling
    cli.py's source (when no bytecode cache is written, PYTHONDONTWRITEBYTECODE, it is
    compiled at every start) - the slowest of five such probes, plus half. CPython owns that
    window - a SIGINT there is its KeyboardInterrupt, before any project code could catch it
    (docs/decisions.md)."""
    source = Path(__file__).resolve().parent.parent / "cli.py"
    probe = f"import re, sys; compile(open({str(source)!r}).read(), 'cli.py', 'exec')"
    times = []
    for _ in range(5):
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-c", probe], check=True)
        times.append(time.monotonic() - t0)
    print(f"interpreter start-up: max {max(times):.3f}s of {times}")
    return 1.5 * max(times)  # a margin: the machine is shared


@pytest.mark.parametrize(
    "delay", [0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.2, 2.0, 3.0, 4.5, 6.0, 8.0]
)
def test_sigint_at_any_moment_exits_130_with_one_line(
    tmp_path: Path, interpreter_startup: float, delay: float
) -> None:
    """SIGINT `delay` s after the interpreter's start-up - during car's imports, while the
    journal is created, or in the middle of a long sim heist - exits 130 within 2 s, one stderr
    line, no traceback; a run that was started is closed as stopped and holds every step that
    was printed."""
    db = tmp_path / "j.db"
    proc = start(["--journal", str(db), "heist", "--rounds", "5000", "--seed", "2"], tmp_path)
    time.sleep(interpreter_startup + delay)
    proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    try:
        stdout, stderr = proc.communicate(timeout=10)
    finally:
        proc.kill()
    elapsed = time.monotonic() - t0
    print(f"delay {delay}s: exit {proc.returncode} after {elapsed:.2f}s: {stderr.strip()!r}")
    assert proc.returncode == 130, (proc.returncode, stderr)
    assert elapsed < 2.0, elapsed
    assert "Traceback" not in stderr + stdout
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0] == "interrupted" or re.fullmatch(
        r"stopped: run \w+ was closed after \d+ steps", lines[0]
    ), lines[0]
    if not db.exists():
        return
    with Journal(db, create=False) as j:
        runs = j.runs()
        assert len(runs) <= 1
        for run in runs:
            assert j.status(run.run_id) == "stopped"
            events = j.events(run.run_id)
            end = events[-1]
            assert isinstance(end, ev.RunEnded) and end.status == "stopped"
            assert any(isinstance(e, ev.Control) and e.action == "stop" for e in events)
            committed = sum(isinstance(e, ev.ChatMessage) for e in events)
            printed = [int(k) for k in STEP_LINE.findall(stdout)]
            assert printed == list(range(len(printed)))
            assert len(printed) <= committed
            assert j.verify(run.run_id).ok
        if not runs:
            assert lines[0] == "interrupted"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_term_or_hangup_closes_the_run_as_stopped(
    tmp_path: Path, interpreter_startup: float, sig: int
) -> None:
    """SIGTERM (a supervisor) or SIGHUP (the terminal closed) in the middle of a heist end it
    as Ctrl-C does: exit 130, one line, the run closed as stopped (it was killed outright and
    its run left for `car runs` to find abandoned)."""
    db = tmp_path / "j.db"
    proc = start(["--journal", str(db), "heist", "--rounds", "5000", "--seed", "2"], tmp_path)
    time.sleep(interpreter_startup + 3.0)  # well into the heist (see the SIGINT test)
    proc.send_signal(sig)
    try:
        _, stderr = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 130, (proc.returncode, stderr)
    assert re.fullmatch(r"stopped: run \w+ was closed after \d+ steps\n", stderr), stderr
    with Journal(db, create=False) as j:
        (run,) = j.runs()
        assert j.status(run.run_id) == "stopped" and j.verify(run.run_id).ok


def test_sigint_during_a_hanging_llm_call_stops_the_run_at_once(tmp_path: Path) -> None:
    """Ctrl-C while the model server hangs (with --timeout 60) aborts the call: exit 130
    within 2 s, the run closed as stopped after its two whole steps, no failed step."""
    db = tmp_path / "j.db"
    with FaultyLLMServer(hang, good=2) as server:
        proc = start(
            ["--journal", str(db), "heist", "--policy", "openai", "--base-url", server.base_url,
             "--model", "m", "--rounds", "1", "--seed", "1", "--timeout", "60"],
            tmp_path,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while len(server.requests) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(server.requests) == 3
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        try:
            stdout, stderr = proc.communicate(timeout=10)
        finally:
            proc.kill()
        elapsed = time.monotonic() - t0
    assert proc.returncode == 130 and elapsed < 2.0, (proc.returncode, elapsed, stderr)
    assert re.fullmatch(r"stopped: run \w+ was closed after 2 steps\n", stderr), stderr
    with Journal(db, create=False) as j:
        (run,) = j.runs()
        events = j.events(run.run_id)
        assert j.status(run.run_id) == "stopped"
        assert [e.step for e in events if isinstance(e, ev.LlmCall)] == [0, 1]
        kinds = [ev.kind_of(e) for e in events[-2:]]
        assert kinds == ["control", "run_ended"]
    assert len(STEP_LINE.findall(stdout)) == 2


# --------------------------------------------------------------------------- kill


@pytest.mark.parametrize("delay", [2.5, 3.5, 4.5, 6.0, 8.0])
def test_sigkill_never_takes_back_a_printed_step(tmp_path: Path, delay: float) -> None:
    """SIGKILL in the middle of a heist: every step the user saw on stdout is in the journal
    (steps are printed only after their commit). Stdout is read unbuffered-line by line."""
    db = tmp_path / "j.db"
    proc = start(
        ["--journal", str(db), "heist", "--rounds", "5000", "--seed", "4"],
        tmp_path,
        PYTHONUNBUFFERED="1",
    )
    time.sleep(delay)
    proc.kill()
    stdout, _ = proc.communicate(timeout=10)
    printed = [int(k) for k in STEP_LINE.findall(stdout)]
    print(f"delay {delay}s: {len(printed)} steps printed")
    if not db.exists():
        assert printed == []
        return
    with Journal(db, create=False) as j:
        runs = j.runs()
        committed = 0
        for run in runs:
            committed = sum(isinstance(e, ev.ChatMessage) for e in j.events(run.run_id))
    assert len(printed) <= committed, (len(printed), committed)
