"""Forward runs on a real Ray cluster writing to a real PostgreSQL journal (`--executor ray`).

The session starts a one-node Ray cluster with `ray start --head` on 127.0.0.1 (tests/servers.py
`ray_head`) and a throwaway PostgreSQL server; this process joins the cluster as a driver, and
the commands it runs join it through `--ray-address`."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
from servers import free_port, ray_head

from engine import events as ev
from engine.branching import attribute
from engine.errors import ConfigError
from engine.executors.base import ExecutorOptions
from engine.executors.ray import RayExecutor
from engine.heist.session import record_heist
from engine.heist.sim import SimPolicy
from engine.interventions import DoResample, fork_many
from engine.journal import Journal
from engine.policies.registry import make_policy
from engine.scenario import Rerun

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def ray_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A running Ray cluster; this test process is connected to it as a driver."""
    with ray_head(tmp_path_factory.mktemp("ray-head")) as address:
        import ray  # after ray_head set the token: Ray reads its settings on import

        ray.init(address=address, log_to_driver=False, logging_level="ERROR")
        try:
            yield address
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def pg(pg_url: str) -> Iterator[tuple[Journal, str]]:
    """The shared PostgreSQL journal and a failed sim heist recorded in it (seed 7)."""
    j = Journal(pg_url)
    rec = record_heist(j, SimPolicy(), seed=7)
    assert rec.status == "completed" and rec.outcome["bad"]
    yield j, rec.run_id
    j.close()


def car(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
    )


def branch_record(j: Journal, run_id: str) -> tuple[str, bool | None, int, list[str]]:
    """What must not depend on the executor: status, outcome, branch seed, and the hash of
    every event the branch itself appended, minus the measured latency of a model call (run
    ids and the journal's chained row hashes differ by design)."""
    own = [e for e in j.read(run_id) if e.run_id == run_id]
    opening = own[0].event
    assert isinstance(opening, ev.Intervention)
    last = own[-1].event
    assert isinstance(last, ev.RunEnded)
    bad = last.outcome.get("bad")
    digests = []
    for e in own:
        event = e.event
        if isinstance(event, ev.LlmCall):
            event = msgspec.structs.replace(event, latency_ms=0.0)
        digests.append(e.kind + ":" + hashlib.sha256(msgspec.json.encode(event)).hexdigest()[:16])
    return last.status, None if bad is None else bool(bad), opening.branch_seed, digests


def branch_event(e: Any) -> Any:
    event = e.event
    return (
        msgspec.structs.replace(event, latency_ms=0.0) if isinstance(event, ev.LlmCall) else event
    )


def new_branches(j: Journal, run_id: str, before: set[str]) -> dict[str, str]:
    """label -> run id of the branches of `run_id` made since `before` (labels carry the
    deterministic branch key, so the same forward run has the same label on any executor)."""
    found = {c.label: c.run_id for c in j.children(run_id) if c.run_id not in before}
    assert len(found) == len([c for c in j.children(run_id) if c.run_id not in before])
    return found


def test_attribution_on_ray_equals_local_branch_by_branch(
    pg: tuple[Journal, str], ray_address: str
) -> None:
    """One contrastive attribution (fixed K=3 per step, seed 5) run by the local executor and by
    Ray workers gives the same ranking and locus, and the same branches: per deterministic key
    the same status, outcome, branch seed and byte-identical event payloads."""
    j, run = pg
    before = {c.run_id for c in j.children(run)}
    local = attribute(
        j, run, method="contrastive", k=3, seed=5, rerun=Rerun(concurrency=2, reuse=False)
    )
    local_branches = new_branches(j, run, before)
    before |= set(local_branches.values())
    remote = attribute(
        j,
        run,
        method="contrastive",
        k=3,
        seed=5,
        rerun=Rerun(
            concurrency=4,
            reuse=False,
            executor=ExecutorOptions(kind="ray", address=ray_address, workers=2),
        ),
    )
    ray_branches = new_branches(j, run, before)
    assert local["executor"]["name"] == "local" and remote["executor"]["name"] == "ray"
    assert remote["executor"]["workers"] == 2 and remote["executor"]["lost"] == 0
    assert local["forward_runs"] == remote["forward_runs"] == len(local_branches) > 50
    assert set(local_branches) == set(ray_branches)
    for label, rid in local_branches.items():
        assert branch_record(j, rid) == branch_record(j, ray_branches[label]), label
    assert local["ranked"] == remote["ranked"] and local["locus"] == remote["locus"]
    assert j.verify().ok


