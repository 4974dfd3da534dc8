#!/usr/bin/env python
"""Journal benchmark: append throughput, s_k reconstruction, bytes on disk, fork cost.

    .venv/bin/python bench/bench_journal.py                 # table, 100,000-event run
    .venv/bin/python bench/bench_journal.py --events 20000  # smaller run
    .venv/bin/python bench/bench_journal.py --json          # the numbers as JSON on stdout

Workload: a run of steps of 3 events (LlmCall, ToolResult, ChatMessage), each carrying a ~1 KB
JSON string, after one RunStarted. Everything is written to SQLite files in a temporary
directory that is removed at the end.

1. append  events/s through `Journal.append` (one call, one transaction per step, hash chain
           included) into a fresh file, against two floors of plain `sqlite3` (WAL,
           synchronous=NORMAL, one transaction per step, pre-encoded payloads): the issue's
           floor, the same payloads into an integer-keyed table `(id INTEGER PRIMARY KEY,
           payload BLOB)` (target: journal >= 0.6x it), and the journal's own rows in its own
           layout (precomputed hashes, no triggers), which shows what the schema costs.
           Repeated, alternating; the best run of each is kept.
2. s_k     ms for `state_at_seq` at seq 10, N/2 and N-10 of an N-event run once its snapshots
           are built (`build_snapshots`, timed separately), beside the plain fold from event 0.
           Medians of several repetitions.
3. size    bytes on disk per event after a WAL checkpoint, minus an empty journal, against the
           average encoded payload; measured before and after the snapshots are written.
4. fork    ms for `Journal.fork` at seq 10 and seq N-10 (medians of many, interleaved).
"""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from common import (
    DB_SUFFIXES,
    Row,
    add_output_options,
    emit,
    environment,
    median_time,
    ms,
    print_footer,
    print_rows,
    remove_db,
    say,
    settle,
    verdict,
    work_dir,
)

from engine import events as ev
from engine import state as st
from engine.journal import KIND_CODES, SPAN, Journal, chain_hash, chain_rows, hash_cell

AGENTS = ["alice", "bob", "carol", "dave"]
PAYLOAD_TARGET = 1024  # encoded bytes per step event, approximately
EVENTS_PER_STEP = 3

TARGET_APPEND_RATIO = 0.6
TARGET_STATE_MS = 5.0
TARGET_SIZE_RATIO = 1.5
TARGET_FORK_SPREAD = 2.0

_WORDS = ("vault", "guard", "camera", "badge", "keypad", "lobby", "alarm", "shift", "drill", "roof")


# ------------------------------------------------------------------ workload


