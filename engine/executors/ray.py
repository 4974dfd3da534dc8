"""Forward runs on a Ray cluster, appended straight to a shared PostgreSQL journal.

Workers are Ray actors, one per slot the user asks for (`--workers`, default the cluster's
CPUs). Each opens the journal itself from its URL once and keeps it, with its connection pool
and its model client (engine.interventions.policy_for caches one per process), for its whole
life; the driver sends only the job, the parent info (put in the object store once per batch)
and the branch's arguments, and gets back a BranchResult. A threaded actor runs up to
ceil(concurrency / workers) branches at once, so a latency-bound fleet keeps many calls in
flight on few processes.

Faults. A worker that dies mid-branch leaves whole steps only (each step is one transaction,
rolled back by PostgreSQL when the connection drops). The driver starts a replacement actor,
runs the lost forward run once more on it, and closes the half-run branch it left as stopped
(the branch's writer lease names the dead worker's pid and host). A forward run whose worker is
lost twice is a failed forward run (BranchResult status "failed"); the stats count both.
Anything else that goes wrong on the cluster becomes one EngineError line.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine import events as ev
from engine.errors import ConcurrencyError, ConfigError, EngineError
from engine.executors.base import RAY_NEEDS_A_SERVER, ExecutorStats, Job, OnDone
from engine.workers import POLL, STOP, Interrupted

if TYPE_CHECKING:
    from engine.interventions import BranchResult, ParentInfo
    from engine.journal import Journal

INSTALL_HINT = "pip install 'ray==2.60.0' (or the project's [ray] extra)"
#: Seconds to wait for a TCP connection to the cluster's address before calling it unreachable.
CONNECT_TIMEOUT = 5.0
#: Seconds `ray.init` may take to join a cluster that answers.
CONNECT_DEADLINE = float(os.environ.get("CAR_RAY_CONNECT_DEADLINE", "60"))


def import_ray() -> Any:
    # the driver's own Ray core logs retries to stderr line by line; a command's errors are
    # one line of its own (set before the import: Ray reads it when it loads)
    os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "fatal")
    try:
        import ray
    except ImportError as e:
        raise ConfigError(f"--executor ray needs the ray package: {INSTALL_HINT}") from e
    return ray


def _auto_address() -> str:
    """The address `ray.init(address="auto")` would use: RAY_ADDRESS, else the cluster this
    machine started last (`ray start --head` writes it down)."""
    env = os.environ.get("RAY_ADDRESS", "").strip()
    if env and env != "auto":
        return env
    found = Path("/tmp/ray/ray_current_cluster")
    text = found.read_text().strip() if found.exists() else ""
    if not text:
        raise EngineError(
            "no running Ray cluster found for --ray-address auto (start one with "
            "`ray start --head`, or give --ray-address HOST:PORT)"
        )
    return text


def _check_reachable(address: str) -> None:
    """Ray keeps retrying an address that does not answer for minutes; one TCP connect says
    at once whether anything listens there."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(
            f"bad --ray-address {address!r}; expected auto, HOST:PORT or ray://HOST:PORT"
        )
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT):
            pass
    except OSError as e:
        raise EngineError(f"cannot reach the Ray cluster at {address!r}: {e}") from e


def _init_within(ray: Any, seconds: float, **options: Any) -> None:
    """ray.init, given up after `seconds`: a cluster that listens but never lets the driver in
    (a wrong RAY_AUTH_TOKEN, say) makes Ray retry without end."""
    done = threading.Event()
    failure: list[BaseException] = []

    def attempt() -> None:
        try:
            ray.init(**options)
        except BaseException as e:
            failure.append(e)
        finally:
            done.set()

    # Ray's core logs each retry on file descriptor 2 from its own threads: while it tries,
    # that descriptor points at /dev/null; if it never gets in, Python's stderr moves to a
    # copy of the real one, so the command's one error line is all the user sees
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    threading.Thread(target=attempt, daemon=True, name="ray-connect").start()
    joined = done.wait(seconds)
    if joined:
        os.dup2(saved, 2)
        os.close(saved)
    else:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
            sys.stderr = os.fdopen(saved, "w", buffering=1)
        raise EngineError(
            f"the Ray cluster at {options.get('address')!r} did not let this driver in within "
            f"{seconds:.0f} s (is RAY_AUTH_TOKEN the cluster's token?)"
        )
    if failure:
        raise failure[0]


