"""Record, replay and fork a program: the program runs as a child process with its
`OPENAI_BASE_URL` pointing at the recording proxy (engine.program.proxy).

A run of a recorded program (scenario "program") is one execution of the command: RunStarted
(the command, the upstream, the outcome command), one step per chat completion, and RunEnded
whose outcome is the program's exit status and the outcome command's: `bad` unless both are 0.

Whatever ends the execution, the run is closed: the program's own exit (any status) ends it
`completed`; a replay miss, an upstream that fails a call (unreachable, too slow, a cut, malformed
or oversized reply; in a fork's branch also an HTTP error) or a journal error end it `failed`
with that reason; Ctrl-C, SIGTERM or SIGHUP end it `stopped` (the calls in flight abandoned at
once; the program, in a session of its own, terminated by car - `run_command`). Only a
SIGKILL of `car` itself leaves it open, and then the writer lease says so (engine.journal:
`abandoned`, closed by `car runs --close-abandoned`); the program then gets SIGTERM from the
kernel (`_launcher`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import os
import shlex
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator, Mapping, Sequence
from types import FrameType
from typing import Any

import msgspec

from engine import events as ev
from engine.errors import EngineError, InterventionError
from engine.interventions import Intervention, iv_value, op_name
from engine.journal import Journal
from engine.program import wire
from engine.program.matching import MatchMode, RecordedCall, recorded_calls
from engine.program.proxy import Proxy, Session
from engine.program.upstream import DEFAULT_MAX_REPLY_BYTES, DEFAULT_TIMEOUT, Upstream
from engine.runtime.episode import close_after, start_run
from engine.runtime.recorder import Recorder
from engine.state import state_at_seq, step_seq
from engine.version import engine_version

SCENARIO = "program"
#: Seconds a program gets to exit after Ctrl-C before it is terminated, then killed.
STOP_GRACE = 5.0


class ProgramError(EngineError):
    """The program cannot be run, or the run is not a recorded program."""


class ProgramRun(msgspec.Struct, frozen=True):
    """How one execution of the program went."""

    run_id: str | None  # None for a replay (nothing is journaled)
    status: str  # completed | failed | stopped
    exit_status: int | None
    outcome_status: int | None
    bad: bool | None
    calls: int
    error: str | None = None
    upstream_errors: list[str] = msgspec.field(default_factory=list)

    def outcome(self) -> dict[str, Any]:
        return {
            "bad": self.bad,
            "exit_status": self.exit_status,
            "outcome_status": self.outcome_status,
            "calls": self.calls,
        }


def resolve_upstream(base_url: str | None, env: Mapping[str, str] | None = None) -> str:
    """--base-url, else the caller's OPENAI_BASE_URL; ProgramError (one line) when neither."""
    env = os.environ if env is None else env
    url = base_url or env.get("OPENAI_BASE_URL")
    if not url:
        raise ProgramError(
            "no upstream model server: give --base-url URL or set OPENAI_BASE_URL "
            "(the server the program's calls are forwarded to)"
        )
    return url


def check_command(cmd: Sequence[str]) -> None:
    """ProgramError (one line) unless `cmd` can be started, checked before any run is created:
    a command that cannot start must leave nothing in the journal. Found the way the
    program is started (execvp): a bare name on PATH only, a path with a `/` as it is, an
    executable file either way."""
    if not cmd:
        raise ProgramError("no command to run: give it after `--`, e.g. -- python agents.py")
    prog = cmd[0]
    if shutil.which(prog) is not None:
        return
    if os.sep not in prog:
        here = f" (the file here is run as ./{prog})" if os.path.isfile(prog) else ""
        raise ProgramError(f"cannot run {prog!r}: no such program on PATH{here}")
    if os.path.isdir(prog):
        raise ProgramError(f"cannot run {prog!r}: it is a directory")
    if os.path.exists(prog):
        raise ProgramError(
            f"cannot run {prog!r}: it is not executable (chmod +x it, or give its "
            "interpreter first, e.g. -- python prog.py)"
        )
    raise ProgramError(f"cannot run {prog!r}: no such program")


