#!/usr/bin/env python
"""Server forward runs: what `concurrency` gains a fork through the API.

    .venv/bin/python bench/bench_server_fork.py            # table
    .venv/bin/python bench/bench_server_fork.py --json --branches 80 --pairs 5

Starts `car serve` twice on copies of one journal holding the seed-7 heist (embedded `sim`
policy, default crew, 24 steps): once with its standing pool (`--workers 1`: one worker
process forked at start, before the server's threads) and once without (`--workers 0`:
forward runs in the server's threads). On each it sends POST /api/sessions/RUN/fork
(do_resample at step 4, --branches branches, new seeds each time so nothing is reused) with
concurrency 1 and 2, alternately --pairs times, and prints the medians of the wall time of the
requests (from another process) and the speed-up of concurrency 2 over 1 beside this machine's
own two-process throughput (pure Python in two processes at once: the floor a speed-up is to
be read against). Both servers give the same outcomes for the same seeds (checked).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from common import (  # noqa: E402
    add_output_options,
    emit,
    environment,
    loadavg,
    say,
    two_process_throughput,
    work_dir,
)
from server_helpers import car_serve  # noqa: E402


def record(journal: Path) -> str:
    res = subprocess.run(
        [sys.executable, "-m", "cli", "--journal", str(journal), "heist", "--seed", "7",
         "--json"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    import json

    return str(json.loads(res.stdout)["run_id"])


def fork(c: httpx.Client, run: str, seed: int, n: int, concurrency: int) -> tuple[float, Any]:
    body = {"at": 4, "do": "resample", "n": n, "seed": seed, "concurrency": concurrency}
    t0 = time.perf_counter()
    r = c.post(f"/api/sessions/{run}/fork", json=body)
    wall = time.perf_counter() - t0
    if r.status_code != 200:
        raise SystemExit(f"fork failed ({r.status_code}): {r.text}")
    return wall, [b["bad"] for b in r.json()["branches"]]


def measure(n: int, pairs: int, quiet: bool, parent: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"branches": n, "pairs": pairs, "servers": {}}
    say(quiet, "this machine's two-process throughput (pure Python)")
    out["two_process_throughput"] = two_process_throughput()
    outcomes: dict[str, list[Any]] = {}
    with work_dir("car-server-fork-", parent) as work:
        base = work / "base.db"
        run = record(base)
        for workers in (1, 0):
            journal = work / f"w{workers}.db"
            shutil.copyfile(base, journal)
            name = f"--workers {workers}"
            walls: dict[int, list[float]] = {1: [], 2: []}
            serve = car_serve(journal, "--workers", str(workers), "--sim-step-delay", "0")
            with serve as s, s.client(timeout=600) as c:
                fork(c, run, 999_999, 4, 2)  # warm: bases, policy, worker journal
                for i in range(pairs):
                    for conc in (1, 2):
                        say(quiet, f"{name}: fork of {n} at concurrency {conc} ({i + 1})")
                        seed = 1000 * (i + 1) + conc
                        wall, got = fork(c, run, seed, n, conc)
                        walls[conc].append(wall)
                        outcomes.setdefault(f"{seed}", []).append(got)
            m1, m2 = statistics.median(walls[1]), statistics.median(walls[2])
            out["servers"][name] = {
                "c1_s": m1, "c2_s": m2, "speedup": m1 / m2,
                "walls": {str(k): v for k, v in walls.items()},
            }  # fmt: skip
    out["same_outcomes"] = all(len(v) == 2 and v[0] == v[1] for v in outcomes.values())
    return out


def _table(res: dict[str, Any]) -> None:
    print(
        f"fork of {res['branches']} sim branches through the API, medians of {res['pairs']}"
        " alternated pairs"
    )
    for name, r in res["servers"].items():
        print(
            f"  car serve {name}: concurrency 1 {r['c1_s']:.3f} s, 2 {r['c2_s']:.3f} s ="
            f" {r['speedup']:.2f}x"
        )
    print(f"  this machine's two-process throughput: {res['two_process_throughput']:.2f}x")
    print(f"  same outcomes for the same seeds on both servers: {res['same_outcomes']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_options(p)
    p.add_argument("--branches", type=int, default=80, help="branches per fork request")
    p.add_argument("--pairs", type=int, default=5, help="concurrency 1 / 2 requests each")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    a = p.parse_args()
    env = environment(loadavg_start=loadavg())
    res = measure(a.branches, a.pairs, a.quiet, a.dir)
    res["env"] = {**env, "loadavg_end": loadavg()}
    emit(res, a.json, _table)


if __name__ == "__main__":
    main()
