"""Forward runs on this machine: inline, in threads, or in forked worker processes.

Threads wait on a model server (an OpenAI-compatible endpoint, or any branch on a PostgreSQL
journal); forked processes run the embedded policy on a SQLite journal, where the work is CPU
and the GIL would serialise threads. Forked workers inherit the parent infos prepared before
the pool started (and the branch bases computed so far), so nothing is shipped but the job.

A process with threads of its own (the server) must not fork while they run: a fork copies
whatever lock another thread holds at that moment, held for good in the child. Such a host
forks a *standing pool* once, before its threads start (`start_standing_pool`); its forward
runs then go to those workers, the parent info shipped with each batch, one command (a fork,
an attribution: an executor) at a time, from its first batch to its end (another meanwhile
runs in threads)."""

from __future__ import annotations

import os
import threading
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

from engine.errors import EngineError, InterventionError
from engine.executors.base import ExecutorStats, Job, OnDone
from engine.workers import GRACE, STOP, Interrupted, WorkerPool, check

if TYPE_CHECKING:
    import concurrent.futures as cf

    from engine.interventions import BranchResult, ParentInfo
    from engine.journal import Journal

MODES = ("inline", "threads", "processes")

#: What forked worker processes inherit: the parent infos by run id; their own journals.
_inherited: dict[str, ParentInfo] = {}
_worker_journals: dict[str, Journal] = {}


def _worker_journal(target: str) -> Journal:
    """This worker process's journal at `target` (opened once: opening checks the schema,
    which is not free)."""
    from engine.journal import Journal

    j = _worker_journals.get(target)
    if j is None:
        j = _worker_journals[target] = Journal(target)
        # its siblings write the same file at the same time
        j.parallel_writers = True
    return j


def _process_job(item: tuple[str, str, Job, Any]) -> BranchResult:
    target, run_id, job, arg = item
    return job(_worker_journal(target), _inherited[run_id], arg)


def _shipped_job(item: tuple[str, ParentInfo, Job, Any]) -> BranchResult:
    """A job of a standing pool: its parent info comes with it (one pickled copy a batch)."""
    target, parent, job, arg = item
    return job(_worker_journal(target), parent, arg)


class _Accounts:
    """Seconds a pool's processes spent in jobs, and their CPU seconds: a standing pool's
    counters run over every batch of its life, an executor reports those of its own."""

    def __init__(
        self, busy_s: list[float], cpu_s: list[float], local_busy_s: float,
        local_cpu_s: float, wall_s: float,
    ) -> None:  # fmt: skip
        self.busy_s = busy_s
        self.cpu_s = cpu_s
        self.local_busy_s = local_busy_s
        self.local_cpu_s = local_cpu_s
        self.wall_s = wall_s

    @classmethod
    def of(cls, pool: WorkerPool) -> _Accounts:
        return cls(list(pool.busy_s), list(pool.cpu_s), pool.local_busy_s, pool.local_cpu_s,
                   pool.wall_s)  # fmt: skip

    @classmethod
    def since(cls, pool: WorkerPool, start: _Accounts, sum_: _Accounts | None) -> _Accounts:
        """What `pool` did since `start`, added to `sum_` (the executor's earlier batches).
        A worker's CPU seconds are its process's total so far: their growth is its share."""
        now = cls.of(pool)
        d = cls(
            [a - b for a, b in zip(now.busy_s, start.busy_s, strict=True)],
            [a - b for a, b in zip(now.cpu_s, start.cpu_s, strict=True)],
            now.local_busy_s - start.local_busy_s,
            now.local_cpu_s - start.local_cpu_s,
            now.wall_s - start.wall_s,
        )
        if sum_ is None:
            return d
        return cls(
            [a + b for a, b in zip(sum_.busy_s, d.busy_s, strict=True)],
            [a + b for a, b in zip(sum_.cpu_s, d.cpu_s, strict=True)],
            sum_.local_busy_s + d.local_busy_s,
            sum_.local_cpu_s + d.local_cpu_s,
            sum_.wall_s + d.wall_s,
        )


