"""The worker pool of `-c N` (engine/workers.py): one set of forked processes per command, a
batch sent whole to each, its items claimed one at a time through shared memory — workers
from the front, the command from the back — so nobody waits to be handed work. Real forked
processes throughout; the one fault that cannot be produced through the pool itself (a
process dying while it holds the claim lock) is produced with a real process that takes the
real lock and is killed with SIGKILL."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import threading
import time

import pytest

from engine.errors import EngineError
from engine.workers import WorkerPool, _Claims


def _tagged(item: int) -> tuple[int, int]:
    time.sleep(0.002)  # long enough for both processes to take items
    return os.getpid(), item


def _fails_at_3(item: int) -> tuple[int, int]:
    if item == 3:
        raise ValueError("item 3 is bad")
    time.sleep(0.002)
    return os.getpid(), item


def _kills_itself_at_5(item: int) -> tuple[int, int]:
    if item == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.002)
    return os.getpid(), item


def _collect(pool: WorkerPool, fn, items, local=None) -> dict[int, tuple[int, int]]:  # type: ignore[no-untyped-def]
    got: dict[int, tuple[int, int]] = {}

    def done(i: int, r: tuple[int, int]) -> None:
        assert i not in got, f"item {i} reported twice"
        got[i] = r

    pool.run(fn, items, done, local=local)
    return got


def test_each_item_runs_once_workers_from_the_front_the_command_from_the_back() -> None:
    with WorkerPool(1) as pool:
        worker = pool.pids()[0]
        got = _collect(pool, _tagged, range(40), local=_tagged)
    assert sorted(got) == list(range(40))
    assert all(r[1] == i for i, r in got.items())  # each result reaches its own index
    by_worker = sorted(i for i, r in got.items() if r[0] == worker)
    by_command = sorted(i for i, r in got.items() if r[0] == os.getpid())
    assert by_worker and by_command, (by_worker, by_command)
    # the two ends meet: everything the worker ran comes before everything the command ran
    assert max(by_worker) < min(by_command)
    assert by_worker == list(range(len(by_worker)))


def test_one_pool_serves_every_batch_and_an_empty_one() -> None:
    with WorkerPool(2) as pool:
        workers = set(pool.pids())
        seen: set[int] = set()
        for size in (7, 0, 1, 25):
            got = _collect(pool, _tagged, range(size))  # no local: the workers run all
            assert sorted(got) == list(range(size))
            seen |= {r[0] for r in got.values()}
        assert set(pool.pids()) == workers
    assert seen == workers


def test_an_error_in_a_worker_is_raised_and_the_pool_serves_the_next_batch() -> None:
    with WorkerPool(1) as pool:
        with pytest.raises(ValueError, match="item 3 is bad"):
            _collect(pool, _fails_at_3, range(30))
        # the worker ended the failed batch before the next one began: no stale results
        got = _collect(pool, _tagged, range(10), local=_tagged)
        assert sorted(got) == list(range(10))


def test_an_error_in_the_command_winds_the_workers_down_first() -> None:
    with WorkerPool(1) as pool:
        worker = pool.pids()[0]
        with pytest.raises(ValueError, match="item 3 is bad"):
            # the command takes from the back, so give it the failing item at once
            _collect(pool, _tagged, [0, 1, 2, 4, 5, 6, 7, 3], local=_fails_at_3)
        got = _collect(pool, _tagged, range(12))
        assert sorted(got) == list(range(12)) and {r[0] for r in got.values()} == {worker}


def test_a_worker_killed_in_a_batch_is_an_error_not_a_hang() -> None:
    with WorkerPool(1) as pool:
        started = time.monotonic()
        with pytest.raises(EngineError, match="a worker process died"):
            _collect(pool, _kills_itself_at_5, range(30))
        assert time.monotonic() - started < 5
        assert pool.pids() == []  # what was left of the pool is stopped


def _hold_and_die(claims: _Claims) -> None:
    with claims._locked():
        os.kill(os.getpid(), signal.SIGKILL)


def test_a_process_killed_holding_the_claim_lock_does_not_block_the_others() -> None:
    """The kernel drops a dead process's record lock: the next claim goes through at once."""
    claims = _Claims()
    claims.reset(3)
    holder = mp.get_context("fork").Process(target=_hold_and_die, args=(claims,))
    holder.start()
    holder.join(5)
    assert holder.exitcode == -signal.SIGKILL
    started = time.monotonic()
    assert claims.back() == 2 and claims.front() == 0
    assert time.monotonic() - started < 1.0