class Blobs:
    """~1 KB JSON documents, each different, built from a pool of pre-rendered items."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.items = [
            json.dumps(
                {
                    "id": rng.randrange(1 << 30),
                    "word": rng.choice(_WORDS),
                    "note": " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 8))),
                    "score": round(rng.random(), 4),
                },
                separators=(",", ":"),
            )
            for _ in range(512)
        ]

    def make(self, size: int, tag: int) -> str:
        """A JSON object of exactly `size` characters (at least ~40)."""
        head = f'{{"n":{tag},"items":['
        parts: list[str] = []
        used = len(head) + len('],"pad":""}')
        while True:
            item = self.items[self.rng.randrange(len(self.items))]
            if used + len(item) + 1 > size:
                break
            parts.append(item)
            used += len(item) + 1
        pad = "x" * max(0, size - used + (1 if parts else 0))
        return head + ",".join(parts) + f'],"pad":"{pad}"}}'


def _fit(make: Callable[[str], ev.Event], blobs: Blobs, tag: int) -> ev.Event:
    """An event whose encoded payload is about PAYLOAD_TARGET bytes."""
    overhead = len(ev.encode(make(""))) + 2  # the msgpack str header grows past 255 bytes
    return make(blobs.make(max(48, PAYLOAD_TARGET - overhead), tag))


def run_started() -> ev.RunStarted:
    return ev.RunStarted(
        scenario="bench",
        config={"rounds": 0},
        agents=list(AGENTS),
        policy={"kind": "bench"},
        root_seed=7,
        engine_version="bench",
        started_at="2026-01-01T00:00:00+00:00",
    )


def step_events(step: int, rng: random.Random, blobs: Blobs) -> list[ev.Event]:
    agent = AGENTS[step % len(AGENTS)]
    return [
        _fit(
            lambda blob: ev.LlmCall(
                step=step,
                agent=agent,
                request=[{"role": "user", "content": f"turn {step}"}],
                seed=rng.randrange(1 << 31),
                model="bench-model",
                response=blob,
                finish_reason="stop",
                prompt_tokens=512,
                completion_tokens=256,
            ),
            blobs,
            3 * step,
        ),
        _fit(
            lambda blob: ev.ToolResult(
                step=step, agent=agent, tool="search", param=f"q{step}", ok=True, output=blob
            ),
            blobs,
            3 * step + 1,
        ),
        _fit(lambda blob: ev.ChatMessage(step=step, agent=agent, text=blob), blobs, 3 * step + 2),
    ]


def make_steps(n_steps: int, seed: int = 1) -> list[list[ev.Event]]:
    rng = random.Random(seed)
    blobs = Blobs(rng)
    return [step_events(i, rng, blobs) for i in range(n_steps)]


# ------------------------------------------------------------------ helpers


def _file_bytes(path: Path) -> int:
    return sum(
        Path(str(path) + suffix).stat().st_size
        for suffix in DB_SUFFIXES
        if Path(str(path) + suffix).exists()
    )


# ------------------------------------------------------------------ 1. append

# the journal's own layout (migrations/versions/0005_integer_rows.py), without its triggers
# (the BEFORE INSERT one is a primary-key probe per row)
FLOOR_DDL = [
    "CREATE TABLE runs (run_key INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT,"
    " run_id VARCHAR(64) NOT NULL, parent_run_id VARCHAR(64) REFERENCES runs (run_id),"
    " fork_seq INTEGER, root_run_id VARCHAR(64) NOT NULL, scenario VARCHAR(64) NOT NULL,"
    " created_at VARCHAR(40) NOT NULL, label VARCHAR(200) NOT NULL, UNIQUE (run_id))",
    "CREATE TABLE events (id INTEGER NOT NULL PRIMARY KEY,"
    " run_key INTEGER NOT NULL REFERENCES runs (run_key), seq INTEGER NOT NULL, step INTEGER,"
    " kind INTEGER NOT NULL, version INTEGER NOT NULL, payload BLOB NOT NULL,"
    " hash BLOB NOT NULL, CHECK (seq >= 0 AND seq < 4294967296"
    " AND id = run_key * 4294967296 + seq))",
]


def precompute_rows(
    run_id: str, steps: Sequence[Sequence[ev.Event]], first_seq: int, prev: str
) -> list[list[tuple[Any, ...]]]:
    """The exact rows the journal writes, per step (payload bytes and hash chain included)."""
    out: list[list[tuple[Any, ...]]] = []
    seq = first_seq
    for events in steps:
        rows = chain_rows(run_id, events, seq, prev)
        # as the journal stores them: run key 1, kind code, the digest's bytes
        out.append(
            [
                (SPAN + r[1], 1, r[1], r[2], KIND_CODES[r[3]], r[4], r[5], hash_cell(r[6]))
                for r in rows
            ]
        )
        seq += len(rows)
        prev = rows[-1][6]
    return out


def bench_journal_append(path: Path, steps: Sequence[Sequence[ev.Event]]) -> float:
    """events/s of Journal.append, one call per step, into a fresh journal file."""
    with Journal(path) as j:
        run = j.create_run("bench")
        head = j.append(run, [run_started()], expected_seq=0)
        n = 0
        t0 = time.perf_counter()
        for events in steps:
            head = j.append(run, events, expected_seq=head)
            n += len(events)
        dt = time.perf_counter() - t0
    return n / dt


def bench_int_floor_append(path: Path, steps: Sequence[Sequence[ev.Event]]) -> float:
    """events/s of plain sqlite3 inserting the same payloads into an integer-keyed table."""
    payloads = [[ev.encode(e) for e in events] for events in steps]
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, payload BLOB NOT NULL)")
        cur = conn.cursor()
        n = 0
        t0 = time.perf_counter()
        for step in payloads:
            cur.execute("BEGIN IMMEDIATE")
            cur.executemany("INSERT INTO t (payload) VALUES (?)", [(p,) for p in step])
            cur.execute("COMMIT")
            n += len(step)
        dt = time.perf_counter() - t0
    finally:
        conn.close()
    return n / dt


def bench_floor_append(path: Path, steps: Sequence[Sequence[ev.Event]]) -> float:
    """events/s of plain sqlite3 inserting the journal's own rows, one transaction per step."""
    run = "f00d00000001"
    first = ev.encode(run_started())
    h0 = chain_hash("", 0, "run_started", ev.SCHEMA_VERSION, first)
    rows = precompute_rows(run, steps, 1, h0)
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA foreign_keys=ON")
        for ddl in FLOOR_DDL:
            conn.execute(ddl)
        conn.execute(
            "INSERT INTO runs VALUES (1, ?, NULL, NULL, ?, 'bench', '2026-01-01', '')", (run, run)
        )
        conn.execute(
            "INSERT INTO events VALUES (?, 1, 0, NULL, ?, ?, ?, ?)",
            (SPAN, KIND_CODES["run_started"], ev.SCHEMA_VERSION, first, hash_cell(h0)),
        )
        sql = (
            "INSERT INTO events (id, run_key, seq, step, kind, version, payload, hash)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
        )
        cur = conn.cursor()
        n = 0
        t0 = time.perf_counter()
        for step_rows in rows:
            cur.execute("BEGIN IMMEDIATE")
            cur.executemany(sql, step_rows)
            cur.execute("COMMIT")
            n += len(step_rows)
        dt = time.perf_counter() - t0
    finally:
        conn.close()
    return n / dt