def connect(address: str | None, *, num_cpus: int | None = None) -> Any:
    """ray, initialised: a new local instance for this command (address None), or a
    connection to a running cluster (auto, HOST:PORT, ray://HOST:PORT)."""
    ray = import_ray()
    if ray.is_initialized():
        return ray
    quiet: dict[str, Any] = {"log_to_driver": False, "logging_level": "ERROR"}
    try:
        if address is None:
            ray.init(num_cpus=num_cpus, include_dashboard=False, **quiet)
            return ray
        target = _auto_address() if address == "auto" else address
        if target.startswith("ray://") and importlib.util.find_spec("grpc") is None:
            raise ConfigError(
                f"--ray-address {target!r} uses Ray Client, which plain ray lacks: "
                "pip install 'ray[client]==2.60.0', or give the cluster's HOST:PORT"
            )
        _check_reachable(target.removeprefix("ray://"))
        _init_within(ray, CONNECT_DEADLINE, address=target, **quiet)
    except (EngineError, ConfigError):
        raise
    except Exception as e:  # ConnectionError, RuntimeError, grpc errors: one line, not a trace
        raise EngineError(f"cannot connect to the Ray cluster at {address!r}: {e}") from e
    return ray


class ForwardWorker:
    """A Ray actor's body: the shared journal and model client, kept for the worker's life."""

    def __init__(self, url: str) -> None:
        from engine.journal import Journal

        self.journal = Journal(url, create=False)

    def identity(self) -> tuple[int, str]:
        """(pid, host), the way the journal's writer leases name this process."""
        return os.getpid(), socket.gethostname()

    def run(self, job: Job, parent: ParentInfo, arg: Any) -> BranchResult:
        return job(self.journal, parent, arg)


class _Slot:
    """One actor and what the driver knows of it."""

    def __init__(self, handle: Any, pid: int, host: str) -> None:
        self.handle = handle
        self.pid = pid
        self.host = host
        self.busy = 0
        self.dead = False


