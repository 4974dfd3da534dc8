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
import fcntl
import gc
import mmap
import os
import select
import signal
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any, TypeVar

from engine.errors import EngineError
from engine.runtime.control import ControlChannel

#: Seconds a wind-down may take before the process ends without waiting any longer.
GRACE = 0.8
#: How often an idle loop or a worker looks at STOP and at its parent.
POLL = 0.05
_SPAN = struct.Struct("=qq")
_LENGTH = struct.Struct("=Q")

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
    """Within this block SIGINT (and SIGTERM, and SIGHUP: the terminal closed) request a stop
    instead of raising at a random point; a second one, or a wind-down longer than GRACE, ends
    the process at once. SIGHUP must not kill the process outright: a recorded program a
    branch runs is in a session of its own (engine.program.session) and would outlive it."""
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

    stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, on_signal) for s in stops}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


# ------------------------------------------------------------------ worker processes


def _set_parent_death_signal() -> None:
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError, ImportError):
        import ctypes  # in the forked worker only: the command's start-up does not need it

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
    flight per process.

    Two integers in an anonymous shared file (memfd where there is one), mapped by every
    process, under a POSIX record lock on that file (`fcntl.lockf`): the kernel drops a
    process's record locks when it dies, so a worker killed between two claims cannot leave
    the others waiting. Record locks are per process, so one thread of each process claims."""

    def __init__(self) -> None:
        if hasattr(os, "memfd_create"):
            self._fd = os.memfd_create("car-claims", os.MFD_CLOEXEC)
        else:  # pragma: no cover - systems without memfd (macOS)
            import tempfile

            self._fd, name = tempfile.mkstemp(prefix="car-claims-")
            os.unlink(name)
        os.ftruncate(self._fd, _SPAN.size)
        # [next from the front, one past the last not yet claimed from the back]
        self._span = mmap.mmap(self._fd, _SPAN.size)

    def reset(self, count: int) -> None:
        with self._locked():
            _SPAN.pack_into(self._span, 0, 0, count)

    def front(self) -> int | None:
        with self._locked():
            lo, hi = _SPAN.unpack_from(self._span)
            if lo >= hi:
                return None
            _SPAN.pack_into(self._span, 0, lo + 1, hi)
            return int(lo)

    def back(self) -> int | None:
        with self._locked():
            lo, hi = _SPAN.unpack_from(self._span)
            if hi <= lo:
                return None
            _SPAN.pack_into(self._span, 0, lo, hi - 1)
            return int(hi - 1)

    def close(self) -> None:
        """No more claims in this batch (after an error: workers finish the item in hand)."""
        with self._locked():
            lo, _hi = _SPAN.unpack_from(self._span)
            _SPAN.pack_into(self._span, 0, lo, lo)

    def release(self) -> None:
        """Unmap and close the shared file (the pool is done; its workers are gone)."""
        if self._fd < 0:
            return
        with contextlib.suppress(Exception):
            self._span.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._fd = -1

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.lockf(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN)


class _Channel:
    """One way of a worker's two pipes: pickled messages, each after its length."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def fileno(self) -> int:
        return self.fd

    def send(self, message: Any) -> None:
        import pickle  # a pool's need only: a command without workers does not pay for it

        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        view = memoryview(_LENGTH.pack(len(data)) + data)
        while view:
            view = view[os.write(self.fd, view) :]

    def recv(self) -> Any:
        import pickle

        (size,) = _LENGTH.unpack(self._read(_LENGTH.size))
        return pickle.loads(self._read(size))

    def _read(self, size: int) -> bytearray:
        buf = bytearray()
        while len(buf) < size:
            chunk = os.read(self.fd, size - len(buf))
            if not chunk:
                raise EOFError("the other end of the pipe is closed")
            buf += chunk
        return buf

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _ready(channels: Iterable[_Channel], timeout: float) -> list[_Channel]:
    """The channels with a message (or an end) to read, waiting up to `timeout` seconds."""
    ready, _, _ = select.select(list(channels), [], [], timeout)
    return ready