def test_fork_with_executor_ray_from_the_command_line(
    pg: tuple[Journal, str], pg_url: str, ray_address: str
) -> None:
    """`car fork --executor ray --ray-address HOST:PORT` runs its branches on the cluster and
    reports the same outcomes as `--executor local` with the same seed."""
    import json

    _, run = pg
    common = ["--journal", pg_url, "fork", run, "--at", "12", "--do", "resample", "-n", "6"]
    local = car(*common, "--seed", "3", "--json")
    assert local.returncode == 0, local.stderr
    remote = car(
        *common, "--seed", "3", "--json", "--executor", "ray", "--ray-address", ray_address
    )
    assert remote.returncode == 0, remote.stderr
    a, b = json.loads(local.stdout), json.loads(remote.stdout)
    assert b["executor"]["name"] == "ray" and b["executor"]["retried"] == 0
    assert [x["bad"] for x in a["branches"]] == [x["bad"] for x in b["branches"]]
    assert a["bad"] == b["bad"] and a["scored"] == b["scored"] == 6
    human = car(*common, "--seed", "4", "--executor", "ray", "--ray-address", ray_address)
    assert human.returncode == 0, human.stderr
    assert "executor ray: 2 workers" in human.stdout


@contextmanager
def slow_llm_server(latency: float) -> Iterator[str]:
    """The benchmarks' OpenAI-compatible server (bench/bench_fork.py --serve): every completion
    takes `latency` seconds, the reply depends only on the request's seed."""
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "bench_fork.py"), "--serve", "--latency",
         str(latency)],
        stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        port = proc.stdout.readline().strip()
        assert port.isdigit(), port
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_worker_killed_mid_branch_is_retried_and_leaves_whole_steps(
    pg: tuple[Journal, str], ray_address: str
) -> None:
    """A Ray worker killed (SIGKILL of its process) while its branch waits on the model: the
    branch it was writing holds whole steps only and is closed as stopped naming the worker;
    the forward run is run once more on a new worker and gets the outcome the local executor
    gets for the same seed; the report counts the retry; the journal verifies."""
    j, _ = pg
    with slow_llm_server(0.15) as url:
        policy = make_policy({"name": "openai", "base_url": url, "model": "bench"})
        rec = record_heist(j, policy, seed=3, rounds=2, server=url)
        assert rec.status == "completed", rec.error
        run = rec.run_id
        iv = DoResample(max(0, rec.steps - 6))  # ~6 completions, ~1 s a branch
        ex = RayExecutor(j, address=ray_address, workers=2, concurrency=2)
        report: dict[str, Any] = {}

        def go() -> None:
            report["r"] = fork_many(j, run, iv, 4, seed=11, concurrency=2, executor=ex)

        pids = {pid for pid, _ in ex.worker_pids()}
        t = threading.Thread(target=go)
        t.start()
        victim = None
        deadline = time.monotonic() + 60
        while victim is None and time.monotonic() < deadline:
            for c in j.children(run):
                lease = j.lease(c.run_id)
                own = [e for e in j.read(c.run_id) if e.run_id == c.run_id]
                # mid-branch: past the opening, at least one whole step in, still recording
                if lease and lease.pid in pids and len(own) >= 3:
                    victim = (c.run_id, lease.pid)
                    break
            time.sleep(0.02)
        assert victim is not None, "no branch was seen running"
        os.kill(victim[1], signal.SIGKILL)
        t.join(120)
        ex.close()
        assert not t.is_alive()
        got = report["r"]
        assert got.executor["retried"] >= 1 and got.executor["lost"] == 0
        assert got.executor["closed"] >= 1
        assert got.scored == 4  # every forward run ended with an outcome
        dead = [e for e in j.read(victim[0]) if e.run_id == victim[0]]
        end = dead[-1].event
        assert isinstance(end, ev.RunEnded) and end.status == "stopped"
        assert f"pid {victim[1]}" in (end.error or "")
        assert j.status(victim[0]) == "stopped"
        # whole steps: what the dead worker committed is a step-aligned prefix of its retry
        label = next(c.label for c in j.children(run) if c.run_id == victim[0])
        retry = [
            c.run_id
            for c in j.children(run)
            if c.label == label and c.run_id != victim[0] and j.status(c.run_id) == "completed"
        ]
        assert len(retry) == 1
        redo = [e for e in j.read(retry[0]) if e.run_id == retry[0]]
        body = dead[:-2]  # without the closing Control(stop) and RunEnded
        assert [branch_event(e) for e in body] == [branch_event(e) for e in redo[: len(body)]]
        assert redo[len(body)].step != body[-1].step or body[-1].kind == "intervention"
        local = fork_many(j, run, iv, 4, seed=11, concurrency=2)
        assert [b.bad for b in local.branches] == [b.bad for b in got.branches]
    assert j.verify().ok