class RayExecutor:
    """Forward runs on Ray actors writing to the shared PostgreSQL journal."""

    name = "ray"

    def __init__(
        self,
        journal: Journal,
        *,
        address: str | None = None,
        workers: int | None = None,
        concurrency: int = 1,
    ) -> None:
        if journal.is_sqlite:
            raise ConfigError(RAY_NEEDS_A_SERVER)
        self.url = journal.url
        self.address = address
        self._owns_ray = not (import_ray().is_initialized())
        self.ray = ray = connect(address, num_cpus=workers)
        try:
            cpus = float(ray.cluster_resources().get("CPU", 1.0))
        except Exception as e:
            raise EngineError(f"lost the Ray cluster at {address!r}: {e}") from e
        self.workers = workers or max(1, int(cpus))
        self.per_worker = max(1, math.ceil(concurrency / self.workers))
        # spread over the cluster's CPUs; an actor that mostly waits on the model needs little
        self._cpus = min(1.0, cpus / self.workers)
        self._remote = ray.remote(ForwardWorker)
        self._slots: list[_Slot] = []
        self._dead: set[tuple[int, str]] = set()
        self._stats = ExecutorStats(name=self.name, workers=self.workers)
        self._call(lambda: self._start(self.workers))

    # ------------------------------------------------------------------ workers

    def _call(self, fn: Any) -> Any:
        try:
            return fn()
        except (EngineError, ConfigError, Interrupted):
            raise
        except Exception as e:
            raise EngineError(f"lost the Ray cluster at {self.address or 'local'!r}: {e}") from e

    def _start(self, n: int) -> list[_Slot]:
        handles = [
            self._remote.options(
                num_cpus=self._cpus, max_concurrency=self.per_worker, max_restarts=0
            ).remote(self.url)
            for _ in range(n)
        ]
        # one round trip each: the journal is open (a bad URL fails here, once) and the pid
        # is known (what a dead worker's half-run branch is recognised by)
        ids = self.ray.get([h.identity.remote() for h in handles])
        slots = [_Slot(h, pid, host) for h, (pid, host) in zip(handles, ids, strict=True)]
        self._slots += slots
        return slots

    def worker_pids(self) -> list[tuple[int, str]]:
        """(pid, host) of every live worker."""
        return [(s.pid, s.host) for s in self._slots if not s.dead]

    def _replace(self, slot: _Slot) -> None:
        if slot.dead:
            return
        slot.dead = True
        self._dead.add((slot.pid, slot.host))
        with contextlib.suppress(Exception):
            self.ray.kill(slot.handle)
        self._slots.remove(slot)
        self._start(1)

    def stats(self) -> ExecutorStats:
        return self._stats

    # ------------------------------------------------------------------ map

    def map(
        self,
        journal: Journal,
        parent: ParentInfo,
        job: Job,
        args: Sequence[Any],
        on_done: OnDone,
        labels: Collection[str] = (),
    ) -> None:
        self._call(lambda: self._map(journal, parent, job, args, on_done, labels))

    def _map(
        self,
        journal: Journal,
        parent: ParentInfo,
        job: Job,
        args: Sequence[Any],
        on_done: OnDone,
        labels: Collection[str],
    ) -> None:
        ray = self.ray
        from ray.exceptions import RayActorError, RayTaskError

        parent_ref = ray.put(parent)
        todo: list[tuple[int, int]] = [(i, 0) for i in reversed(range(len(args)))]
        pending: dict[Any, tuple[int, int, _Slot]] = {}
        lost_before = len(self._dead)
        try:
            while todo or pending:
                while todo:
                    slot = min(self._slots, key=lambda s: s.busy)
                    if slot.busy >= self.per_worker:
                        break
                    i, attempt = todo.pop()
                    ref = slot.handle.run.remote(job, parent_ref, args[i])
                    pending[ref] = (i, attempt, slot)
                    slot.busy += 1
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL)
                for ref in ready:
                    i, attempt, slot = pending.pop(ref)
                    slot.busy -= 1
                    try:
                        result = ray.get(ref)
                    except RayActorError:
                        self._replace(slot)
                        if attempt == 0:
                            self._stats.retried += 1
                            todo.append((i, 1))
                        else:
                            from engine.interventions import BranchResult

                            self._stats.lost += 1
                            on_done(
                                i, BranchResult("", "failed", None, "its worker was lost twice")
                            )
                        continue
                    except RayTaskError as e:
                        # the job's own error (a bad journal, say): raise it as itself
                        raise e.as_instanceof_cause() from None
                    on_done(i, result)
                if STOP.is_set():
                    self.close(interrupted=True)
                    raise Interrupted()
        finally:
            if len(self._dead) > lost_before:
                self._stats.closed += close_lost(journal, parent.run_id, self._dead, labels)

    def close(self, interrupted: bool = False) -> None:
        for slot in self._slots:
            if interrupted:
                self._dead.add((slot.pid, slot.host))
            with contextlib.suppress(Exception):
                self.ray.kill(slot.handle)
        self._slots = []
        if self._owns_ray:
            # the command's own connection (or local instance) ends with the command
            self._owns_ray = False
            with contextlib.suppress(Exception):
                self.ray.shutdown()


def close_lost(
    journal: Journal, parent: str, dead: set[tuple[int, str]], labels: Collection[str] = ()
) -> int:
    """Close the branches of `parent` still open whose writer was one of the `dead` workers
    (by the writer lease), as stopped with the reason. Returns how many were closed."""
    closed = 0
    for info in journal.children(parent):
        if labels and info.label not in labels:
            continue
        lease = journal.lease(info.run_id)
        if lease is None or (lease.pid, lease.host) not in dead:
            continue
        why = f"worker lost mid-branch: pid {lease.pid} on {lease.host}"
        # the lost worker's connection may take a moment to be torn down by the server
        for _ in range(20):
            try:
                journal.append(
                    info.run_id,
                    [
                        ev.Control(action="stop", reason=why),
                        ev.RunEnded(status="stopped", error=why),
                    ],
                    journal.head(info.run_id),
                )
                closed += 1
                break
            except ConcurrencyError:
                time.sleep(0.05)
    return closed