class _Worker:
    """A forked worker as its parent sees it: its pid, its two pipes, how it ended."""

    def __init__(self, pid: int, inbox: _Channel, outbox: _Channel) -> None:
        self.pid = pid
        self.inbox = inbox  # parent -> worker
        self.outbox = outbox  # worker -> parent
        self.exitcode: int | None = None

    def alive(self) -> bool:
        if self.exitcode is not None:
            return False
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # reaped elsewhere
            self.exitcode = -1
            return False
        if pid == 0:
            return True
        self.exitcode = os.waitstatus_to_exitcode(status)
        return False

    def join(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for the worker to end: its end of the reply pipe
        closes when it does (whatever it still had to say is dropped)."""
        deadline = time.monotonic() + timeout
        while self.alive():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                if _ready([self.outbox], min(left, POLL)):
                    self.outbox.recv()
            except (EOFError, OSError):
                # the pipe is closed: the process is ending, reap it
                with contextlib.suppress(ChildProcessError):
                    _, status = os.waitpid(self.pid, 0)
                    self.exitcode = os.waitstatus_to_exitcode(status)


def _worker_main(
    parent: int,
    conn: _Channel,
    replies: _Channel,
    claims: _Claims,
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
            _reply(replies, reply)
            if not ok:
                break
        _reply(replies, None)  # nothing more of this batch from here


def _reply(replies: _Channel, message: Any) -> None:
    try:
        replies.send(message)
    except OSError:  # BrokenPipeError among them: the parent is gone
        os._exit(0)


def _child(run: Callable[[], None]) -> None:
    """The forked child's whole life: `run`, then out without the parent's exit hooks. A
    worker that fails says so in one log line (the parent then reports it gone), never with a
    traceback on the user's terminal."""
    code = 1
    try:
        with contextlib.suppress(Exception):
            sys.stdin.close()
        run()
        code = 0
    except BaseException as e:
        with contextlib.suppress(Exception):
            from engine.logging import get_logger

            get_logger(__name__).error("a branch worker failed", error=f"{type(e).__name__}: {e}")
    finally:
        os._exit(code)


class WorkerPool:
    """Processes that live for one command (created once, reused by every batch) and die
    with it. Forked (`os.fork`), so they inherit what the parent prepared (e.g. the branch
    bases); each has a pipe each way. A batch goes to every worker whole; the items are
    claimed one at a time through shared memory (`_Claims`): workers from the front, the
    parent from the back when it runs items itself (`run(local=...)`)."""

    def __init__(self, workers: int) -> None:
        import pickle  # noqa: F401  # imported once here, not again in every worker

        self._workers: list[_Worker] = []
        self._claims = _Claims()
        #: per worker: seconds spent in jobs, and its CPU seconds so far (from its replies)
        self.busy_s = [0.0] * workers
        self.cpu_s = [0.0] * workers
        #: seconds the parent spent in run() (handing out items and waiting for results), and
        #: in the items it ran itself
        self.wall_s = 0.0
        self.local_busy_s = 0.0
        self.local_cpu_s = 0.0
        self._frozen = False
        parent = os.getpid()
        # what is alive now lives as long as the pool, mostly: out of the collector's reach
        # until the pool closes, so that neither process's collections walk it again nor
        # write to its pages, which would copy every page the workers share with this
        # process (gc.freeze, meant for a fork; the workers keep it frozen for their life)
        gc.freeze()
        self._frozen = True
        try:
            for _ in range(workers):
                self._workers.append(self._start(parent))
        except BaseException:
            self.stop()
            raise

    def _start(self, parent: int) -> _Worker:
        down_r, down_w = os.pipe()
        up_r, up_w = os.pipe()
        # what is buffered here would be written a second time by a child that flushes
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        pid = os.fork()
        if pid == 0:
            # the parent's ends of every pipe, this worker's and its elder siblings'
            for w in self._workers:
                w.inbox.close()
                w.outbox.close()
            os.close(down_w)
            os.close(up_r)
            claims = self._claims
            _child(lambda: _worker_main(parent, _Channel(down_r), _Channel(up_w), claims))
        os.close(down_r)
        os.close(up_w)
        return _Worker(pid, _Channel(down_w), _Channel(up_r))

    def pids(self) -> list[int]:
        return [w.pid for w in self._workers]

    def healthy(self) -> bool:
        """Whether the pool is open and every one of its workers is alive."""
        return bool(self._workers) and all(w.alive() for w in self._workers)

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
        if not batch:
            return
        if not self._workers:
            raise EngineError("the worker pool is closed")
        self._claims.reset(len(batch))
        try:
            for w in self._workers:
                w.inbox.send((fn, batch))
        except OSError as e:  # BrokenPipeError among them
            self.stop()
            raise EngineError("a worker process died before its batch") from e
        # the workers still in this batch (each ends it with a None), by their reply pipe
        running = {w.outbox: slot for slot, w in enumerate(self._workers)}
        try:
            while running:
                if local is not None and (index := self._claims.back()) is not None:
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
                for conn in _ready(running, timeout):
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
                    self.busy_s[running[conn]] += busy_s
                    self.cpu_s[running[conn]] = cpu_s
                    if not ok:
                        raise value
                    on_done(index, value)
                if STOP.is_set():
                    self.stop()
                    raise Interrupted()
            # every worker has ended the batch, so nothing is left to claim: the parent's
            # last item, if any, ran before the workers' ends were read
        except BaseException:
            if self._workers and not STOP.is_set():
                self._wind_down(running)
            raise

    def _wind_down(self, running: dict[_Channel, int]) -> None:
        """After an error: no more claims; let each worker finish the item in hand (a branch
        ends whole) and end the batch, for at most GRACE seconds; stop the pool otherwise."""
        try:
            self._claims.close()
            deadline = time.monotonic() + GRACE
            while running and time.monotonic() < deadline:
                for conn in _ready(running, POLL):
                    if conn.recv() is None:
                        del running[conn]
        except Exception:
            pass
        if running:
            self.stop()

    def stop(self) -> None:
        """Ask every worker to stop (SIGTERM), wait up to GRACE, then kill what is left."""
        for w in self._workers:
            if w.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, signal.SIGTERM)
        deadline = time.monotonic() + GRACE + 0.2
        for w in self._workers:
            w.join(max(0.0, deadline - time.monotonic()))
        for w in self._workers:
            if w.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, signal.SIGKILL)
                w.join(1.0)
        self._close_pipes()

    def close(self) -> None:
        """Let the workers finish: each leaves when its pipe says so."""
        for w in self._workers:
            with contextlib.suppress(OSError):
                w.inbox.send(None)
        for w in self._workers:
            w.join(GRACE)
        self.stop()

    def _close_pipes(self) -> None:
        for w in self._workers:
            w.inbox.close()
            w.outbox.close()
        self._claims.release()
        self._workers = []
        if self._frozen:
            # this process lives on (a test, a server): what became garbage meanwhile is
            # collected again
            self._frozen = False
            gc.unfreeze()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.stop()
