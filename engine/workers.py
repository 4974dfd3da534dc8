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
#: The longest a claim may wait for the pool's lock (held for microseconds) before the pool
#: is taken as broken.
CLAIM_TIMEOUT_S = 30.0

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


class _Claims:
    """The items of the batch being run, claimed one at a time through memory shared by the
    pool's processes: workers take from the front, the parent (with `local`) from the back.
    No process waits for another to hand it work, and a batch ends with at most one item in
    flight per process. The lock is held for two integer updates; a process that dies holding
    it (SIGKILL between two claims) is noticed by the parent's timed acquire (`alive`)."""

    def __init__(self, ctx: Any) -> None:
        self._lock = ctx.Lock()
        # [next from the front, one past the last not yet claimed from the back]
        self._span = ctx.RawArray("q", 2)

    def reset(self, count: int, alive: Callable[[], bool] | None = None) -> None:
        with self._locked(alive):
            self._span[0], self._span[1] = 0, count

    def front(self, alive: Callable[[], bool] | None = None) -> int | None:
        with self._locked(alive):
            i = int(self._span[0])
            if i >= self._span[1]:
                return None
            self._span[0] = i + 1
            return i

    def back(self, alive: Callable[[], bool] | None = None) -> int | None:
        with self._locked(alive):
            i = int(self._span[1]) - 1
            if i < self._span[0]:
                return None
            self._span[1] = i
            return i

    def close(self, alive: Callable[[], bool] | None = None) -> None:
        """No more claims in this batch (after an error: workers finish the item in hand)."""
        with self._locked(alive):
            self._span[1] = self._span[0]

    @contextlib.contextmanager
    def _locked(self, alive: Callable[[], bool] | None) -> Iterator[None]:
        deadline = time.monotonic() + CLAIM_TIMEOUT_S
        while not self._lock.acquire(timeout=POLL):
            if (alive is not None and not alive()) or time.monotonic() >= deadline:
                raise EngineError("a worker process died while claiming a branch")
        try:
            yield
        finally:
            self._lock.release()


def _worker_main(
    parent: int, conn: Connection, claims: _Claims, setup: Callable[[], None] | None
) -> None:
    """A worker: for each batch the parent sends, run the items it claims from the front,
    replying with each result and then the batch's end; leave when the pipe closes. SIGINT is
    the parent's."""
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
        fn, batch = msg
        while (index := claims.front()) is not None:
            _busy.set()
            started = time.perf_counter()
            try:
                ok, value = True, fn(batch[index])
            except Exception as e:  # handed to the parent, which raises it
                ok, value = False, e
            finally:
                _busy.clear()
            # what the parent accounts per worker: seconds in the job, CPU seconds so far
            reply = (index, ok, value, time.perf_counter() - started, time.process_time())
            if STOP.is_set():  # the branch closed itself as stopped; nothing more to do here
                os._exit(143)
            _reply(conn, reply)
            if not ok:
                break
        _reply(conn, None)  # nothing more of this batch from here


def _reply(conn: Connection, message: Any) -> None:
    try:
        conn.send(message)
    except (BrokenPipeError, OSError):
        os._exit(0)


class WorkerPool:
    """Processes that live for one command (created once, reused by every batch) and die
    with it. Forked, so they inherit what the parent prepared (e.g. the branch bases); each
    has its own pipe. A batch goes to every worker whole; the items are claimed one at a time
    through shared memory (`_Claims`): workers from the front, the parent from the back when
    it runs items itself (`run(local=...)`)."""

    def __init__(self, workers: int, setup: Callable[[], None] | None = None) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("fork")
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._claims = _Claims(ctx)
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
            proc = ctx.Process(target=_worker_main, args=(os.getpid(), theirs, self._claims, setup))
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
        process takes items too (local(item), between looking at the workers' results). On a
        stop request the workers are told to stop their branches and Interrupted is raised;
        on an error the other processes finish the item in hand, then it is raised."""
        started = time.perf_counter()
        try:
            self._run(fn, list(items), on_done, local)
        finally:
            self.wall_s += time.perf_counter() - started

    def _run(
        self,
        fn: Callable[[_T], _R],
        batch: list[_T],
        on_done: Callable[[int, _R], None],
        local: Callable[[_T], _R] | None,
    ) -> None:
        from multiprocessing import connection as mp_connection

        if not batch:
            return
        claims = self._claims
        claims.reset(len(batch), self._alive)
        for conn in self._conns:
            conn.send((fn, batch))
        # the workers still in this batch (each ends it with a None)
        running = dict.fromkeys(self._conns, True)
        slot = {conn: i for i, conn in enumerate(self._conns)}
        try:
            while running:
                index = claims.back(self._alive) if local is not None else None
                if local is not None and index is not None:
                    t0, c0 = time.perf_counter(), time.process_time()
                    try:
                        value = local(batch[index])
                    finally:
                        self.local_busy_s += time.perf_counter() - t0
                        self.local_cpu_s += time.process_time() - c0
                    on_done(index, value)
                    timeout = 0.0
                else:
                    local = None  # nothing left to claim here
                    timeout = POLL
                for ready in mp_connection.wait(list(running), timeout=timeout):
                    conn = cast("Connection", ready)
                    try:
                        reply = conn.recv()
                    except (EOFError, OSError) as e:
                        if STOP.is_set():
                            break
                        raise EngineError("a worker process died while running a branch") from e
                    if reply is None:
                        del running[conn]
                        continue
                    index, ok, value, busy_s, cpu_s = reply
                    self.busy_s[slot[conn]] += busy_s
                    self.cpu_s[slot[conn]] = cpu_s
                    if not ok:
                        raise value
                    on_done(index, value)
                if STOP.is_set():
                    self.stop()
                    raise Interrupted()
            # every worker has ended the batch, so nothing is left to claim: the parent's
            # last item, if any, ran before the workers' ends were read
        except BaseException:
            if self._conns and not STOP.is_set():
                self._wind_down(running)
            raise

    def _alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def _wind_down(self, running: dict[Connection, bool]) -> None:
        """After an error: no more claims; let each worker finish the item in hand (a branch
        ends whole) and end the batch, for at most GRACE seconds; stop the pool otherwise."""
        from multiprocessing import connection as mp_connection

        try:
            self._claims.close(self._alive)
            deadline = time.monotonic() + GRACE
            while running and time.monotonic() < deadline:
                for ready in mp_connection.wait(list(running), timeout=POLL):
                    conn = cast("Connection", ready)
                    if conn.recv() is None:
                        del running[conn]
        except Exception:
            pass
        if running:
            self.stop()

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
