"""Forward runs on this machine: inline, in threads, or in forked worker processes.

Threads wait on a model server (an OpenAI-compatible endpoint, or any branch on a PostgreSQL
journal); forked processes run the embedded policy on a SQLite journal, where the work is CPU
and the GIL would serialise threads. Forked workers inherit the parent infos prepared before
the pool started (and the branch bases computed so far), so nothing is shipped but the job."""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

from engine.errors import InterventionError
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


def _process_job(item: tuple[str, str, Job, Any]) -> BranchResult:
    from engine.journal import Journal

    target, run_id, job, arg = item
    j = _worker_journals.get(target)
    if j is None:
        # one journal per worker process: opening checks the schema, which is not free
        j = _worker_journals[target] = Journal(target)
        # its siblings write the same file at the same time
        j.parallel_writers = True
    return job(j, _inherited[run_id], arg)


class LocalExecutor:
    """Today's way: `concurrency` branches at once in this process (threads) or in forked
    processes (at most one per CPU), or one after the other (inline)."""

    name = "local"

    def __init__(self, mode: str, concurrency: int, parent: ParentInfo | None = None) -> None:
        if mode not in MODES:
            raise InterventionError(f"unknown local mode {mode!r}; expected one of {MODES}")
        if concurrency < 1:
            raise InterventionError(f"concurrency must be at least 1, got {concurrency}")
        self.mode = mode
        self.concurrency = concurrency
        self._procs: WorkerPool | None = None
        self._threads: cf.ThreadPoolExecutor | None = None
        self._workers = 1
        if mode == "processes":
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
        pool = self._procs
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
        if self.mode == "processes" and self._workers > 1:
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
        else:  # inline, or processes on one CPU
            for i, a in enumerate(args):
                on_done(i, job(journal, parent, a))
                check()

    def close(self, interrupted: bool = False) -> None:
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