class StandingPool:
    """Worker processes forked once, before the host's threads start, and lent to one
    executor at a time, for its batches of forward runs until it closes (`lend`/`give_back`).
    A pool that lost a worker is stopped and lends no more: later batches run in threads."""

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise InterventionError(f"a standing pool needs at least 1 worker, got {workers}")
        if threading.active_count() > 1:
            raise InterventionError(
                "a standing pool must be started before the process starts threads"
            )
        self.workers = workers
        self.pool: WorkerPool | None = WorkerPool(workers)
        self._lock = threading.Lock()

    def lend(self) -> WorkerPool | None:
        """The pool for one executor, or None when another one has it (or it is stopped)."""
        if self.pool is None or not self._lock.acquire(blocking=False):
            return None
        if self.pool is not None and not self.pool.healthy():
            # a worker died since the last batch (killed, out of memory): no more pool
            self.pool.stop()
            self.pool = None
        if self.pool is None:
            self._lock.release()
            return None
        return self.pool

    def give_back(self, broken: bool = False) -> None:
        """The executor is done with it; `broken`: a batch lost a worker, so the pool is
        stopped."""
        if broken and self.pool is not None:
            self.pool.stop()
            self.pool = None
        self._lock.release()

    def close(self) -> None:
        """The host is shutting down: idle workers leave as told; with a batch in flight they
        are stopped (their branches close as stopped, the batch fails) rather than waited
        for, as a long attribution could hold the shutdown for minutes."""
        pool, self.pool = self.pool, None
        if pool is None:
            return
        if self._lock.acquire(blocking=False):
            try:
                pool.close()
            finally:
                self._lock.release()
        else:
            pool.stop()


_standing: StandingPool | None = None


def start_standing_pool(workers: int) -> StandingPool:
    """Fork this process's standing pool of `workers` processes (before any thread starts)."""
    global _standing
    if _standing is not None:
        _standing.close()
    _standing = StandingPool(workers)
    return _standing


def standing_pool() -> StandingPool | None:
    """This process's standing pool, if its host started one."""
    return _standing