def section_append(work: Path, n_steps: int, reps: int, quiet: bool) -> dict[str, Any]:
    steps = make_steps(n_steps, seed=2)
    runners = {
        "journal": bench_journal_append,
        "int_floor": bench_int_floor_append,
        "rows_floor": bench_floor_append,
    }
    rates: dict[str, list[float]] = {k: [] for k in runners}
    for i in range(reps):
        order = list(runners) if i % 2 == 0 else list(reversed(runners))
        for which in order:
            path = work / f"append-{which}-{i}.db"
            settle()
            rates[which].append(runners[which](path, steps))
            remove_db(path)
            say(quiet, f"  append rep {i + 1} {which}: done")
    best_j, best_f = max(rates["journal"]), max(rates["int_floor"])
    best_rows = max(rates["rows_floor"])
    return {
        "steps": n_steps,
        "events": n_steps * EVENTS_PER_STEP,
        "reps": reps,
        "statistic": "best",
        "journal_events_per_s": best_j,
        "floor_events_per_s": best_f,
        "rows_floor_events_per_s": best_rows,
        "journal_runs": rates["journal"],
        "floor_runs": rates["int_floor"],
        "rows_floor_runs": rates["rows_floor"],
        "ratio": best_j / best_f,
        "ratio_to_own_rows": best_j / best_rows,
        "ratio_of_medians": statistics.median(rates["journal"])
        / statistics.median(rates["int_floor"]),
        "target_ratio": TARGET_APPEND_RATIO,
        "pass": best_j / best_f >= TARGET_APPEND_RATIO,
    }


# ------------------------------------------------ 2-4. one run of N events


