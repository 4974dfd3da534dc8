#!/usr/bin/env python
"""Fork benchmark: branches/s of `fork_many` (sim and OpenAI-compatible), and branch opening cost.

    .venv/bin/python bench/bench_fork.py                  # table, about a minute
    .venv/bin/python bench/bench_fork.py --latency 0.5    # slower fake LLM server
    .venv/bin/python bench/bench_fork.py --json           # the numbers as JSON on stdout

Everything is written to SQLite journals in a temporary directory that is removed at the end.

1. sim     forward runs/s of `fork_many(journal, run, do_resample(k=2), n, concurrency=c)` on a
           recorded 4-round `sim` heist (each branch runs the remaining ~22 steps), at c=1 and at
           c=os.cpu_count(); speed-up and efficiency (speed-up / c, target >= 0.7). Repetitions
           alternate between the two; the best of each is kept. Control: the same branches run by
           c processes that each write to their own copy of the journal (`run_branch` in a
           process pool), which shows the speed-up the machine allows without one shared SQLite
           file. Also: `fork_many` with one branch per worker (the fixed cost of going parallel)
           and the time to open a Journal.
2. openai  the same against a local OpenAI-compatible server started by this script in its own
           process (threaded http.server on 127.0.0.1; POST /v1/chat/completions sleeps a fixed
           L seconds, then answers a valid chat completion whose text depends only on the seed).
           A 2-round heist is recorded with the `openai` policy and forked with do_resample at a
           late step, so each branch makes a few completions. branches/s at c = 1, 8 and 32
           (n = waves x c, so every wave is full; 3 x waves at c=1), speed-up vs c=1, efficiency
           = speed-up / c (target >= 0.7), and the peak number of requests the server saw in
           flight at once.
3. open    on a long recorded `sim` heist: ms for `Journal.fork` at an early and a late step
           (target: spread <= 2x), and for opening a branch there = fork + `state_at_seq` at the
           fork point (target: <= 5 ms at every point, spread shown). Beside it, the whole set-up
           `run_branch` does before its first step (also the full-conversation prefix and the
           Intervention append), and `parent_info`, which `fork_many` calls once. Medians.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from common import (
    Row,
    add_output_options,
    emit,
    environment,
    loadavg,
    median_time,
    ms,
    print_footer,
    print_rows,
    remove_db,
    say,
    verdict,
    work_dir,
)

from engine import events as ev
from engine.heist.session import HeistScenario, record_heist
from engine.interventions import (
    DoResample,
    ParentInfo,
    branch_seed_for,
    fork_many,
    op_name,
    parent_info,
    run_branch,
)
from engine.journal import Journal
from engine.policies.registry import make_policy
from engine.projections import conversation
from engine.runtime.recorder import Recorder
from engine.state import SNAPSHOT_EVERY, state_at_seq, step_seq

TARGET_EFFICIENCY = 0.7
TARGET_FORK_SPREAD = 2.0
TARGET_OPEN_MS = 5.0
OPENAI_CONCURRENCY = (1, 8, 32)


# ------------------------------------------------------------------ helpers


def _timed_fork_many(
    j: Journal, run: str, iv: DoResample, n: int, seed: int, concurrency: int
) -> tuple[float, int]:
    """Seconds for one fork_many call, and how many branches completed."""
    t0 = time.perf_counter()
    report = fork_many(j, run, iv, n, seed=seed, concurrency=concurrency)
    dt = time.perf_counter() - t0
    done = sum(1 for b in report.branches if b.status == "completed")
    if done != n:
        errors = {b.error for b in report.branches if b.status != "completed"}
        raise SystemExit(f"{n - done} of {n} branches did not complete: {sorted(map(str, errors))}")
    return dt, done


def _rates(
    j: Journal,
    run: str,
    iv: DoResample,
    plan: dict[int, int],
    reps: int,
    label: str,
    quiet: bool,
    before: Callable[[], None] | None = None,
    after: Callable[[int], None] | None = None,
) -> dict[int, list[float]]:
    """branches/s per concurrency, repetitions alternating between the concurrencies."""
    rates: dict[int, list[float]] = {c: [] for c in plan}
    seed = 1000
    for i in range(reps):
        order = list(plan) if i % 2 == 0 else list(reversed(plan))
        for c in order:
            seed += 1
            if before is not None:
                before()
            dt, done = _timed_fork_many(j, run, iv, plan[c], seed, c)
            rates[c].append(done / dt)
            if after is not None:
                after(c)
            say(quiet, f"  {label} rep {i + 1} c={c}: {plan[c]} branches in {dt:.2f} s")
    return rates


def _scaling(plan: dict[int, int], rates: dict[int, list[float]]) -> list[dict[str, Any]]:
    base = max(rates[1])
    out = []
    for c in plan:
        best = max(rates[c])
        speedup = best / base
        eff = speedup / c
        out.append(
            {
                "concurrency": c,
                "branches": plan[c],
                "branches_per_s": best,
                "branches_per_s_median": statistics.median(rates[c]),
                "runs": rates[c],
                "speedup": speedup,
                "efficiency": eff,
                "target_efficiency": TARGET_EFFICIENCY,
                "pass": c == 1 or eff >= TARGET_EFFICIENCY,
            }
        )
    return out


# ------------------------------------------------------------------ 1. sim


def _control_job(path: str, parent: ParentInfo, iv: DoResample, seeds: list[int]) -> int:
    """One worker of the control: its share of the branches, into its own journal copy."""
    with Journal(path) as j:
        for seed in seeds:
            r = run_branch(j, parent, iv, seed)
            if r.status != "completed":
                raise RuntimeError(f"control branch {r.status}: {r.error}")
    return len(seeds)


def _control_rate(
    work: Path, base: Path, parent: ParentInfo, iv: DoResample, n: int, c: int, seed: int
) -> float:
    """branches/s of the same branches run by c processes, each writing to its own copy of
    the journal: what the machine allows once writes to one SQLite file are out of the way."""
    copies = [work / f"control-{i}.db" for i in range(c)]
    for cp in copies:
        shutil.copyfile(base, cp)
    seeds = [branch_seed_for(seed, i) for i in range(n)]
    t0 = time.perf_counter()
    with cf.ProcessPoolExecutor(max_workers=c) as pool:
        done = sum(
            pool.map(
                _control_job,
                [str(cp) for cp in copies],
                [parent] * c,
                [iv] * c,
                [seeds[i::c] for i in range(c)],
            )
        )
    dt = time.perf_counter() - t0
    for cp in copies:
        remove_db(cp)
    return done / dt


def section_sim(work: Path, n: int, reps: int, quiet: bool) -> dict[str, Any]:
    cpus = os.cpu_count() or 1
    path = work / "sim.db"
    base = work / "sim-base.db"
    with Journal(path) as j:
        rec = record_heist(j, make_policy({"name": "sim"}), seed=1)
        iv = DoResample(2)
        steps_per_branch = rec.steps - iv.k
        j.checkpoint()
        shutil.copyfile(path, base)
        parent = parent_info(j, rec.run_id)
        _timed_fork_many(j, rec.run_id, iv, 4, 1, 1)  # warm-up: imports, world cache
        plan = {1: n} if cpus == 1 else {1: n, cpus: n}
        rates = _rates(j, rec.run_id, iv, plan, reps, "sim", quiet)
        scaling = _scaling(plan, rates)

        # the fixed cost of a parallel call: one branch per worker, against one branch alone
        one = statistics.median(
            _timed_fork_many(j, rec.run_id, iv, 1, 7000 + i, 1)[0] for i in range(5)
        )
        fixed = (
            statistics.median(
                _timed_fork_many(j, rec.run_id, iv, cpus, 8000 + i, cpus)[0] for i in range(3)
            )
            if cpus > 1
            else one
        )
    control: dict[int, list[float]] = {c: [] for c in plan}
    for i in range(reps):
        for c in plan if i % 2 == 0 else reversed(plan):
            control[c].append(_control_rate(work, base, parent, iv, n, c, 5000 + i))
            say(quiet, f"  sim control rep {i + 1} c={c}: {control[c][-1]:.1f} runs/s")
    opens = []
    for _ in range(5):
        t0 = time.perf_counter()
        Journal(path).close()
        opens.append(time.perf_counter() - t0)
    return {
        "steps_per_branch": steps_per_branch,
        "k": iv.k,
        "cpus": cpus,
        "reps": reps,
        "statistic": "best",
        "points": scaling,
        "control": [
            {
                "concurrency": c,
                "branches": n,
                "branches_per_s": max(control[c]),
                "runs": control[c],
                "speedup": max(control[c]) / max(control[1]),
            }
            for c in plan
        ],
        "one_branch_ms": ms(one),
        "one_branch_per_worker_ms": ms(fixed),
        "journal_open_ms": ms(statistics.median(opens)),
        "pass": all(p["pass"] for p in scaling),
    }


# ------------------------------------------------------------------ 2. openai


_PLAN = {
    "guard_gap": ("02:10-02:40", "02:15-02:45", "01:50-02:20"),
    "camera_window": ("02:12-02:30", "02:20-02:35"),
    "crack_minutes": ("12", "14", "18"),
    "entry_time": ("02:14", "02:20"),
    "exit_time": ("02:32", "02:38"),
    "route": ("north", "river", "tunnel"),
}
_TOOLS = (
    "[TOOL:calculator:{a}+{b}]",
    "[TOOL:file_reader:README.txt]",
    "[TOOL:database_query:SELECT name FROM sqlite_master]",
)


def reply_text(seed: Any) -> str:
    """A short crew message with one [PLAN:...] tag and sometimes a tool call; seed -> text."""
    rng = random.Random(f"bench-llm:{seed}")
    key = rng.choice(sorted(_PLAN))
    text = f"I checked my notes. [PLAN:{key}={rng.choice(_PLAN[key])}]"
    if rng.random() < 0.5:
        text += " " + rng.choice(_TOOLS).format(a=rng.randint(1, 99), b=rng.randint(1, 99))
    return text


class _LatencyServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # the listen backlog: bursts of 32+ connections must not be refused

    def __init__(self, latency: float) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.latency = latency
        self.lock = threading.Lock()
        self.inflight = 0
        self.peak = 0
        self.requests = 0


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the openai client expects
    server: _LatencyServer

    def setup(self) -> None:
        super().setup()
        # answer in one segment: Nagle plus the client's delayed ACK would add ~40 ms per reply
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        srv = self.server
        with srv.lock:
            stats = {"requests": srv.requests, "peak_inflight": srv.peak}
            if self.path.endswith("/reset"):
                srv.peak = srv.inflight
        self._send(200, stats)

    def do_POST(self) -> None:
        srv = self.server
        size = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(size) or b"{}")
        except json.JSONDecodeError:
            self._send(400, {"error": {"message": "bad JSON"}})
            return
        if not self.path.rstrip("/").endswith("/chat/completions"):
            self._send(404, {"error": {"message": f"no route {self.path}"}})
            return
        with srv.lock:
            srv.inflight += 1
            srv.requests += 1
            srv.peak = max(srv.peak, srv.inflight)
        try:
            time.sleep(srv.latency)
        finally:
            with srv.lock:
                srv.inflight -= 1
        text = reply_text(body.get("seed"))
        prompt = sum(len(str(m.get("content", ""))) for m in body.get("messages", ()))
        self._send(
            200,
            {
                "id": f"chatcmpl-{body.get('seed')}",
                "object": "chat.completion",
                "created": 0,
                "model": str(body.get("model") or "bench"),
                "system_fingerprint": "fp_bench",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {
                    "prompt_tokens": prompt // 4,
                    "completion_tokens": len(text) // 4,
                    "total_tokens": prompt // 4 + len(text) // 4,
                },
            },
        )


def serve(latency: float) -> None:
    """Run the fake LLM server in this process; prints its port, serves until killed."""
    srv = _LatencyServer(latency)
    print(srv.server_address[1], flush=True)
    srv.serve_forever()


@contextmanager
def latency_server(latency: float) -> Iterator[str]:
    """The fake LLM server in a child process (its own GIL); yields its base URL."""
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--serve", "--latency", str(latency)],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if not line.isdigit():
            raise SystemExit(f"the fake LLM server did not start (said {line!r})")
        yield f"http://127.0.0.1:{line}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _server_stats(base_url: str, reset: bool = False) -> dict[str, Any]:
    url = base_url.removesuffix("/v1") + ("/stats/reset" if reset else "/stats")
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


def section_openai(
    work: Path, latency: float, rounds: int, per_branch: int, waves: int, reps: int, quiet: bool
) -> dict[str, Any]:
    with latency_server(latency) as base_url, Journal(work / "openai.db") as j:
        policy = make_policy({"name": "openai", "base_url": base_url, "model": "bench"})
        t0 = time.perf_counter()
        rec = record_heist(j, policy, seed=3, rounds=rounds)
        record_s = time.perf_counter() - t0
        if rec.status != "completed":
            raise SystemExit(f"recording with the openai policy {rec.status}: {rec.error}")
        iv = DoResample(max(0, rec.steps - per_branch))
        plan = {c: waves * max(c, 3) for c in OPENAI_CONCURRENCY}
        peaks: dict[int, int] = {c: 0 for c in plan}

        def before() -> None:
            _server_stats(base_url, reset=True)

        def after(c: int) -> None:
            peaks[c] = max(peaks[c], int(_server_stats(base_url)["peak_inflight"]))

        rates = _rates(j, rec.run_id, iv, plan, reps, "openai", quiet, before, after)
        requests = int(_server_stats(base_url)["requests"])
    scaling = _scaling(plan, rates)
    for p in scaling:
        p["peak_inflight"] = peaks[p["concurrency"]]
    per_call = (rec.steps - iv.k) * latency
    return {
        "latency_s": latency,
        "rounds": rounds,
        "recorded_steps": rec.steps,
        "record_s": record_s,
        "k": iv.k,
        "completions_per_branch": rec.steps - iv.k,
        "ideal_branch_s": per_call,
        "reps": reps,
        "statistic": "best",
        "server_requests": requests,
        "points": scaling,
        "pass": all(p["pass"] for p in scaling),
    }


# ------------------------------------------------------------------ 3. open


def _open_branch(j: Journal, run: str, fork_seq: int) -> str:
    """What the brief calls opening a branch: the fork and s_k at the fork point."""
    state_at_seq(j, run, fork_seq)
    return j.fork(run, fork_seq)


def _branch_setup(j: Journal, run: str, k: int, seed: int) -> str:
    """Everything `run_branch` does before its first step (for do_resample)."""
    fork_seq = step_seq(j, run, k)
    s_k = state_at_seq(j, run, fork_seq)
    HeistScenario.from_state(s_k)
    make_policy(dict(s_k.policy))
    conversation(j, run, fork_seq)
    child = j.fork(run, fork_seq, label=f"do_resample@{k}")
    opening = ev.Intervention(step=k, op=op_name(DoResample(k)), at=k, branch_seed=seed)
    Recorder(j, child, s_k, fork_seq).append([opening])
    return child


def section_open(work: Path, rounds: int, reps: int, quiet: bool) -> dict[str, Any]:
    with Journal(work / "long.db") as j:
        say(quiet, f"  recording a {rounds}-round sim heist ...")
        t0 = time.perf_counter()
        rec = record_heist(j, make_policy({"name": "sim"}), seed=5, rounds=rounds)
        record_s = time.perf_counter() - t0
        run = rec.run_id
        head = j.head(run)
        steps = rec.steps
        ks = {"early": 2, "late": steps - 2}
        seqs = {name: step_seq(j, run, k) for name, k in ks.items()}
        names = list(ks)
        measures: dict[str, Callable[[str], Any]] = {
            "fork": lambda name: j.fork(run, seqs[name]),
            "open": lambda name: _open_branch(j, run, seqs[name]),
            "setup": lambda name: _branch_setup(j, run, ks[name], 1),
        }
        times: dict[str, dict[str, list[float]]] = {m: {n: [] for n in names} for m in measures}
        for m, fn in measures.items():
            for name in names:  # warm-up
                fn(name)
            for i in range(reps):
                for name in names if i % 2 == 0 else reversed(names):
                    t0 = time.perf_counter()
                    fn(name)
                    times[m][name].append(time.perf_counter() - t0)
        parent_ms = ms(median_time(lambda: parent_info(j, run), 7))

    def summary(m: str) -> dict[str, Any]:
        at_ms = {n: ms(statistics.median(times[m][n])) for n in names}
        return {
            "points": [
                {
                    "at": n,
                    "k": ks[n],
                    "seq": seqs[n],
                    "folded_past_snapshot": seqs[n] % SNAPSHOT_EVERY,
                    "ms": at_ms[n],
                }
                for n in names
            ],
            "spread": max(at_ms.values()) / min(at_ms.values()),
        }

    fork, opened, setup = summary("fork"), summary("open"), summary("setup")
    fork["target_spread"] = TARGET_FORK_SPREAD
    fork["pass"] = fork["spread"] <= TARGET_FORK_SPREAD
    opened["target_ms"] = TARGET_OPEN_MS
    opened["pass"] = all(p["ms"] <= TARGET_OPEN_MS for p in opened["points"])
    return {
        "rounds": rounds,
        "steps": steps,
        "events": head,
        "record_s": record_s,
        "reps": reps,
        "statistic": "median",
        "fork": fork,
        "open": opened,
        "setup": setup,
        "parent_info_ms": parent_ms,
        "pass": fork["pass"] and opened["pass"],
    }


# ------------------------------------------------------------------ report


def _speedup_rows(part: str, points: Sequence[dict[str, Any]]) -> list[Row]:
    """One row per concurrency above 1: its speed-up over c=1 and its efficiency."""
    return [
        (
            f"{part}: speed-up c={p['concurrency']} / c=1, efficiency",
            f"{p['speedup']:.2f}x, {p['efficiency']:.2f}",
            f">= {p['target_efficiency']} x c",
            verdict(p["pass"]),
        )
        for p in points[1:]
    ]


def print_table(res: dict[str, Any]) -> None:
    rows: list[Row] = []
    s = res.get("sim")
    if s is not None:
        for p in s["points"]:
            rows.append(
                (
                    f"sim: fork_many c={p['concurrency']}, {p['branches']} branches x"
                    f" {s['steps_per_branch']} steps (best of {s['reps']})",
                    f"{p['branches_per_s']:,.1f} runs/s",
                    f"(median {p['branches_per_s_median']:,.1f})",
                    "",
                )
            )
        rows.extend(_speedup_rows("sim", s["points"]))
        for p in s["control"]:
            rows.append(
                (
                    f"sim: control, c={p['concurrency']} processes with a journal copy each",
                    f"{p['branches_per_s']:,.1f} runs/s",
                    f"(speed-up {p['speedup']:.2f}x)",
                    "",
                )
            )
        rows.append(("sim: one branch, c=1", f"{s['one_branch_ms']:,.0f} ms", "", ""))
        rows.append(
            (
                f"sim: {s['cpus']} branches, c={s['cpus']} (one per worker)",
                f"{s['one_branch_per_worker_ms']:,.0f} ms",
                "",
                "",
            )
        )
        rows.append(
            ("sim: open a Journal (schema check)", f"{s['journal_open_ms']:,.0f} ms", "", "")
        )
    o = res.get("openai")
    if o is not None:
        rows.append(
            (
                f"openai: L = {o['latency_s']:g} s per completion; {o['completions_per_branch']}"
                f" per branch (k={o['k']} of {o['recorded_steps']})",
                f"{o['ideal_branch_s']:.2f} s",
                "(ideal branch)",
                "",
            )
        )
        for p in o["points"]:
            rows.append(
                (
                    f"openai: fork_many c={p['concurrency']}, {p['branches']} branches"
                    f" (best of {o['reps']}), peak in flight {p['peak_inflight']}",
                    f"{p['branches_per_s']:,.2f} br/s",
                    f"(median {p['branches_per_s_median']:,.2f})",
                    "",
                )
            )
        rows.extend(_speedup_rows("openai", o["points"]))
    f = res.get("open")
    if f is not None:
        head = f"{f['steps']:,}-step run, {f['events']:,} events"
        for p in f["fork"]["points"]:
            rows.append(
                (
                    f"open: Journal.fork at {p['at']} k={p['k']:,} ({head})",
                    f"{p['ms']:.3f} ms",
                    "",
                    "",
                )
            )
        rows.append(
            (
                "open: Journal.fork spread",
                f"{f['fork']['spread']:.2f}x",
                f"<= {f['fork']['target_spread']}x",
                verdict(f["fork"]["pass"]),
            )
        )
        for p in f["open"]["points"]:
            rows.append(
                (
                    f"open: fork + state_at_seq at {p['at']} k={p['k']:,}"
                    f" (fold {p['folded_past_snapshot']} past snapshot)",
                    f"{p['ms']:.3f} ms",
                    f"<= {f['open']['target_ms']:g} ms",
                    verdict(p["ms"] <= f["open"]["target_ms"]),
                )
            )
        rows.append(("open: fork + state_at_seq spread", f"{f['open']['spread']:.2f}x", "", ""))
        for p in f["setup"]["points"]:
            rows.append(
                (
                    f"open: run_branch set-up at {p['at']} k={p['k']:,} (+ prefix, Intervention)",
                    f"{p['ms']:.3f} ms",
                    "",
                    "",
                )
            )
        rows.append(("open: run_branch set-up spread", f"{f['setup']['spread']:.2f}x", "", ""))
        rows.append(
            ("open: parent_info (once per fork_many)", f"{f['parent_info_ms']:.1f} ms", "", "")
        )
    print_rows(rows)
    print_footer(
        res["env"], "throughput: best of repetitions (median beside it), latencies: medians"
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sim-branches", type=int, default=120, help="branches per sim fork_many")
    p.add_argument("--latency", type=float, default=0.25, help="seconds per fake completion (L)")
    p.add_argument("--openai-rounds", type=int, default=2, help="rounds of the openai heist")
    p.add_argument(
        "--completions", type=int, default=3, help="completions per openai branch (steps)"
    )
    p.add_argument("--waves", type=int, default=2, help="openai branches per slot (n = waves x c)")
    p.add_argument("--long-rounds", type=int, default=250, help="rounds of the long sim heist")
    p.add_argument("--reps", type=int, default=3, help="repetitions of each sim concurrency")
    p.add_argument(
        "--openai-reps", type=int, default=2, help="repetitions of each openai concurrency"
    )
    p.add_argument("--open-reps", type=int, default=51, help="repetitions of each open measure")
    p.add_argument(
        "--only", choices=("sim", "openai", "open"), action="append", help="run only these parts"
    )
    add_output_options(p)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve(args.latency)
        return 0
    quiet = args.json
    parts = args.only or ["sim", "openai", "open"]

    load0 = loadavg()
    t_start = time.perf_counter()
    res: dict[str, Any] = {}
    with work_dir("car-bench-fork-", args.dir) as work:
        if "sim" in parts:
            say(quiet, f"sim: {args.sim_branches} branches x {args.reps} reps per concurrency")
            res["sim"] = section_sim(work, args.sim_branches, args.reps, quiet)
        if "openai" in parts:
            say(quiet, f"openai: fake server with L = {args.latency:g} s")
            res["openai"] = section_openai(
                work,
                args.latency,
                args.openai_rounds,
                args.completions,
                args.waves,
                args.openai_reps,
                quiet,
            )
        if "open" in parts:
            say(quiet, "open: fork and branch opening cost")
            res["open"] = section_open(work, args.long_rounds, args.open_reps, quiet)
    res["env"] = environment(
        loadavg_start=load0, loadavg_end=loadavg(), wall_s=time.perf_counter() - t_start
    )
    emit(res, args.json, print_table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