def test_unreachable_cluster_is_one_line(pg: tuple[Journal, str], pg_url: str) -> None:
    """A --ray-address where nothing listens: one error line and exit 1, within seconds."""
    _, run = pg
    dead = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    r = car("--journal", pg_url, "attribute", run, "-K", "2", "--executor", "ray",
            "--ray-address", dead)  # fmt: skip
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        r.stderr.strip().splitlines()[0]
    ] and r.stderr.startswith(f"error: cannot reach the Ray cluster at '{dead}'")
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--executor", "ray"], "needs a PostgreSQL journal"),
        (["--executor", "spark"], "'spark' is not one of: local, ray"),
        (["--ray-address", "auto"], "applies to --executor ray only"),
        (["--workers", "2"], "applies to --executor ray only"),
    ],
)
def test_bad_executor_choices_are_one_line(tmp_path: Path, args: list[str], match: str) -> None:
    """SQLite with --executor ray is refused before any work (a worker elsewhere could not
    open the file), as are an unknown executor and Ray flags without --executor ray."""
    db = tmp_path / "j.db"
    with Journal(db) as j:
        run = record_heist(j, SimPolicy(), seed=7).run_id
    r = car("--journal", str(db), "fork", run, "--at", "3", "--do", "resample", "-n", "2", *args)
    assert r.returncode != 0
    assert match in r.stderr and len(r.stderr.strip().splitlines()) <= 3, r.stderr
    with Journal(db) as j:
        assert j.children(run) == []  # nothing was run


def test_sqlite_journal_refused_in_process(tmp_path: Path) -> None:
    """The executor itself refuses a SQLite journal with the same one line (ConfigError)."""
    with Journal(tmp_path / "j.db") as j, pytest.raises(ConfigError, match="PostgreSQL journal"):
        RayExecutor(j, address="auto")


def test_causal_detector_on_ray_equals_local(pg: tuple[Journal, str], ray_address: str) -> None:
    """`detect --method causal` with fixed runs: the same counts per agent on both executors."""
    from engine.detect import analyze

    j, run = pg
    opts: dict[str, Any] = {"k_max": 4, "sequential": False, "seed": 2}
    local = analyze(j, run, method="causal", concurrency=2, **opts)
    remote = analyze(
        j,
        run,
        method="causal",
        concurrency=4,
        executor=ExecutorOptions(kind="ray", address=ray_address, workers=2),
        **opts,
    )
    assert remote["executor"]["name"] == "ray"
    assert local["causal"] == remote["causal"]
    assert local["suspicion_scores"] == remote["suspicion_scores"]


def _exit_worker(journal: Journal, parent: Any, arg: Any) -> Any:
    """A job whose worker process exits under it, every time (a crash that repeats)."""
    os._exit(1)


def test_a_forward_run_lost_twice_is_failed_and_counted(
    pg: tuple[Journal, str], ray_address: str
) -> None:
    """A forward run whose worker dies on every attempt (the process exits for real) is run
    once more on a fresh worker, then reported as a failed forward run; the executor counts one
    retry and one loss and keeps working: a normal branch after it still runs."""
    import ray.cloudpickle

    from engine.interventions import BranchSpec, branch_job, parent_info

    j, run = pg
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests
    parent = parent_info(j, run)
    ex = RayExecutor(j, address=ray_address, workers=1)
    try:
        got: dict[int, Any] = {}
        ex.map(j, parent, _exit_worker, [0], got.__setitem__)
        assert got[0].status == "failed" and got[0].bad is None
        assert "lost twice" in (got[0].error or "")
        stats = ex.stats()
        assert (stats.retried, stats.lost) == (1, 1)
        ok: dict[int, Any] = {}
        ex.map(j, parent, branch_job, [(BranchSpec(DoResample(20), 1), None)], ok.__setitem__)
        assert ok[0].status == "completed" and ok[0].bad is not None
    finally:
        ex.close()
