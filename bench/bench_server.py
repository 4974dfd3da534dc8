#!/usr/bin/env python
"""Server benchmark: the live event stream to 1, 10 and 50 SSE clients, and analyze latency.

    .venv/bin/python bench/bench_server.py               # table
    .venv/bin/python bench/bench_server.py --clients 1,10 --json

Workload: the detection server (`create_app`, uvicorn) runs in this process on a fresh SQLite
journal; the SSE clients run in a separate process (httpx, asyncio), so parsing on the client
side does not share the server's interpreter. For each client count the clients connect to a
heist that is paused right after it started (default crew, `sim` policy), the heist resumes
once every client has its first event, and then records to the end:

1. paced   one step every --step-delay seconds (the dashboard's live case)
2. full    no delay between steps: the heist appends as fast as the runtime can

Measured per run: the heist's append rate (public events/s that reached the journal: the floor
a stream cannot beat), events/s delivered to each client, whether every client saw every
public event exactly once in seq order, and the delay from the append's commit (timed in the
server process) to the client's receipt (timed in the client process; both use the same
wall clock of this machine). Target: every client sees every event, p99 delay <= 100 ms at
10 clients (paced).

3. analyze  POST /api/ai-detect/analyze (method rules) on the finished heist over HTTP (from
            another process), beside `engine.detect.analyze` called directly on the same
            journal (the floor): medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from common import (
    Row,
    add_output_options,
    emit,
    environment,
    loadavg,
    print_footer,
    print_rows,
    say,
    verdict,
    work_dir,
)

P99_TARGET_MS = 100.0


# ------------------------------------------------------------------ the clients' process


def _client_process(url: str, sid: str, n: int, ready: Any, out: Any) -> None:
    import httpx

    async def one(c: httpx.AsyncClient, first: asyncio.Event, got: list[int]) -> list[Any]:
        recs: list[tuple[int, float]] = []
        async with c.stream("GET", f"{url}/api/sessions/{sid}/events") as r:
            event = "message"
            async for line in r.aiter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:"):
                    if event == "end":
                        break
                    seq = json.loads(line[5:])["seq"]
                    recs.append((seq, time.time()))
                    if not first.is_set():
                        first.set()
                        got[0] += 1
                        if got[0] == n:
                            ready.put("ready")
                elif line == "":
                    event = "message"
        return recs

    async def main() -> list[list[Any]]:
        limits = httpx.Limits(max_connections=n + 5, max_keepalive_connections=n + 5)
        async with httpx.AsyncClient(timeout=None, limits=limits) as c:
            got = [0]
            return await asyncio.gather(*(one(c, asyncio.Event(), got) for _ in range(n)))

    out.put(asyncio.run(main()))


def _analyze_process(url: str, sid: str, reps: int, out: Any) -> None:
    import httpx

    times = []
    with httpx.Client(base_url=url, timeout=120) as c:
        c.post("/api/ai-detect/analyze", json={"session_id": sid})  # connection and warm-up
        for _ in range(reps):
            t0 = time.perf_counter()
            r = c.post("/api/ai-detect/analyze", json={"session_id": sid})
            times.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
    out.put(times)


# ------------------------------------------------------------------ the server in this process


class InProcessServer:
    def __init__(self, journal: Path) -> None:
        import uvicorn

        from engine.server import ServerSettings, create_app

        self.app = create_app(ServerSettings(journal=str(journal), max_heists=2))
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]})
        self.appends: dict[str, list[tuple[int, float]]] = {}  # run -> (new head, commit time)
        journal_obj = self.app.state.journal
        original = journal_obj.append

        def timed(*args: Any, **kwargs: Any) -> int:
            head = original(*args, **kwargs)
            self.appends.setdefault(str(args[0]), []).append((head, time.time()))
            return int(head)

        journal_obj.append = timed

    def __enter__(self) -> InProcessServer:
        import httpx

        self.thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/api/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError("the server did not start")

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def append_time(self, run_id: str, seq: int) -> float:
        """Commit time of the append that wrote `seq` of `run_id`."""
        for head, t in self.appends[run_id]:
            if seq < head:
                return t
        raise KeyError(seq)


def stream_run(srv: InProcessServer, n: int, rounds: int, delay: float) -> dict[str, Any]:
    import httpx

    c = httpx.Client(base_url=srv.url, timeout=120)
    sid = c.post("/api/sessions", json={"rounds": rounds, "step_delay": 0.2}).json()["session_id"]
    c.post(f"/api/sessions/{sid}/pause")
    deadline = time.monotonic() + 30
    while c.get(f"/api/sessions/{sid}").json()["status"] != "paused":
        if time.monotonic() > deadline:
            raise RuntimeError("the heist did not pause")
        time.sleep(0.02)
    ctx = mp.get_context("spawn")
    ready, out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_client_process, args=(srv.url, sid, n, ready, out))
    proc.start()
    ready.get(timeout=120)
    # the rest of the heist at the measured pace
    live = srv.app.state.runner.get(sid)
    live.step_delay = delay
    t_resume = time.time()
    c.post(f"/api/sessions/{sid}/resume")
    results: list[list[tuple[int, float]]] = out.get(timeout=600)
    proc.join(60)
    full = [e["seq"] for e in _history(c, sid)]
    c.close()
    seqs_live = [s for s in full if srv.append_time(sid, s) > t_resume]
    every = all([s for s, _ in r] == full for r in results)
    delays = [
        (t - srv.append_time(sid, s)) * 1000.0
        for r in results
        for s, t in r
        if srv.append_time(sid, s) > t_resume
    ]
    first_t = min(srv.append_time(sid, s) for s in seqs_live)
    last_t = max(srv.append_time(sid, s) for s in seqs_live)
    span = max(last_t - first_t, 1e-9)
    per_client = []
    for r in results:
        times = [t for s, t in r if srv.append_time(sid, s) > t_resume]
        # over the same start as the append rate: from the first live append to the receipt
        # of the client's last event
        per_client.append(len(times) / max(times[-1] - first_t, 1e-9) if times else 0.0)
    delays.sort()
    return {
        "clients": n,
        "step_delay_s": delay,
        "events": len(full),
        "live_events": len(seqs_live),
        "append_events_per_s": round(len(seqs_live) / span, 1),
        "delivered_events_per_s_per_client": round(statistics.median(per_client), 1),
        "delivered_events_per_s_total": round(sum(per_client), 1),
        "every_client_saw_every_event": every,
        "delay_ms_p50": round(delays[len(delays) // 2], 2),
        "delay_ms_p99": round(delays[min(len(delays) - 1, int(len(delays) * 0.99))], 2),
        "delay_ms_max": round(delays[-1], 2),
    }


def _history(c: Any, sid: str) -> list[dict[str, Any]]:
    out = []
    for line in c.get(f"/api/sessions/{sid}/events").text.splitlines():
        if line.startswith("data:") and '"seq"' in line:
            out.append(json.loads(line[5:]))
    return out


def analyze_latency(srv: InProcessServer, journal: Path, reps: int) -> dict[str, Any]:
    import httpx

    from engine.detect import analyze
    from engine.journal import Journal

    c = httpx.Client(base_url=srv.url, timeout=120)
    sid = c.post("/api/sessions", json={"seed": 7, "step_delay": 0}).json()["session_id"]
    while c.get(f"/api/sessions/{sid}").json()["status"] != "completed":
        time.sleep(0.02)
    # the HTTP client in its own process, like the stream's: sharing this interpreter's GIL
    # with the server would add thread hand-offs that a real client never pays
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_analyze_process, args=(srv.url, sid, reps, out))
    proc.start()
    http_t = out.get(timeout=600)
    proc.join(60)
    direct_t = []
    with Journal(journal) as j:
        analyze(j, sid)
        for _ in range(reps):
            t0 = time.perf_counter()
            analyze(j, sid)
            direct_t.append(time.perf_counter() - t0)
    c.close()
    h, d = statistics.median(http_t) * 1000, statistics.median(direct_t) * 1000
    return {"http_ms": round(h, 2), "direct_ms": round(d, 2), "ratio": round(h / d, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--clients", default="1,10,50", help="client counts (comma separated)")
    p.add_argument("--rounds", type=int, default=10, help="rounds per heist (6 steps each)")
    p.add_argument("--step-delay", type=float, default=0.05, help="paced: seconds per step")
    p.add_argument("--reps", type=int, default=20, help="analyze: repetitions")
    add_output_options(p)
    args = p.parse_args()
    counts = [int(x) for x in args.clients.split(",") if x]
    env = environment(loadavg_start=loadavg())
    t0 = time.time()
    runs = []
    with work_dir("car-bench-server-", args.dir) as d:
        journal = d / "journal.db"
        with InProcessServer(journal) as srv:
            for mode, delay in (("paced", args.step_delay), ("full", 0.0)):
                for n in counts:
                    say(args.json, f"{mode}: {n} clients")
                    r = stream_run(srv, n, args.rounds, delay)
                    r["mode"] = mode
                    runs.append(r)
            say(args.json, "analyze latency")
            an = analyze_latency(srv, journal, args.reps)
    env["loadavg_end"] = loadavg()
    env["wall_s"] = time.time() - t0
    res = {"streams": runs, "analyze": an, "environment": env}
    emit(res, args.json, table)


def table(res: dict[str, Any]) -> None:
    rows: list[Row] = []
    for r in res["streams"]:
        tag = f"{r['mode']} {r['clients']:>2} clients"
        ratio = r["delivered_events_per_s_per_client"] / max(r["append_events_per_s"], 1e-9)
        rows.append(
            (
                f"{tag}: events/s per client (vs append rate)",
                f"{r['delivered_events_per_s_per_client']:.0f} / {r['append_events_per_s']:.0f}"
                f" = {ratio:.2f}x",
                "",
                "",
            )
        )
        rows.append((f"{tag}: every client saw every event", str(r["every_client_saw_every_event"]),
                     "True", verdict(r["every_client_saw_every_event"])))  # fmt: skip
        target = r["mode"] == "paced" and r["clients"] == 10
        rows.append(
            (
                f"{tag}: delay p50 / p99 / max (ms)",
                f"{r['delay_ms_p50']:.1f} / {r['delay_ms_p99']:.1f} / {r['delay_ms_max']:.1f}",
                f"p99 <= {P99_TARGET_MS:.0f}" if target else "",
                verdict(r["delay_ms_p99"] <= P99_TARGET_MS) if target else "",
            )
        )
    a = res["analyze"]
    rows.append(
        (
            "analyze (rules) over HTTP vs direct call (ms)",
            f"{a['http_ms']:.1f} / {a['direct_ms']:.1f} = {a['ratio']:.2f}x",
            "",
            "",
        )
    )
    print_rows(rows)
    print_footer(res["environment"], "delays: append commit (server) to receipt (client process)")


if __name__ == "__main__":
    main()