class LocalExecutor:
    """Today's way: `concurrency` branches at once in this process (threads) or in forked
    processes (at most one per CPU), or one after the other (inline)."""

    name = "local"

    def __init__(
        self,
        mode: str,
        concurrency: int,
        parent: ParentInfo | None = None,
        *,
        standing: StandingPool | None = None,
    ) -> None:
        """`standing`: in processes mode, run on that pool instead of forking one (the host
        has threads); lent at this executor's first batch that finds it free and kept until
        `close`, so that a request between two looks of an attribution cannot take it from
        the rest of the attribution."""
        if mode not in MODES:
            raise InterventionError(f"unknown local mode {mode!r}; expected one of {MODES}")
        if concurrency < 1:
            raise InterventionError(f"concurrency must be at least 1, got {concurrency}")
        self.mode = mode
        self.concurrency = concurrency
        self._procs: WorkerPool | None = None
        self._standing = standing if mode == "processes" else None
        #: what the standing pool's processes did in this executor's batches (for stats)
        self._lent: _Accounts | None = None
        #: the standing pool while this executor has it lent
        self._held: WorkerPool | None = None
        self._threads: cf.ThreadPoolExecutor | None = None
        self._workers = 1
        if self._standing is not None:
            self._workers = 1 + self._standing.workers
        elif mode == "processes":
            self._workers = min(concurrency, os.cpu_count() or 1)
            if parent is not None and self._workers > 1:
                self._start_pool(parent)
        elif mode == "threads":
            self._workers = concurrency

    def _start_pool(self, parent: ParentInfo) -> WorkerPool:
        """The forked workers beside this process; before the fork, so that they inherit the
        parent and the branch bases computed so far."""
        _inherited[parent.run_id] = parent
        self._procs = WorkerPool(self._workers - 1)
        return self._procs

    def stats(self) -> ExecutorStats:
        pool = self._procs or self._lent
        if pool is None:
            return ExecutorStats(name=self.name, workers=self._workers)
        return ExecutorStats(
            name=self.name,
            workers=self._workers,
            busy_s=[round(b, 4) for b in (pool.local_busy_s, *pool.busy_s)],
            cpu_s=[round(c, 4) for c in (pool.local_cpu_s, *pool.cpu_s)],
            wall_s=round(pool.wall_s, 4),
        )

    def map(
        self,
        journal: Journal,
        parent: ParentInfo,
        job: Job,
        args: Sequence[Any],
        on_done: OnDone,
        labels: Collection[str] = (),
    ) -> None:
        if self._standing is not None:
            self._map_standing(self._standing, journal, parent, job, args, on_done)
        elif self.mode == "processes" and self._workers > 1:
            # this process runs branches too, beside `concurrency - 1` forked workers: it
            # holds what the branches need already (the bases, the journal's caches)
            pool = self._procs or self._start_pool(parent)
            target = str(journal.path) if journal.path is not None else journal.url
            items = [(target, parent.run_id, job, a) for a in args]
            before, journal.parallel_writers = journal.parallel_writers, True
            try:
                pool.run(
                    _process_job, items, on_done, local=lambda item: job(journal, parent, item[3])
                )
            finally:
                journal.parallel_writers = before
        elif self.mode == "threads":
            self._map_threads(journal, parent, job, args, on_done)
        else:  # inline, or processes on one CPU
            for i, a in enumerate(args):
                on_done(i, job(journal, parent, a))
                check()

    def _map_threads(
        self, journal: Journal, parent: ParentInfo, job: Job, args: Sequence[Any], on_done: OnDone
    ) -> None:
        # imported here: its import (and the standard library's logging with it) is ~2 ms
        # of the start-up of every command that never runs a thread pool
        import concurrent.futures as cf

        if self._threads is None:
            # as wide as the bound: a default pool would silently cap the concurrency
            self._threads = cf.ThreadPoolExecutor(max_workers=self.concurrency)
        futures = {self._threads.submit(job, journal, parent, a): i for i, a in enumerate(args)}
        pending = set(futures)
        while pending:
            finished, pending = cf.wait(pending, timeout=0.05, return_when=cf.FIRST_COMPLETED)
            for fut in finished:
                on_done(futures[fut], fut.result())
            if STOP.is_set():
                # running branches stop at their next step; give them a moment
                cf.wait(pending, timeout=GRACE)
                raise Interrupted()

    def _map_standing(
        self,
        standing: StandingPool,
        journal: Journal,
        parent: ParentInfo,
        job: Job,
        args: Sequence[Any],
        on_done: OnDone,
    ) -> None:
        """One batch on the standing pool, this thread running items too; in threads when
        another executor has the pool (it is kept from the first batch that gets it until
        `close`)."""
        pool = self._held
        if pool is None:
            pool = self._held = standing.lend()
        if pool is None:
            self._map_threads(journal, parent, job, args, on_done)
            return
        target = str(journal.path) if journal.path is not None else journal.url
        items = [(target, parent, job, a) for a in args]
        broken = False
        start = _Accounts.of(pool)
        before, journal.parallel_writers = journal.parallel_writers, True
        try:
            pool.run(_shipped_job, items, on_done, local=lambda item: job(journal, parent, item[3]))
        except EngineError:
            broken = not pool.healthy()
            raise
        finally:
            journal.parallel_writers = before
            self._lent = _Accounts.since(pool, start, self._lent)
            if broken:
                self._give_back(broken=True)

    def _give_back(self, broken: bool = False) -> None:
        if self._held is not None and self._standing is not None:
            self._held = None
            self._standing.give_back(broken)

    def close(self, interrupted: bool = False) -> None:
        self._give_back()
        if self._procs is not None:
            if interrupted:
                self._procs.stop()
            else:
                self._procs.close()
            self._procs = None
        if self._threads is not None:
            # never wait for threads stuck in a network call after an interrupt
            self._threads.shutdown(wait=not interrupted, cancel_futures=True)
            self._threads = None