def test_the_claim_lock_excludes_another_process() -> None:
    """While another process holds the lock, a claim waits for it (a real second process)."""
    claims = _Claims()
    claims.reset(2)
    ctx = mp.get_context("fork")
    taken, release = ctx.Event(), ctx.Event()

    def hold() -> None:
        with claims._locked():
            taken.set()
            release.wait(5)

    holder = ctx.Process(target=hold)
    holder.start()
    assert taken.wait(5)
    timer = threading.Timer(0.2, release.set)
    timer.start()
    started = time.monotonic()
    assert claims.front() == 0
    waited = time.monotonic() - started
    timer.join()
    holder.join(5)
    assert waited >= 0.15, waited


def test_claims_meet_in_the_middle_and_close_ends_the_batch() -> None:
    claims = _Claims()
    claims.reset(5)
    assert [claims.front(), claims.back(), claims.front(), claims.back()] == [0, 4, 1, 3]
    assert claims.front() == 2
    assert claims.front() is None and claims.back() is None
    claims.reset(4)
    assert claims.front() == 0
    claims.close()
    assert claims.front() is None and claims.back() is None


def _frozen_here(item: int) -> tuple[int, int]:
    time.sleep(0.002)  # long enough for both processes to take items
    return os.getpid(), gc.get_freeze_count()


def test_what_the_command_holds_at_the_fork_is_frozen_while_the_pool_lives() -> None:
    """The objects alive when the pool forks are out of the collector's reach in the command
    and in every worker while the pool lives (no collection walks them again, nor writes to
    the pages the processes share), and back in the command's collector once the pool has
    closed or stopped."""
    gc.unfreeze()  # whatever another test's pool left frozen
    for ending in ("close", "stop"):
        # frozen objects may still die of their last reference (and leave the count): most
        # of what the process holds, its modules and functions, does not
        most = len(gc.get_objects()) // 2
        pool = WorkerPool(1)
        assert gc.get_freeze_count() > most
        found = _collect(pool, _frozen_here, range(8), local=_frozen_here)
        assert {pid for pid, _ in found.values()} == {os.getpid(), *pool.pids()}
        assert all(count > most for _, count in found.values())
        getattr(pool, ending)()
        assert gc.get_freeze_count() == 0, ending


def _count_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts fds through /proc")
def test_a_closed_pool_leaves_no_descriptor_and_refuses_work() -> None:
    """Pipes and the claims' shared file are closed with the pool, whether it closes or
    stops; a batch handed to a closed pool is an error, not a hang."""
    before = _count_fds()
    for ending in ("close", "stop"):
        pool = WorkerPool(2)
        assert sorted(_collect(pool, _tagged, range(6), local=_tagged)) == list(range(6))
        getattr(pool, ending)()
        assert _count_fds() == before, ending
        with pytest.raises(EngineError, match="closed"):
            pool.run(_tagged, range(3), lambda i, r: None)


def test_a_worker_gone_before_its_batch_is_an_error() -> None:
    with WorkerPool(1) as pool:
        os.kill(pool.pids()[0], signal.SIGKILL)
        time.sleep(0.2)
        with pytest.raises(EngineError, match="a worker process died"):
            _collect(pool, _tagged, range(20))
        assert pool.pids() == []


def _refuse_in_a_worker(parent: int) -> int:
    if os.getpid() != parent:
        raise RuntimeError("this item cannot be read in a worker")
    return 0


class _ParentOnly:
    """An item that unpickles only in the process that made it: a worker's failure of its
    own, outside any branch (a real one: the worker cannot read its batch)."""

    def __reduce__(self) -> tuple[object, tuple[int]]:
        return _refuse_in_a_worker, (os.getpid(),)


def test_a_failing_worker_logs_one_line_and_no_traceback(
    capfd: pytest.CaptureFixture[str],
) -> None:
    with WorkerPool(1) as pool, pytest.raises(EngineError, match="a worker process died"):
        pool.run(_tagged, [_ParentOnly()], lambda i, r: None)  # type: ignore[list-item]
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "a branch worker failed" in lines[0], err
    assert "this item cannot be read in a worker" in lines[0]
