"""Interrupts and worker processes of the counterfactual commands (fork, attribute, fidelity).

Three promises, whatever moment the user presses Ctrl-C or kills the command:

* **Quick exit.** The first SIGINT only sets `STOP`; every loop that runs branches or steps
  looks at it between steps, so the command winds down within one step and exits 130. A second
  SIGINT, or a wind-down that takes longer than `GRACE` seconds (an LLM call that does not
  return), ends the process at once.
* **No orphans.** Worker processes ignore SIGINT (the parent decides), ask the kernel for
  SIGTERM when their parent dies (`PR_SET_PDEATHSIG` on Linux) and also poll the parent's pid
  (other systems, and the parent-thread caveat of PDEATHSIG). On SIGTERM a worker stops its
  branch at the next step and exits within `GRACE` seconds, busy or not.
* **No stranded branch.** A branch stopped this way journals `Control(stop)` and
  `RunEnded(status="stopped")` through its recorder; the few a hard kill cuts short are closed
  the same way by the parent (`close_open`).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar, cast

from engine.errors import EngineError
from engine.runtime.control import ControlChannel

if TYPE_CHECKING:
    # multiprocessing itself is imported by the pool: a command that forks no worker never
    # pays for it
    from multiprocessing.connection import Connection

#: Seconds a wind-down may take before the process ends without waiting any longer.
GRACE = 0.8
#: How often an idle loop or a worker looks at STOP and at its parent.
POLL = 0.05

STOP = threading.Event()
_PR_SET_PDEATHSIG = 1
_T = TypeVar("_T")
_R = TypeVar("_R")


class Interrupted(KeyboardInterrupt):
    """The user interrupted the command; what was open has been closed as stopped."""

    def __init__(self, message: str = "interrupted") -> None:
        super().__init__(message)
        self.message = message


class StopChannel(ControlChannel):
    """A branch's control channel that also carries the process-wide stop request."""

    def take(self) -> list[tuple[str, str]]:
        taken = super().take()
        if STOP.is_set():
            taken.append(("stop", "interrupted"))
        return taken


def check() -> None:
    """Raise Interrupted when a stop was requested (between two units of work)."""
    if STOP.is_set():
        raise Interrupted()


#: Held by the one thread that is ending the process (see hard_exit).
_ending = threading.Lock()


def hard_exit(message: str = "interrupted", code: int = 130) -> None:
    """End the process now: one line on stderr, no atexit hooks (they would join threads that
    may be stuck in a network call). Only the first caller writes its line: a second one (the
    wind-down timer firing while the command ends itself) waits for the process to end."""
    if not _ending.acquire(blocking=False):
        while True:
            time.sleep(1.0)
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    with contextlib.suppress(Exception):
        sys.stderr.write(f"{message}\n")
        sys.stderr.flush()
    os._exit(code)


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Within this block SIGINT (and SIGTERM) request a stop instead of raising at a random
    point; a second one, or a wind-down longer than GRACE, ends the process at once."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be installed from the main thread
        return
    STOP.clear()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if STOP.is_set():
            hard_exit()
        STOP.set()
        timer = threading.Timer(GRACE + 0.9, hard_exit)
        timer.daemon = True
        timer.start()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


# ------------------------------------------------------------------ worker processes


def _set_parent_death_signal() -> None:
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


_busy = threading.Event()


def _worker_on_term(signum: int, frame: FrameType | None) -> None:
    STOP.set()
    if not _busy.is_set():
        os._exit(143)
    # a branch is running: it stops at its next step; leave in any case after GRACE
    timer = threading.Timer(GRACE, os._exit, args=(143,))
    timer.daemon = True
    timer.start()


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(POLL * 4)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)
            return


