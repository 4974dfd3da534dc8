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

import concurrent.futures as cf
import contextlib
import ctypes
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any, TypeVar

from engine.runtime.control import ControlChannel

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


def hard_exit(message: str = "interrupted", code: int = 130) -> None:
    """End the process now: one line on stderr, no atexit hooks (they would join threads that
    may be stuck in a network call)."""
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


def _init_worker(parent: int, setup: Callable[[], None] | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _worker_on_term)
    _set_parent_death_signal()
    if os.getppid() != parent:  # the parent died before the kernel knew to tell us
        os._exit(143)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    STOP.clear()
    if setup is not None:
        setup()


def _run_marked(fn: Callable[[_T], _R], item: _T) -> _R:
    _busy.set()
    try:
        return fn(item)
    finally:
        _busy.clear()
        if STOP.is_set():  # the branch closed itself as stopped; nothing more to do here
            os._exit(143)


class WorkerPool:
    """Processes that live for one command (created once, reused by every batch) and die
    with it. Forked, so they inherit what the parent prepared (e.g. the branch bases)."""

    def __init__(self, workers: int, setup: Callable[[], None] | None = None) -> None:
        self.workers = workers
        ctx = mp.get_context("fork")
        self._pool = cf.ProcessPoolExecutor(
            max_workers=workers,
            mp_context=ctx,
            initializer=_init_worker,
            initargs=(os.getpid(), setup),
        )
        # start every worker now, from this (the main) thread: the pool would otherwise start
        # them at the first submit, possibly later from another thread
        list(self._pool.map(_noop, range(workers)))

    def pids(self) -> list[int]:
        procs: dict[int, Any] = getattr(self._pool, "_processes", None) or {}
        return [p.pid for p in procs.values() if p.pid is not None]

    def run(
        self, fn: Callable[[_T], _R], items: Iterable[_T], on_done: Callable[[int, _R], None]
    ) -> None:
        """Run fn over items; on_done(index, result) as each finishes. On a stop request the
        workers are told to stop their branches and Interrupted is raised."""
        futures = {self._pool.submit(_run_marked, fn, item): i for i, item in enumerate(items)}
        pending = set(futures)
        while pending:
            done, pending = cf.wait(pending, timeout=POLL, return_when=cf.FIRST_COMPLETED)
            for fut in done:
                on_done(futures[fut], fut.result())
            if STOP.is_set():
                for fut in pending:
                    fut.cancel()
                self.stop()
                raise Interrupted()

    def stop(self) -> None:
        """Ask every worker to stop (SIGTERM), wait up to GRACE, then kill what is left."""
        pids = self.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + GRACE + 0.2
        procs = list((getattr(self._pool, "_processes", None) or {}).values())
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
                p.join(1.0)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.stop()


def _noop(_: int) -> None:
    return None
