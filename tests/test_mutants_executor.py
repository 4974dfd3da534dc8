"""An executor on the server's standing pool, in this process (the mutation runs see only what
runs in the test's own process): it keeps the pool from its first batch to its close, another
executor meanwhile runs in threads, and a batch that loses a worker ends the pool.

A standing pool forks, so it must be started before the process has threads: when the test
process has some (other tests' leftovers), the same checks run in a fresh process instead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _whose(journal: Any, parent: Any, _: int) -> tuple[int, int, bool]:
    """A forward run's stand-in: which process ran it, the parent's head as the journal it
    was handed reads it, and whether that journal wrote as one of several writers."""
    time.sleep(0.05)
    return os.getpid(), journal.head(parent.run_id), bool(journal.parallel_writers)


def _die_in_a_worker(journal: Any, parent: Any, host: int) -> int:
    """Kills the worker process that runs it (as the out-of-memory killer would); in the
    host process (`host`) a forward run that takes a while."""
    if os.getpid() != host:
        os._exit(3)
    time.sleep(0.2)
    return host


def _scenario(tmp: str) -> dict[str, Any]:
    from engine.errors import EngineError
    from engine.executors.local import LocalExecutor, start_standing_pool
    from engine.heist.session import record_heist
    from engine.heist.sim import SimPolicy
    from engine.interventions import parent_info
    from engine.journal import Journal

    me = os.getpid()
    standing = start_standing_pool(1)
    out: dict[str, Any] = {}
    try:
        with Journal(Path(tmp) / "j.db") as j:
            run = record_heist(j, SimPolicy(), seed=7, rounds=1).run_id
            parent = parent_info(j, run)
            head = j.head(run)
            ex = LocalExecutor("processes", 2, parent, standing=standing)

            def batch(executor: LocalExecutor, job: Any = _whose, n: int = 8) -> list[Any]:
                got: dict[int, Any] = {}
                executor.map(j, parent, job, [me] * n, got.__setitem__)
                return [got[i] for i in range(n)]

            first = batch(ex)
            out["first_by_worker"] = any(pid != me for pid, _, _ in first)
            out["first_by_me"] = any(pid == me for pid, _, _ in first)
            out["heads"] = sorted({h for _, h, _ in first}) == [head]
            out["mine_parallel"] = all(p for pid, _, p in first if pid == me)
            out["restored"] = j.parallel_writers is False
            first_wall = ex.stats().wall_s or 0.0
            # another executor meanwhile: the pool is held, it runs in threads here
            other = LocalExecutor("processes", 2, parent, standing=standing)
            out["other_here"] = all(pid == me for pid, _, _ in batch(other))
            other.close()
            out["held_after_other_closed"] = standing.lend() is None
            second = batch(ex)
            out["second_by_worker"] = any(pid != me for pid, _, _ in second)
            stats = ex.stats()
            out["busy"] = stats.busy_s is not None and len(stats.busy_s) == 2
            out["worker_busy"] = bool(stats.busy_s and stats.busy_s[1] > 0)
            # the executor's accounts add its batches up (each takes 0.2 s or more)
            out["summed"] = (stats.wall_s or 0.0) >= first_wall + 0.15
            ex.close()
            ex.close()  # a second close gives nothing back twice
            again = standing.lend()
            out["free_after_close"] = again is not None
            out["lent_once"] = standing.lend() is None
            if again is not None:
                standing.give_back()
            # a batch that loses a worker: the error, then no pool for anyone
            broken = LocalExecutor("processes", 2, parent, standing=standing)
            try:
                batch(broken, _die_in_a_worker, 4)
                out["lost_worker_error"] = False
            except EngineError:
                out["lost_worker_error"] = True
            # stopped at once, not at the next lend
            out["pool_gone"] = standing.pool is None and standing.lend() is None
            out["after_in_threads"] = all(pid == me for pid, _, _ in batch(broken))
            broken.close()
    finally:
        standing.close()
    return out


def test_an_executor_holds_the_standing_pool_until_it_closes(tmp_path: Path) -> None:
    if threading.active_count() == 1:
        seen = _scenario(str(tmp_path))
    else:
        res = subprocess.run(
            [sys.executable, "-c",
             "import json, sys; from tests.test_mutants_executor import _scenario;"
             " print(json.dumps(_scenario(sys.argv[1])))", str(tmp_path)],
            capture_output=True, text=True, timeout=300, cwd=ROOT,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr
        seen = json.loads(res.stdout.strip().splitlines()[-1])
    assert seen == {
        "first_by_worker": True,
        "first_by_me": True,
        "heads": True,
        "mine_parallel": True,
        "restored": True,
        "other_here": True,
        "held_after_other_closed": True,
        "second_by_worker": True,
        "busy": True,
        "worker_busy": True,
        "summed": True,
        "free_after_close": True,
        "lent_once": True,
        "lost_worker_error": True,
        "pool_gone": True,
        "after_in_threads": True,
    }
