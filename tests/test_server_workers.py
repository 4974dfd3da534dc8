"""The server's standing pool: sim branches of forks and attributions with concurrency > 1
run in worker processes forked once at start, before the server's threads (`car serve
--workers N`), so that `concurrency` gains CPU where threads could not (the GIL)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server_helpers import car_serve, finished_heist
from tests.test_server_hostile import children_of


def _fork(c: httpx.Client, sid: str, seed: int, concurrency: int, n: int = 24) -> dict[str, Any]:
    body = {"at": 4, "do": "resample", "n": n, "seed": seed, "concurrency": concurrency}
    r = c.post(f"/api/sessions/{sid}/fork", json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_forks_run_in_the_standing_workers_with_the_outcomes_of_threads(tmp_path: Path) -> None:
    """With `--workers 1` a fork of concurrency 2 runs its branches in two processes (the
    worker's share of the batch is reported, and its pid is a child forked at start, the same
    before and after); the same fork (same seeds) on a server with `--workers 0` runs in
    threads; both give the same bad rate and the same verdict for each branch."""
    reports: dict[int, dict[str, Any]] = {}
    for workers in (1, 0):
        journal = tmp_path / f"w{workers}.db"
        with car_serve(journal, "--workers", str(workers), "--sim-step-delay", "0") as s:
            kids = children_of(s.proc.pid)
            assert len(kids) == workers
            with s.client(timeout=120) as c:
                sid = finished_heist(c)
                report = _fork(c, sid, seed=11, concurrency=2)
            assert children_of(s.proc.pid) == kids
        reports[workers] = report
    pooled, threaded = reports[1]["executor"], reports[0]["executor"]
    assert pooled["workers"] == 2 and len(pooled["busy_s"]) == 2
    assert pooled["busy_s"][1] > 0, pooled  # the worker process ran branches
    assert threaded["busy_s"] is None  # threads: no per-process accounts
    assert reports[1]["scored"] == reports[0]["scored"] == 24
    assert reports[1]["bad_rate"] == reports[0]["bad_rate"]
    # branch i of both forks has the same seed: the same outcome, whatever ran it
    assert [b["bad"] for b in reports[1]["branches"]] == [b["bad"] for b in reports[0]["branches"]]


def test_a_second_batch_meanwhile_runs_in_threads_and_a_dead_worker_is_replaced_by_threads(
    tmp_path: Path,
) -> None:
    """Two forks of concurrency 2 at once both answer 200 with every branch scored (while one
    has the pool, the other runs in threads); after the worker is killed (SIGKILL, as the
    out-of-memory killer would), the next fork still answers 200, in threads, and the server
    forks no new process."""
    journal = tmp_path / "j.db"
    with car_serve(journal, "--workers", "1", "--sim-step-delay", "0") as s:
        (worker,) = children_of(s.proc.pid)
        with s.client(timeout=120) as c:
            sid = finished_heist(c)
            results: list[dict[str, Any] | None] = [None, None]

            def call(i: int) -> None:
                with s.client(timeout=120) as own:
                    results[i] = _fork(own, sid, seed=20 + i, concurrency=2, n=40)

            threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert all(r is not None and r["scored"] == 40 for r in results), results
            os.kill(worker, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while worker in children_of(s.proc.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            after = _fork(c, sid, seed=30, concurrency=2)
            assert after["scored"] == 24 and after["executor"]["busy_s"] is None
            assert children_of(s.proc.pid) == set()


@pytest.mark.parametrize("value", ["-1", "65", "x"])
def test_workers_out_of_range_is_a_usage_error(tmp_path: Path, value: str) -> None:
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-m", "cli", "--journal", str(tmp_path / "j.db"), "serve",
         "--port", "0", "--workers", value],
        capture_output=True, text=True, timeout=60,
        cwd=Path(__file__).resolve().parent.parent,
    )  # fmt: skip
    assert res.returncode == 2 and "--workers" in res.stderr, res.stderr
    assert not (tmp_path / "j.db").exists()


def test_a_journal_on_postgresql_forks_no_workers(pg_url: str) -> None:
    """Sim branches on a PostgreSQL journal run in threads (as the CLI's do), so the server
    forks no standing pool for them, whatever --workers says."""
    from journal_helpers import fresh_pg_database

    target = fresh_pg_database(pg_url, "serve")
    with car_serve(target, "--workers", "1") as s:  # type: ignore[arg-type]
        assert children_of(s.proc.pid) == set()


def test_an_executor_keeps_the_standing_pool_from_its_first_batch_to_its_close(
    tmp_path: Path,
) -> None:
    """An attribution's looks are batches of one executor: between two of them another
    request found the pool free and took it, and the attribution's later looks ran in
    threads. Now the executor keeps it until it closes: in between, `lend` gives nobody the
    pool; after, it does. In a process of its own with no threads (a standing pool forks)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        f"""
        from engine.executors.local import LocalExecutor, start_standing_pool
        from engine.heist.session import record_heist
        from engine.heist.sim import SimPolicy
        from engine.interventions import DoResample, BranchSpec, parent_info, branch_job
        from engine.journal import Journal

        standing = start_standing_pool(1)
        with Journal({str(tmp_path / "j.db")!r}) as j:
            run = record_heist(j, SimPolicy(), seed=7, rounds=1).run_id
            parent = parent_info(j, run)
            ex = LocalExecutor("processes", 2, parent, standing=standing)
            done = {{}}
            for look in range(2):
                specs = [(BranchSpec(DoResample(3), 100 * look + i), None) for i in range(6)]
                ex.map(j, parent, branch_job, specs, done.__setitem__)
                print("held", standing.lend() is None)
            print("worker ran", ex.stats().busy_s[1] > 0)
            ex.close()
            again = standing.lend()
            print("free", again is not None)
            standing.give_back()
        standing.close()
        """
    )
    res = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
        cwd=Path(__file__).resolve().parent.parent,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[:4] == ["held True", "held True", "worker ran True", "free True"]
