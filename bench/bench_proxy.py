#!/usr/bin/env python
"""Recording-proxy benchmark: what `car record` adds to each call, and what `car fork -- CMD`
saves against re-running a program live.

    .venv/bin/python bench/bench_proxy.py              # all three parts
    .venv/bin/python bench/bench_proxy.py --no-llama   # only the canned server (part 1)
    .venv/bin/python bench/bench_proxy.py --json

1. overhead (canned)  ms per chat completion sent over one keep-alive connection (stdlib
                      http.client) straight to a canned OpenAI-compatible HTTP server
                      (tests/program_helpers.py, replies at once) against the same requests
                      through the recording proxy, which journals each one into a SQLite
                      journal (one transaction per call). Rounds alternate direct and proxied;
                      medians of every call. The difference is the proxy's overhead per call
                      (target: <= 2 ms).
2. overhead (llama)   the same against the real llama.cpp server with SmolLM2-135M
                      (max_tokens 16, a fixed seed): the overhead as a share of a real call
                      (target: <= 5%).
3. fork               seconds for `car fork RUN --at K --do resample -n 1 -- CMD` of a program
                      making 8 sequential SmolLM2 calls, at K=1 (early) and K=7 (late), against
                      a full live re-run of the same program (`car record -- CMD`). Medians of
                      3 each, interleaved.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from program_helpers import CannedServer  # noqa: E402
from servers import llama_server  # noqa: E402

from engine import events as ev  # noqa: E402
from engine.journal import Journal  # noqa: E402
from engine.program.proxy import Proxy, Session, Upstream  # noqa: E402
from engine.runtime.recorder import Recorder  # noqa: E402
from engine.state import State  # noqa: E402

BODY = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "You are a careful planner of small errands."},
        {"role": "user", "content": "Say one short sentence about the weather today, please."},
    ],
    "max_tokens": 16,
    "temperature": 0.8,
    "seed": 7,
}


def _conn(base_url: str) -> tuple[http.client.HTTPConnection, str]:
    u = urllib.parse.urlsplit(base_url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    return c, u.path.rstrip("/") + "/chat/completions"


def _call(c: http.client.HTTPConnection, path: str, payload: bytes) -> float:
    t0 = time.perf_counter()
    c.request("POST", path, payload, {"Content-Type": "application/json"})
    r = c.getresponse()
    r.read()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}")
    return (time.perf_counter() - t0) * 1000.0


def overhead(upstream: str, rounds: int, per_round: int, tmp: Path) -> dict[str, float]:
    """Median ms per call direct and through the recording proxy (journaling to SQLite)."""
    journal = Journal(tmp / f"bench-{time.monotonic_ns()}.db")
    run_id = journal.create_run("program")
    rec = Recorder(journal, run_id, State(), 0)
    rec.append(
        [
            ev.RunStarted(
                scenario="program",
                config={},
                agents=[],
                policy={"name": "program"},
                root_seed=0,
                engine_version="bench",
                started_at="2026-12-01T00:00:00+00:00",
            )
        ]
    )
    session = Session(recorder=rec, upstream=Upstream(upstream))
    direct: list[float] = []
    proxied: list[float] = []
    payload = json.dumps(BODY).encode()
    with Proxy(session) as proxy:
        dc, dpath = _conn(upstream)
        pc, ppath = _conn(proxy.base_url)
        for _ in range(2):  # warm both connections (and the server's prompt cache)
            _call(dc, dpath, payload)
            _call(pc, ppath, payload)
        for _ in range(rounds):
            direct += [_call(dc, dpath, payload) for _ in range(per_round)]
            proxied += [_call(pc, ppath, payload) for _ in range(per_round)]
        dc.close()
        pc.close()
    rec.append([ev.RunEnded(status="completed")])
    rec.flush()
    journal.close()
    d, p = statistics.median(direct), statistics.median(proxied)
    return {
        "calls": len(direct),
        "direct_ms": round(d, 3),
        "proxied_ms": round(p, 3),
        "overhead_ms": round(p - d, 3),
        "overhead_pct": round(100.0 * (p - d) / d, 2),
        "ratio": round(p / d, 3),
    }


PROGRAM = """
from openai import OpenAI
c = OpenAI(max_retries=0)
history = [{"role": "system", "content": "You are a terse assistant."}]
for i in range(8):
    history.append({"role": "user", "content": f"Give me word number {i}."})
    r = c.chat.completions.create(model="m", messages=history, max_tokens=12, temperature=0.8)
    history.append({"role": "assistant", "content": r.choices[0].message.content or ""})
