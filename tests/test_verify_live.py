"""`car verify` of a journal that another process is appending to: every read of the check
sees one moment of the journal (decision 51). It read the runs table, then the events, then
the texts, each at its own moment, and named the branches created in between as "events of
run_key K, which names no run (deleted run or forged events)": a false alarm of tampering on
every check taken during a `car fork` or `car attribute` (and, with the check of unused
texts, texts whose rows came after). On SQLite and on PostgreSQL, with a real `car fork`
writing beside it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from journal_helpers import ROOT, car

from engine.heist.session import record_heist
from engine.heist.sim import SimPolicy
from engine.journal import Journal


@pytest.fixture
def target(journal_target: str) -> str:
    return journal_target


def _runs(target: str) -> int:
    with Journal(target, readonly=True) as j:
        return len(j.runs())


def test_verify_while_a_fork_appends_is_ok(target: str) -> None:
    with Journal(target) as j:
        run = record_heist(j, SimPolicy(), seed=7, rounds=2).run_id
    fork = subprocess.Popen(
        [sys.executable, "-m", "cli", "--journal", target, "fork", run, "--at", "3",
         "--do", "resample", "-n", "3000", "--json"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while _runs(target) < 5:
            assert fork.poll() is None and time.monotonic() < deadline, fork.stderr
            time.sleep(0.05)
        seen = []
        for _ in range(6):
            with Journal(target, readonly=True) as j:
                report = j.verify()
            assert report.ok, [str(p) for p in report.problems][:5]
            seen.append(report.runs_checked)
            if target.endswith(".db"):
                res = car(Path(target), "verify")
                assert res.returncode == 0 and res.stdout.startswith("OK"), res.stdout[-2000:]
        # the fork wrote between the checks (it may have ended since: that is no matter)
        assert len(set(seen)) > 1, f"no branch was added during the checks: {seen}"
    finally:
        os.killpg(fork.pid, signal.SIGINT)
        fork.wait(timeout=30)
    with Journal(target, readonly=True) as j:
        assert j.verify().ok