def _worker_main(parent: int, conn: Connection, setup: Callable[[], None] | None) -> None:
    """A worker: run (fn, item) messages until the pipe closes; SIGINT is the parent's."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _worker_on_term)
    _set_parent_death_signal()
    if os.getppid() != parent:  # the parent died before the kernel knew to tell us
        os._exit(143)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    STOP.clear()
    if setup is not None:
        setup()
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            os._exit(0)  # the parent is gone or done with us
        if msg is None:
            os._exit(0)
        fn, item = msg
        _busy.set()
        started = time.perf_counter()
        try:
            ok, value = True, fn(item)
        except Exception as e:  # handed to the parent, which raises it
            ok, value = False, e
        finally:
            _busy.clear()
        # what the parent accounts per worker: seconds in the job, CPU seconds of the process
        reply = (ok, value, time.perf_counter() - started, time.process_time())
        if STOP.is_set():  # the branch closed itself as stopped; nothing more to do here
            os._exit(143)
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            os._exit(0)


class WorkerPool:
    """Processes that live for one command (created once, reused by every batch) and die
    with it. Forked, so they inherit what the parent prepared (e.g. the branch bases); each
    has its own pipe, and the parent hands out items from the front of a batch as workers
    become idle (two at a time while it runs items from the back itself, `run(local=...)`)."""

    def __init__(self, workers: int, setup: Callable[[], None] | None = None) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("fork")
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        #: per worker: seconds spent in jobs, and its CPU seconds so far (from its replies)
        self.busy_s = [0.0] * workers
        self.cpu_s = [0.0] * workers
        #: seconds the parent spent in run() (handing out items and waiting for results), and
        #: in the items it ran itself
        self.wall_s = 0.0
        self.local_busy_s = 0.0
        self.local_cpu_s = 0.0
        for _ in range(workers):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(os.getpid(), theirs, setup))
            proc.start()
            theirs.close()
            self._procs.append(proc)
            self._conns.append(mine)

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    def run(
        self,
        fn: Callable[[_T], _R],
        items: Iterable[_T],
        on_done: Callable[[int, _R], None],
        local: Callable[[_T], _R] | None = None,
    ) -> None:
        """Run fn over items; on_done(index, result) as each finishes. With `local`, this
        process takes items too (local(item), between handing out the others). On a stop
        request the workers are told to stop their branches and Interrupted is raised."""
        started = time.perf_counter()
        try:
            self._run(fn, items, on_done, local)
        finally:
            self.wall_s += time.perf_counter() - started

    def _run(
        self,
        fn: Callable[[_T], _R],
        items: Iterable[_T],
        on_done: Callable[[int, _R], None],
        local: Callable[[_T], _R] | None,
    ) -> None:
        from multiprocessing import connection as mp_connection

        # workers take items from the front, this process (with `local`) from the back
        todo = collections.deque(enumerate(items))
        # per worker, the indexes handed to it and not answered yet, in its order
        queued: dict[Connection, collections.deque[int]] = {
            conn: collections.deque() for conn in self._conns
        }
        slot = {conn: i for i, conn in enumerate(self._conns)}
        # a worker beside a busy parent holds a second item, so that it never waits for the
        # parent to hand it its next one
        depth = 2 if local is not None else 1
        while todo or any(queued.values()):
            for conn, mine in queued.items():
                while todo and len(mine) < (depth if len(todo) > 1 else 1):
                    index, item = todo.popleft()
                    conn.send((fn, item))
                    mine.append(index)
            waiting = [conn for conn, mine in queued.items() if mine]
            if local is not None and todo:
                index, item = todo.pop()
                t0, c0 = time.perf_counter(), time.process_time()
                try:
                    value = local(item)
                finally:
                    self.local_busy_s += time.perf_counter() - t0
                    self.local_cpu_s += time.process_time() - c0
                on_done(index, value)
                timeout = 0.0
            else:
                timeout = POLL
            ready = mp_connection.wait(waiting, timeout=timeout) if waiting else []
            for ready_conn in ready:
                conn = cast("Connection", ready_conn)
                index = queued[conn].popleft()
                try:
                    ok, value, busy_s, cpu_s = conn.recv()
                except (EOFError, OSError) as e:
                    if STOP.is_set():
                        break
                    raise EngineError("a worker process died while running a branch") from e
                self.busy_s[slot[conn]] += busy_s
                self.cpu_s[slot[conn]] = cpu_s
                if not ok:
                    raise value
                on_done(index, value)
            if STOP.is_set():
                self.stop()
                raise Interrupted()

    def stop(self) -> None:
        """Ask every worker to stop (SIGTERM), wait up to GRACE, then kill what is left."""
        for p in self._procs:
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + GRACE + 0.2
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
                p.join(1.0)
        self._close_pipes()

    def close(self) -> None:
        """Let the workers finish: each leaves when its pipe says so."""
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for p in self._procs:
            p.join(GRACE)
        self.stop()

    def _close_pipes(self) -> None:
        for conn in self._conns:
            conn.close()
        self._conns = []
        self._procs = []

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.stop()