"""


def _car(journal: Path, *args: str) -> tuple[float, subprocess.CompletedProcess[str]]:
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_BASE_URL"}
    env["PYTHONPATH"] = str(ROOT)
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "cli", "--journal", str(journal), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=900,
    )
    if r.returncode != 0:
        raise RuntimeError(f"car {' '.join(args[:3])} failed: {r.stderr.strip()}")
    return time.perf_counter() - t0, r


def forks(llama: str, tmp: Path, reps: int) -> dict[str, float]:
    prog = tmp / "eight_calls.py"
    prog.write_text(PROGRAM)
    journal = tmp / "fork.db"
    cmd = ["--", sys.executable, str(prog)]
    _, r = _car(journal, "record", "--base-url", llama, "--json", *cmd)
    run_id = json.loads(r.stdout)["run_id"]
    live: list[float] = []
    early: list[float] = []
    late: list[float] = []
    for i in range(reps):
        live.append(_car(journal, "record", "--base-url", llama, *cmd)[0])
        early.append(
            _car(
                journal,
                "fork",
                run_id,
                "--at",
                "1",
                "--do",
                "resample",
                "-n",
                "1",
                "--seed",
                str(i),
                *cmd,
            )[0]
        )
        late.append(
            _car(
                journal,
                "fork",
                run_id,
                "--at",
                "7",
                "--do",
                "resample",
                "-n",
                "1",
                "--seed",
                str(i),
                *cmd,
            )[0]
        )
    lv, e, la = statistics.median(live), statistics.median(early), statistics.median(late)
    return {
        "live_rerun_s": round(lv, 3),
        "fork_k1_s": round(e, 3),
        "fork_k7_s": round(la, 3),
        "fork_k1_vs_live": round(e / lv, 3),
        "fork_k7_vs_live": round(la / lv, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--per-round", type=int, default=50)
    ap.add_argument("--llama-calls", type=int, default=12)
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    out: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="car-bench-proxy-") as d:
        tmp = Path(d)
        with CannedServer() as canned:
            out["canned"] = overhead(canned.base_url, a.rounds, a.per_round, tmp)
        if not a.no_llama:
            with llama_server() as llama:
                per = max(1, a.llama_calls // 3)
                out["llama"] = overhead(llama, 3, per, tmp)
                out["fork"] = forks(llama, tmp, 3)
    if a.json:
        print(json.dumps(out, indent=2))
        return
    c = out["canned"]
    assert isinstance(c, dict)
    print(f"proxy overhead, canned server ({c['calls']} calls each, medians):")
    print(
        f"  direct {c['direct_ms']:.3f} ms   via proxy {c['proxied_ms']:.3f} ms   "
        f"overhead {c['overhead_ms']:.3f} ms/call   ratio {c['ratio']:.2f}x"
    )
    if "llama" in out:
        lm = out["llama"]
        assert isinstance(lm, dict)
        print(f"proxy overhead, SmolLM2-135M via llama.cpp ({lm['calls']} calls each, medians):")
        print(
            f"  direct {lm['direct_ms']:.1f} ms   via proxy {lm['proxied_ms']:.1f} ms   "
            f"overhead {lm['overhead_ms']:.2f} ms/call = {lm['overhead_pct']:.2f}% of a call"
        )
        f = out["fork"]
        assert isinstance(f, dict)
        print("car fork -- CMD of an 8-call SmolLM2 program (medians of 3, wall clock):")
        print(f"  full live re-run (car record)  {f['live_rerun_s']:.2f} s")
        print(
            f"  fork at K=1 (early)            {f['fork_k1_s']:.2f} s   "
            f"= {f['fork_k1_vs_live']:.2f}x the live re-run"
        )
        print(
            f"  fork at K=7 (late)             {f['fork_k7_s']:.2f} s   "
            f"= {f['fork_k7_vs_live']:.2f}x the live re-run"
        )


if __name__ == "__main__":
    main()