def build_big_run(j: Journal, n_events: int, quiet: bool) -> tuple[str, float, float, int]:
    """One run of exactly n_events (RunStarted + steps of 3), appended one step per call.

    Returns the run id, the average encoded payload, the append time and the head."""
    n_steps = -(-(n_events - 1) // EVENTS_PER_STEP)
    steps = make_steps(n_steps, seed=3)
    steps[-1] = steps[-1][: n_events - 1 - EVENTS_PER_STEP * (n_steps - 1)]
    payload_bytes = len(ev.encode(run_started())) + sum(
        len(ev.encode(e)) for events in steps for e in events
    )
    run = j.create_run("bench")
    head = j.append(run, [run_started()], expected_seq=0)
    t0 = time.perf_counter()
    for i, events in enumerate(steps, 1):
        head = j.append(run, events, expected_seq=head)
        if i % 10000 == 0:
            say(quiet, f"  appended {head:,} events")
    dt = time.perf_counter() - t0
    return run, payload_bytes / head, dt, head


def section_run(work: Path, n_events: int, quiet: bool) -> dict[str, Any]:
    if n_events < 40:
        raise SystemExit("--events must be at least 40")
    out: dict[str, Any] = {"events": n_events}

    empty_path = work / "empty.db"
    with Journal(empty_path) as j:
        j.checkpoint()
    empty = _file_bytes(empty_path)

    path = work / "big.db"
    j = Journal(path)
    try:
        say(quiet, f"  appending {n_events:,} events through Journal.append ...")
        run, avg_payload, append_s, head = build_big_run(j, n_events, quiet)
        if head != n_events:
            raise SystemExit(f"appended {head} events, expected {n_events}")
        out["build_append_s"] = append_s
        out["build_events_per_s"] = (n_events - 1) / append_s

        # 3. size, events only
        j.checkpoint()
        size_events = _file_bytes(path)
        per_event = (size_events - empty) / n_events
        out["size"] = {
            "empty_journal_bytes": empty,
            "file_bytes_events_only": size_events,
            "avg_payload_bytes": avg_payload,
            "bytes_per_event": per_event,
            "ratio": per_event / avg_payload,
            "target_ratio": TARGET_SIZE_RATIO,
            "pass": per_event / avg_payload <= TARGET_SIZE_RATIO,
        }

        # 2. snapshots, then s_k
        say(quiet, "  building snapshots ...")
        t0 = time.perf_counter()
        st.build_snapshots(j, run)
        out["build_snapshots_s"] = time.perf_counter() - t0
        peek = sqlite3.connect(path)  # a second, read-only look at the snapshot cache
        try:
            n_snap, snap_bytes = peek.execute(
                "SELECT count(*), coalesce(sum(length(state)), 0) FROM snapshots WHERE run_id = ?",
                (run,),
            ).fetchone()
        finally:
            peek.close()
        j.checkpoint()
        size_all = _file_bytes(path)
        per_event_all = (size_all - empty) / n_events
        out["size"].update(
            {
                "snapshots": int(n_snap),
                "snapshot_avg_bytes": (snap_bytes / n_snap) if n_snap else 0.0,
                "file_bytes_with_snapshots": size_all,
                "bytes_per_event_with_snapshots": per_event_all,
                "ratio_with_snapshots": per_event_all / avg_payload,
                "pass_with_snapshots": per_event_all / avg_payload <= TARGET_SIZE_RATIO,
            }
        )

        every = st.SNAPSHOT_EVERY
        # the asked-for points, plus the worst case: the most events past the last snapshot
        worst = (n_events - 10) // every * every - 1
        seqs = [10, n_events // 2, n_events - 10, *([worst] if worst > every else [])]
        recon = []
        for seq in seqs:
            say(quiet, f"  reconstructing s at seq {seq:,} ...")
            snap_state = st.state_at_seq(j, run, seq)
            plain_state = st.fold(e.event for e in j.read(run, 0, seq))
            if st.encode_state(snap_state) != st.encode_state(plain_state):
                raise SystemExit(f"state_at_seq({seq}) disagrees with the plain fold")
            snap_t = median_time(lambda seq=seq: st.state_at_seq(j, run, seq), 21)
            plain_reps = 21 if seq <= 1000 else 3
            plain_t = median_time(
                lambda seq=seq: st.fold(e.event for e in j.read(run, 0, seq)), plain_reps
            )
            recon.append(
                {
                    "seq": seq,
                    "folded_past_snapshot": seq if seq < every else seq % every,
                    "snapshot_ms": ms(snap_t),
                    "plain_fold_ms": ms(plain_t),
                    "plain_reps": plain_reps,
                    "pass": ms(snap_t) <= TARGET_STATE_MS,
                }
            )
        snap_ms = [r["snapshot_ms"] for r in recon[:3]]
        out["reconstruct"] = {
            "statistic": "median",
            "reps": 21,
            "points": recon,
            "flatness": max(snap_ms) / min(snap_ms),
            "target_ms": TARGET_STATE_MS,
            "pass": all(r["pass"] for r in recon),
        }

        # 4. fork
        say(quiet, "  forking ...")
        fork_seqs = [10, n_events - 10]
        reps = 200
        times: dict[int, list[float]] = {s: [] for s in fork_seqs}
        for _ in range(5):  # warm-up
            for s in fork_seqs:
                j.fork(run, s)
        for i in range(reps):
            for s in fork_seqs if i % 2 == 0 else reversed(fork_seqs):
                t0 = time.perf_counter()
                j.fork(run, s)
                times[s].append(time.perf_counter() - t0)
        fork_ms = {s: ms(statistics.median(times[s])) for s in fork_seqs}
        spread = max(fork_ms.values()) / min(fork_ms.values())
        out["fork"] = {
            "statistic": "median",
            "reps": reps,
            "points": [{"seq": s, "ms": fork_ms[s]} for s in fork_seqs],
            "spread": spread,
            "target_spread": TARGET_FORK_SPREAD,
            "pass": spread <= TARGET_FORK_SPREAD,
        }
    finally:
        j.close()
    return out


# ------------------------------------------------------------------ report


def print_table(res: dict[str, Any]) -> None:
    a, r = res["append"], res["run"]
    sz, rc, fk = r["size"], r["reconstruct"], r["fork"]
    rows: list[Row] = []
    rows.append(
        (
            f"append: Journal.append ({a['steps']:,} steps x 3, best of {a['reps']})",
            f"{a['journal_events_per_s']:,.0f} ev/s",
            "",
            "",
        )
    )
    rows.append(
        (
            f"append: raw sqlite3, integer-keyed table (best of {a['reps']})",
            f"{a['floor_events_per_s']:,.0f} ev/s",
            "",
            "",
        )
    )
    rows.append(
        (
            f"append: raw sqlite3, the journal's own rows (best of {a['reps']})",
            f"{a['rows_floor_events_per_s']:,.0f} ev/s",
            f"(journal {a['ratio_to_own_rows']:.2f}x)",
            "",
        )
    )
    rows.append(
        (
            "append: ratio journal / integer-keyed floor",
            f"{a['ratio']:.2f}",
            f">= {a['target_ratio']}",
            verdict(a["pass"]),
        )
    )
    rows.append(
        (
            f"build: {r['events']:,} events via Journal.append",
            f"{r['build_append_s']:.2f} s",
            f"({r['build_events_per_s']:,.0f} ev/s)",
            "",
        )
    )
    rows.append(
        (
            f"s_k: build_snapshots, one-time ({sz['snapshots']} snapshots)",
            f"{r['build_snapshots_s']:.2f} s",
            "",
            "",
        )
    )
    for p in rc["points"]:
        rows.append(
            (
                f"s_k: state_at_seq seq={p['seq']:,}, fold {p['folded_past_snapshot']}"
                f" (median of {rc['reps']})",
                f"{p['snapshot_ms']:.2f} ms",
                f"<= {rc['target_ms']:g} ms",
                verdict(p["pass"]),
            )
        )
        rows.append(
            (
                f"     plain fold from 0, seq={p['seq']:,} (median of {p['plain_reps']})",
                f"{p['plain_fold_ms']:,.2f} ms",
                "",
                "",
            )
        )
    rows.append(("size: empty journal", f"{sz['empty_journal_bytes']:,} B", "", ""))
    rows.append(("size: avg encoded payload", f"{sz['avg_payload_bytes']:,.0f} B/ev", "", ""))
    rows.append(
        (
            "size: on disk per event, events only",
            f"{sz['bytes_per_event']:,.0f} B/ev ({sz['ratio']:.2f}x)",
            f"<= {sz['target_ratio']}x",
            verdict(sz["pass"]),
        )
    )
    rows.append(
        (
            f"size: snapshots ({sz['snapshots']}, avg {sz['snapshot_avg_bytes'] / 1024:,.0f} KiB)",
            f"{(sz['file_bytes_with_snapshots'] - sz['file_bytes_events_only']) / 2**20:,.1f} MiB",
            "",
            "",
        )
    )
    rows.append(
        (
            "size: on disk per event, with snapshots",
            f"{sz['bytes_per_event_with_snapshots']:,.0f} B/ev ({sz['ratio_with_snapshots']:.2f}x)",
            f"<= {sz['target_ratio']}x",
            verdict(sz["pass_with_snapshots"]),
        )
    )
    for p in fk["points"]:
        rows.append(
            (
                f"fork: Journal.fork seq={p['seq']:,} (median of {fk['reps']})",
                f"{p['ms']:.3f} ms",
                "",
                "",
            )
        )
    rows.append(
        (
            "fork: spread between the two",
            f"{fk['spread']:.2f}x",
            f"<= {fk['target_spread']}x",
            verdict(fk["pass"]),
        )
    )
    print_rows(rows)
    print_footer(res["env"], "throughput: best of runs, latencies: medians")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", type=int, default=100_000, help="events in the big run (N)")
    p.add_argument("--append-steps", type=int, default=3000, help="steps per append run")
    p.add_argument("--reps", type=int, default=3, help="append runs of each kind")
    add_output_options(p)
    args = p.parse_args(argv)
    quiet = args.json

    with work_dir("car-bench-", args.dir) as work:
        say(quiet, f"append: {args.append_steps:,} steps x {args.reps} reps, alternating")
        res: dict[str, Any] = {"append": section_append(work, args.append_steps, args.reps, quiet)}
        say(quiet, f"run of {args.events:,} events")
        res["run"] = section_run(work, args.events, quiet)
    res["env"] = environment()
    emit(res, args.json, print_table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