def program_env(proxy_url: str, run_id: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env["OPENAI_BASE_URL"] = proxy_url
    env.setdefault("OPENAI_API_KEY", "car-proxy")
    if run_id:
        env["CAR_RUN_ID"] = run_id
    return env


def run_command(cmd: Sequence[str], env: Mapping[str, str], stdout: Any = None) -> int:
    """Run the program to its end; its exit status (negative: killed by that signal).

    The program runs in a session of its own, so the terminal's Ctrl-C reaches car alone:
    car stops the program itself - SIGTERM to the program's process group (its own children
    too), some seconds to exit, then SIGKILL - and says so in one line, instead of the
    program dying of the same SIGINT and printing its own KeyboardInterrupt traceback over
    car's line. Being no terminal's member, it can still read and write the terminal (job
    control only applies to a process's controlling terminal); Ctrl-Z is passed on to it
    (`_job_control`). The KeyboardInterrupt is re-raised once it is gone."""
    from engine.workers import STOP

    proc = subprocess.Popen(
        [*_launcher(), *cmd], env=dict(env), stdout=stdout, start_new_session=True
    )
    try:
        with _job_control(proc):
            while True:
                try:
                    return proc.wait(timeout=0.05)
                except subprocess.TimeoutExpired:
                    pass
                # under the counterfactual commands' interrupt handling (engine.workers)
                # Ctrl-C only sets STOP, and the process ends soon after: stop the program
                # at once
                if STOP.is_set():
                    _stop(proc, grace=0.3)
                    raise KeyboardInterrupt
    except BaseException:
        # Ctrl-C, SIGTERM, or anything else that ends car: the program must not outlive it
        _stop(proc)
        raise


def _launcher() -> list[str]:
    """What the program is started through so that it ends with car even when car cannot stop
    it (a SIGKILL): util-linux's `setpriv` asks the kernel for SIGTERM to the program when the
    thread that started it is gone (a parent-death signal), then execs the program, which
    keeps the pid car watches and signals. Where there is no setpriv, the program is started
    as it is (and outlives a SIGKILL of car, as any child would). A process cannot set this for
    its child between fork and exec without running Python code there, which is unsafe in a
    process with threads (a fork's concurrent branches)."""
    found = _setpriv()
    return [found, "--pdeathsig", "TERM", "--"] if found else []


@functools.cache
def _setpriv() -> str | None:
    return shutil.which("setpriv")


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    """`sig` to the program's process group (it leads it), unless it is already reaped."""
    if proc.returncode is not None:
        return  # reaped: its id may be another process's by now
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _stop(proc: subprocess.Popen[bytes], grace: float = STOP_GRACE) -> None:
    """SIGTERM, then SIGKILL after `grace` seconds (at once on a second Ctrl-C), to the
    program's process group. Not SIGINT: a Python program would print a traceback for it."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            return
        _signal_group(proc, sig)
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue
        except KeyboardInterrupt:
            continue  # a second Ctrl-C: go on to SIGKILL


@contextlib.contextmanager
def _job_control(proc: subprocess.Popen[bytes]) -> Iterator[None]:
    """Ctrl-Z (SIGTSTP) stops the program with car, and `fg` continues both: the program is
    in a session of its own, so the terminal's SIGTSTP reaches car alone. Only in the main
    thread (a fork's concurrent branches run in others, and signal handlers are the main
    thread's)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_tstp(signum: int, frame: FrameType | None) -> None:
        _signal_group(proc, signal.SIGSTOP)
        signal.signal(signal.SIGTSTP, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTSTP)  # car stops here, until SIGCONT
        signal.signal(signal.SIGTSTP, on_tstp)
        _signal_group(proc, signal.SIGCONT)

    previous = signal.signal(signal.SIGTSTP, on_tstp)
    try:
        yield
    finally:
        signal.signal(signal.SIGTSTP, previous)


def run_outcome(command: str, env: Mapping[str, str], exit_status: int, stdout: Any = None) -> int:
    """The outcome command's exit status (0 = good), run by the shell with CAR_EXIT_STATUS."""
    env = {**env, "CAR_EXIT_STATUS": str(exit_status)}
    return subprocess.run(command, shell=True, env=env, check=False, stdout=stdout).returncode


def _utc_now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="microseconds")


def _execute(
    session: Session,
    cmd: Sequence[str],
    outcome_cmd: str | None,
    run_id: str | None,
    stdout: Any = None,
    env_id: str | None = None,
) -> ProgramRun:
    """Run the program against a session's proxy, then its outcome command. `stdout` is
    where their output goes (None: car's own stdout). Both see CAR_RUN_ID (the run, or
    `env_id` for a replay), e.g. to keep the files of concurrent branches apart."""
    with Proxy(session) as proxy:
        env = program_env(proxy.base_url, env_id or run_id)
        try:
            code = run_command(cmd, env, stdout)
        except OSError as e:
            raise ProgramError(f"cannot run {cmd[0]!r}: {e.strerror or e}") from e
    if session.failure is not None:
        return ProgramRun(run_id, "failed", code, None, None, session.calls, session.failure)
    out = run_outcome(outcome_cmd, env, code, stdout) if outcome_cmd else None
    bad = code != 0 or (out is not None and out != 0)
    errors = sorted(set(session.upstream_errors))
    return ProgramRun(run_id, "completed", code, out, bad, session.calls, None, errors)


def _close(recorder: Recorder, run: ProgramRun) -> None:
    events: list[ev.Event] = []
    if run.status == "stopped":
        events.append(ev.Control(action="stop", reason=run.error or "interrupted"))
    events.append(ev.RunEnded(status=run.status, outcome=run.outcome(), error=run.error))
    recorder.append(events)
    recorder.flush()


def _guarded(
    recorder: Recorder,
    session: Session,
    cmd: Sequence[str],
    outcome_cmd: str | None,
    stdout: Any = None,
) -> ProgramRun:
    """`_execute`, the run closed whatever happens (re-raising a Ctrl-C after closing it)."""
    run_id = recorder.run_id
    try:
        run = _execute(session, cmd, outcome_cmd, run_id, stdout)
    except KeyboardInterrupt:
        run = ProgramRun(run_id, "stopped", None, None, None, session.calls, "interrupted")
        _close(recorder, run)
        raise
    except BaseException as e:
        run = ProgramRun(run_id, "failed", None, None, None, session.calls, str(e) or repr(e))
        _close(recorder, run)
        raise
    _close(recorder, run)
    return run


def record(
    journal: Journal,
    cmd: Sequence[str],
    *,
    upstream: str,
    name: str = "",
    outcome: str | None = None,
    seed: int = 0,
    timeout: float = DEFAULT_TIMEOUT,
    max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES,
    stdout: Any = None,
) -> ProgramRun:
    """Record one execution of `cmd` as a new run. UpstreamError / ProgramError (nothing
    journaled) when the upstream is unreachable or the command does not exist. Each upstream
    call takes at most `timeout` seconds in all and `max_reply_bytes`; a call past either
    fails (the program gets HTTP 504 or 502) and so does the run."""
    check_command(cmd)
    up = Upstream(upstream, timeout, max_reply_bytes)
    up.check()
    started = ev.RunStarted(
        scenario=SCENARIO,
        config={
            "command": list(cmd),
            "cwd": os.getcwd(),
            "upstream": up.url,
            "outcome": outcome,
            "name": name,
            "timeout": up.timeout,
            "max_reply_bytes": up.max_reply_bytes,
        },
        agents=[],
        policy={"name": "program", "base_url": up.url},
        root_seed=seed,
        engine_version=engine_version(),
        started_at=_utc_now(),
    )
    recorder = start_run(journal, SCENARIO, [started], label=name or shlex.join(cmd)[:80])
    try:
        session = Session(recorder=recorder, upstream=up, root_seed=seed)
    except BaseException as e:  # a Ctrl-C before the program starts: the run is closed
        close_after(recorder, e)
        raise
    return _guarded(recorder, session, cmd, outcome, stdout)


# ------------------------------------------------------------------ what was recorded


class ProgramInfo(msgspec.Struct, frozen=True):
    run_id: str
    status: str
    config: dict[str, Any]
    root_seed: int
    outcome: dict[str, Any]
    calls: list[RecordedCall]


def program_info(journal: Journal, run_id: str) -> ProgramInfo:
    """The recorded program run `run_id` (or prefix); ProgramError when it is none."""
    info = journal.run(run_id)
    first = next(journal.read(info.run_id, 0, 1), None)
    if first is None or not isinstance(first.event, ev.RunStarted):
        raise ProgramError(f"run {info.run_id!r} has no RunStarted event")
    if first.event.scenario != SCENARIO:
        raise ProgramError(
            f"run {info.run_id!r} is a {first.event.scenario!r} run, not a recorded program "
            "(the `-- CMD` form is for runs made by `car record`)"
        )
    last = journal.last_event(info.run_id)
    outcome = dict(last.event.outcome) if last and isinstance(last.event, ev.RunEnded) else {}
    return ProgramInfo(
        run_id=info.run_id,
        status=journal.status(info.run_id),
        config=dict(first.event.config),
        root_seed=first.event.root_seed,
        outcome=outcome,
        calls=recorded_calls(journal, info.run_id),
    )


def is_program_run(journal: Journal, run_id: str) -> bool:
    info = journal.run(run_id)
    return info.scenario == SCENARIO


# ------------------------------------------------------------------ replay


class ReplayReport(msgspec.Struct, frozen=True):
    """How faithfully a re-executed program reproduced its recorded behaviour."""

    run_id: str
    match: str
    recorded_calls: int
    replayed_calls: int
    exact: int
    normalised: int
    request_match_rate: float | None
    exact_match_rate: float | None
    per_agent: dict[str, dict[str, Any]]
    divergences: list[dict[str, Any]]
    unrequested: list[int]  # recorded steps the replay never asked for
    outcome_recorded: dict[str, Any]
    outcome_replayed: dict[str, Any]
    outcome_match: bool
    status: str
    error: str | None
    #: calls answered by a recorded call other than their agent's earliest unanswered one
    #: (calls of one agent in flight together, engine.program.matching)
    reordered: int = 0

    @property
    def fidelity(self) -> float | None:
        return self.request_match_rate

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = msgspec.to_builtins(self)
        d["fidelity"] = self.fidelity
        return d


def replay(
    journal: Journal,
    run_id: str,
    cmd: Sequence[str],
    *,
    match: MatchMode = MatchMode.EXACT,
    outcome: str | None = None,
    stdout: Any = None,
) -> ReplayReport:
    """Re-run `cmd` with every call answered from run `run_id`; nothing is journaled. The run
    is checked first: a run that is no recorded program is refused for what it is, whatever
    the command."""
    info = program_info(journal, run_id)
    check_command(cmd)
    if info.status in ("recording", "paused"):
        raise ProgramError(f"run {info.run_id!r} is still recording; replay it once it ended")
    session = Session(recorder=None, upstream=None, recorded=info.calls, match=match)
    outcome_cmd = outcome if outcome is not None else info.config.get("outcome")
    run = _execute(session, cmd, outcome_cmd, None, stdout, f"replay-{info.run_id}")
    return _replay_report(info, session, run, match)


def _replay_report(
    info: ProgramInfo, session: Session, run: ProgramRun, match: MatchMode
) -> ReplayReport:
    checks = session.checks
    n_rec = len(info.calls)
    denominator = max(n_rec, len(checks))
    exact = sum(1 for c in checks if c["exact"])
    norm = sum(1 for c in checks if c["normalised"])
    per_agent: dict[str, dict[str, Any]] = {}
    for rc in info.calls:
        a = per_agent.setdefault(rc.agent, {"recorded": 0, "replayed": 0, "exact": 0, "norm": 0})
        a["recorded"] += 1
    for c in checks:
        a = per_agent.setdefault(c["agent"], {"recorded": 0, "replayed": 0, "exact": 0, "norm": 0})
        a["replayed"] += 1
        a["exact"] += int(c["exact"])
        a["norm"] += int(c["normalised"])
    for a in per_agent.values():
        d = max(a["recorded"], a["replayed"])
        a["exact_match_rate"] = a["exact"] / d if d else None
        a["request_match_rate"] = a["norm"] / d if d else None
    asked = {c["step"] for c in checks if c["step"] is not None}
    recorded_outcome = {k: info.outcome.get(k) for k in ("bad", "exit_status", "outcome_status")}
    replayed_outcome = {k: run.outcome()[k] for k in ("bad", "exit_status", "outcome_status")}
    return ReplayReport(
        run_id=info.run_id,
        match=match.value,
        recorded_calls=n_rec,
        replayed_calls=len(checks),
        exact=exact,
        normalised=norm,
        request_match_rate=norm / denominator if denominator else None,
        exact_match_rate=exact / denominator if denominator else None,
        per_agent=per_agent,
        divergences=[c for c in checks if not c["exact"]],
        unrequested=sorted(c.step for c in info.calls if c.step not in asked),
        outcome_recorded=recorded_outcome,
        outcome_replayed=replayed_outcome,
        outcome_match=recorded_outcome == replayed_outcome,
        status=run.status,
        error=run.error,
        reordered=session.reordered,
    )


# ------------------------------------------------------------------ forks


def _prefix_tools(
    journal: Journal, run_id: str, fork_seq: int, calls: list[RecordedCall], k: int
) -> tuple[dict[str, tuple[int, str, str, str]], set[str]]:
    """Tool calls of the steps before k (by their recorder ids), and those whose result the
    prefix already holds (a branch must not journal them twice)."""
    ids: dict[str, tuple[int, str, str, str]] = {}
    by_step: dict[int, list[str]] = {}
    for c in calls:
        if c.step >= k:
            continue
        for i, t in enumerate(c.tools):
            tid = wire.tool_call_id(c.agent, c.issued, i)
            ids[tid] = (c.step, c.agent, t.tool, t.param)
            by_step.setdefault(c.step, []).append(tid)
    done: set[str] = set()
    seen: dict[int, int] = {}
    for stored in journal.read(run_id, 0, fork_seq):
        e = stored.event
        if isinstance(e, ev.ToolResult) and e.step is not None:
            n = seen.get(e.step, 0)
            seen[e.step] = n + 1
            got = by_step.get(e.step, [])
            if n < len(got):
                done.add(got[n])
    return {t: v for t, v in ids.items() if t not in done}, done


def branch_upstream(info: ProgramInfo, upstream: str | None) -> Upstream | None:
    """The upstream of a branch's live calls: `upstream`, else the recorded one, with the
    bounds the run was recorded with."""
    url = upstream or info.config.get("upstream")
    if not url:
        return None
    timeout = info.config.get("timeout")
    max_reply = info.config.get("max_reply_bytes")
    return Upstream(
        str(url),
        float(timeout) if isinstance(timeout, int | float) else DEFAULT_TIMEOUT,
        max_reply if isinstance(max_reply, int) else DEFAULT_MAX_REPLY_BYTES,
    )


def fork_branch(
    journal: Journal,
    info: ProgramInfo,
    iv: Intervention,
    branch_seed: int,
    cmd: Sequence[str],
    *,
    upstream: str | None,
    label: str,
    keep: frozenset[int] = frozenset(),
    match: MatchMode = MatchMode.EXACT,
    outcome: str | None = None,
    stdout: Any = subprocess.DEVNULL,
) -> ProgramRun:
    """One branch: a child run of `info` forked at step iv.k, the program re-run with the
    calls before k answered from the journal, `iv` applied at k, live calls after (steps in
    `keep` after k answered from the journal too)."""
    k = iv.k
    if not 0 <= k < len(info.calls):
        raise InterventionError(
            f"step {k} is out of range: run {info.run_id!r} has calls 0..{len(info.calls) - 1}"
        )
    if op_name(iv) == "observation" and not info.calls[k].tools:
        with_tools = [str(c.step) for c in info.calls if c.tools]
        raise InterventionError(
            f"do_observation needs a call that asked for a tool; call {k} of run "
            f"{info.run_id!r} asked for none (calls with tool calls: "
            f"{', '.join(with_tools) or 'none'})"
        )
    up = branch_upstream(info, upstream)
    fork_seq = step_seq(journal, info.run_id, k)
    state = state_at_seq(journal, info.run_id, fork_seq)
    child = journal.fork(info.run_id, fork_seq, label=label)
    recorder = Recorder(journal, child, state, fork_seq)
    tool_ids, done = _prefix_tools(journal, info.run_id, fork_seq, info.calls, k)
    session = Session(
        recorder=recorder,
        upstream=up,
        root_seed=info.root_seed,
        recorded=info.calls,
        match=match,
        fork_at=k,
        intervention=iv,
        branch_seed=branch_seed,
        keep=keep,
        next_step=k,
        resulted_ids=done,
        tool_ids=tool_ids,
    )
    try:
        recorder.append(
            [
                ev.Intervention(
                    step=k, op=op_name(iv), at=k, value=iv_value(iv), branch_seed=branch_seed
                )
            ]
        )
        recorder.flush()
    except BaseException as e:
        _close(recorder, ProgramRun(child, "failed", None, None, None, 0, str(e)))
        raise
    outcome_cmd = outcome if outcome is not None else info.config.get("outcome")
    return _guarded(recorder, session, cmd, outcome_cmd, stdout)


__all__ = [
    "SCENARIO",
    "ProgramError",
    "ProgramInfo",
    "ProgramRun",
    "ReplayReport",
    "branch_upstream",
    "fork_branch",
    "program_info",
    "record",
    "replay",
    "resolve_upstream",
]
