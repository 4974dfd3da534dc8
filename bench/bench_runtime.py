#!/usr/bin/env python
"""Runtime benchmark: steps/s of a recorded `sim` heist, journal against memory.

    .venv/bin/python bench/bench_runtime.py               # table
    .venv/bin/python bench/bench_runtime.py --seeds 20    # more heists per repetition
    .venv/bin/python bench/bench_runtime.py --json        # the numbers as JSON on stdout

Workload: the default crew (6 agents) for 4 rounds (24 steps) with the `sim` policy, one heist
per seed (seeds 1..S).

1. record  steps/s of `record_heist` into a real SQLite journal (a fresh file per repetition,
           opened outside the timing), beside steps/s of the very same loop (`run_episode`,
           same scenario, policy, seeds and opening RunStarted/MoleAssigned events) recording
           to a list (`MemoryRecorder`). Within a repetition every seed runs once each way,
           the order alternating seed by seed, so both see the same machine. The recorder's
           overhead is journal_time / memory_time (target <= 1.5x), from the best repetition
           of each (the verdict) and from the medians (shown beside it).
2. parts   microseconds per step of the pieces of the loop, each timed alone over the inputs
           one memory run produced: the sim policy's `decide`, the tools the steps called,
           the agent view plus prompt rendering, the state fold, and `Journal.append` of the
           same events, one call per step, into a fresh journal (medians of several passes).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common import (
    Row,
    add_output_options,
    emit,
    environment,
    loadavg,
    median_time,
    print_footer,
    print_rows,
    remove_db,
    say,
    settle,
    us,
    verdict,
    work_dir,
)

from engine import events as ev
from engine.heist.config import HeistConfig, load_agents_config
from engine.heist.session import (
    SCENARIO,
    HeistScenario,
    choose_heist_mole,
    opening_events,
    record_heist,
)
from engine.journal import Journal
from engine.policies.base import AgentView, Completion, Policy
from engine.policies.registry import make_policy
from engine.runtime.clock import SystemClock
from engine.runtime.episode import EpisodeResult, run_episode
from engine.runtime.recorder import MemoryRecorder
from engine.runtime.seeds import step_seed
from engine.state import State, apply

ROUNDS = 4
TARGET_OVERHEAD = 1.5


# ------------------------------------------------------------------ the two loops


def record_memory(
    policy: Policy, config: HeistConfig, seed: int, rounds: int
) -> tuple[EpisodeResult, MemoryRecorder, HeistScenario]:
    """`record_heist` with the journal swapped for a list: same scenario, loop and seeds."""
    scenario = HeistScenario(config, seed, rounds)
    clock = SystemClock()
    recorder = MemoryRecorder()
    mole = choose_heist_mole(scenario.agents, seed)
    recorder.append(opening_events(scenario, policy, seed, clock.now_iso(), mole=mole))
    result = run_episode(recorder, scenario, policy, lambda k: step_seed(seed, k), [], clock=clock)
    return result, recorder, scenario


def record_journal(
    journal: Journal, policy: Policy, config: HeistConfig, seed: int, rounds: int
) -> EpisodeResult:
    return record_heist(journal, policy, seed=seed, rounds=rounds, config=config)


# ------------------------------------------------------------------ helpers


def _actions(events: Sequence[ev.Event]) -> list[str]:
    return [e.text for e in events if isinstance(e, ev.ChatMessage)]


# ------------------------------------------------------------------ 1. record


def section_record(
    work: Path, seeds: Sequence[int], rounds: int, reps: int, quiet: bool
) -> dict[str, Any]:
    config = load_agents_config(None)
    policy = make_policy({"name": "sim"})

    # warm-up: materialise every world, fill caches, and check that both loops agree
    check = Journal(work / "check.db")
    try:
        for seed in seeds:
            mem, rec, _ = record_memory(policy, config, seed, rounds)
            jr = record_journal(check, policy, config, seed, rounds)
            if (mem.status, mem.steps, mem.outcome) != (jr.status, jr.steps, jr.outcome):
                raise SystemExit(f"seed {seed}: journal and memory runs disagree")
            if _actions(rec.events) != _actions(check.events(jr.run_id)):
                raise SystemExit(f"seed {seed}: journal and memory actions disagree")
    finally:
        check.close()
    steps_per_rep = sum(HeistScenario(config, s, rounds).total_steps for s in seeds)

    journal_t: list[float] = []
    memory_t: list[float] = []
    for i in range(reps):
        path = work / f"record-{i}.db"
        j = Journal(path)
        settle()
        tj = tm = 0.0
        try:
            for n, seed in enumerate(seeds):
                order = ("journal", "memory") if (i + n) % 2 == 0 else ("memory", "journal")
                for which in order:
                    t0 = time.perf_counter()
                    if which == "journal":
                        r = record_journal(j, policy, config, seed, rounds)
                        tj += time.perf_counter() - t0
                    else:
                        r, _, _ = record_memory(policy, config, seed, rounds)
                        tm += time.perf_counter() - t0
                    if r.status != "completed":
                        raise SystemExit(f"seed {seed}: {which} run {r.status}: {r.error}")
        finally:
            j.close()
        remove_db(path)
        journal_t.append(tj)
        memory_t.append(tm)
        say(quiet, f"  rep {i + 1}: journal {tj * 1000:.0f} ms, memory {tm * 1000:.0f} ms")

    best_j, best_m = min(journal_t), min(memory_t)
    med_j, med_m = statistics.median(journal_t), statistics.median(memory_t)
    ratio = best_j / best_m
    return {
        "seeds": list(seeds),
        "rounds": rounds,
        "agents": len(config.names),
        "steps_per_rep": steps_per_rep,
        "reps": reps,
        "statistic": "best (verdict); median beside it",
        "journal_steps_per_s_best": steps_per_rep / best_j,
        "memory_steps_per_s_best": steps_per_rep / best_m,
        "journal_steps_per_s_median": steps_per_rep / med_j,
        "memory_steps_per_s_median": steps_per_rep / med_m,
        "journal_rep_s": journal_t,
        "memory_rep_s": memory_t,
        "ratio_best": ratio,
        "ratio_median": med_j / med_m,
        "journal_us_per_step_best": us(best_j / steps_per_rep),
        "memory_us_per_step_best": us(best_m / steps_per_rep),
        "overhead_us_per_step_best": us((best_j - best_m) / steps_per_rep),
        "target_ratio": TARGET_OVERHEAD,
        "pass": ratio <= TARGET_OVERHEAD,
    }


# ------------------------------------------------------------------ 2. parts


class _Capture:
    """A policy wrapper that keeps every (view, messages, seed) it was asked about."""

    def __init__(self, inner: Policy) -> None:
        self.inner = inner
        self.name = inner.name
        self.calls: list[tuple[AgentView, list[dict[str, str]], int]] = []

    def decide(self, view: AgentView, messages: list[dict[str, str]], seed: int) -> Completion:
        self.calls.append((view, messages, seed))
        return self.inner.decide(view, messages, seed)


def _step_groups(events: Sequence[ev.Event]) -> list[list[ev.Event]]:
    """A recorded run's events as the recorder appended them: the opening, then one list per
    step, then RunEnded."""
    groups: list[list[ev.Event]] = [list(events[:2])]
    for e in events[2:]:
        last = groups[-1][-1]
        if e.step is not None and len(groups) > 1 and last.step == e.step:
            groups[-1].append(e)
        else:
            groups.append([e])
    return groups


def section_parts(work: Path, seeds: Sequence[int], rounds: int, passes: int) -> dict[str, Any]:
    config = load_agents_config(None)
    sim = make_policy({"name": "sim"})
    runs = []
    for seed in seeds:
        cap = _Capture(sim)
        _, rec, scenario = record_memory(cap, config, seed, rounds)  # type: ignore[arg-type]
        states: list[State] = []
        s = State()
        for e in rec.events:
            if isinstance(e, ev.LlmCall):
                states.append(s)
            s = apply(s, e)
        tools = [(e.tool, e.param) for e in rec.events if isinstance(e, ev.ToolCall)]
        runs.append((scenario, cap.calls, states, tools, rec.events))
    steps = sum(len(calls) for _, calls, _, _, _ in runs)
    n_tools = sum(len(tools) for _, _, _, tools, _ in runs)

    def policy_pass() -> None:
        for _, calls, _, _, _ in runs:
            for view, messages, seed in calls:
                sim.decide(view, messages, seed)

    def tools_pass() -> None:
        for scenario, _, _, tools, _ in runs:
            for tool, param in tools:
                scenario.run_tool(tool, param)

    def render_pass() -> None:
        for scenario, _, states, _, _ in runs:
            for state in states:
                scenario.messages(scenario.view(state, "memory"))

    def fold_pass() -> None:
        for _, _, _, _, events in runs:
            s = State()
            for e in events:
                s = apply(s, e)

    appends = [_step_groups(events) for _, _, _, _, events in runs]
    n_pass = 0

    def append_pass() -> None:
        nonlocal n_pass
        n_pass += 1
        path = work / f"parts-{n_pass}.db"
        with Journal(path) as j:
            settle()
            t0 = time.perf_counter()
            for groups in appends:
                run = j.create_run(SCENARIO)
                head = 0
                for group in groups:
                    head = j.append(run, group, head)
            append_times.append(time.perf_counter() - t0)
        remove_db(path)

    append_times: list[float] = []

    policy_pass()
    tools_pass()  # warm the per-thread database connections
    out: dict[str, Any] = {"steps": steps, "tool_calls": n_tools, "passes": passes}
    out["statistic"] = "median"
    for name, fn in (
        ("policy", policy_pass),
        ("tools", tools_pass),
        ("view_render", render_pass),
        ("fold", fold_pass),
    ):
        out[f"{name}_us_per_step"] = us(median_time(fn, passes) / steps)
    for _ in range(passes):
        append_pass()
    out["journal_append_us_per_step"] = us(statistics.median(append_times) / steps)
    out["tools_us_per_call"] = out["tools_us_per_step"] * steps / n_tools if n_tools else 0.0
    return out


# ------------------------------------------------------------------ report


def print_table(res: dict[str, Any]) -> None:
    r, p = res["record"], res["parts"]
    rows: list[Row] = []
    head = f"{r['steps_per_rep']} steps = {len(r['seeds'])} heists x {r['agents']} x {r['rounds']}"
    rows.append((f"record: workload per repetition ({head})", f"{r['reps']} reps", "", ""))
    for which in ("journal", "memory"):
        label = "record_heist -> SQLite journal" if which == "journal" else "same loop -> memory"
        rows.append(
            (
                f"record: {label} (best)",
                f"{r[f'{which}_steps_per_s_best']:,.0f} steps/s",
                f"({r[f'{which}_us_per_step_best']:,.0f} us/step)",
                "",
            )
        )
        rows.append(
            (
                f"        {label} (median)",
                f"{r[f'{which}_steps_per_s_median']:,.0f} steps/s",
                "",
                "",
            )
        )
    rows.append(
        (
            "record: overhead journal / memory (best)",
            f"{r['ratio_best']:.2f}x",
            f"<= {r['target_ratio']}x",
            verdict(r["pass"]),
        )
    )
    rows.append(
        (
            "        overhead journal / memory (median)",
            f"{r['ratio_median']:.2f}x",
            f"<= {r['target_ratio']}x",
            verdict(r["ratio_median"] <= r["target_ratio"]),
        )
    )
    rows.append(
        (
            "record: journal cost per step (best - best)",
            f"{r['overhead_us_per_step_best']:,.0f} us",
            "",
            "",
        )
    )
    for key, label in (
        ("policy", "sim policy decide"),
        ("tools", f"tools ({p['tool_calls']} calls / {p['steps']} steps)"),
        ("view_render", "agent view + prompt render"),
        ("fold", "state fold (apply)"),
        ("journal_append", "Journal.append of the step's events (+ create_run)"),
    ):
        rows.append(
            (
                f"parts: {label} (median of {p['passes']})",
                f"{p[f'{key}_us_per_step']:,.0f} us/step",
                "",
                "",
            )
        )
    rows.append(("parts: one tool call", f"{p['tools_us_per_call']:,.0f} us/call", "", ""))
    print_rows(rows)
    print_footer(
        res["env"], "steps/s: best and median of repetitions (verdict on best), parts: medians"
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=12, help="heists (seeds 1..S) per repetition")
    p.add_argument("--rounds", type=int, default=ROUNDS, help="rounds per heist")
    p.add_argument("--reps", type=int, default=9, help="repetitions of journal and memory")
    p.add_argument("--passes", type=int, default=7, help="timed passes per part")
    add_output_options(p)
    args = p.parse_args(argv)
    quiet = args.json
    seeds = list(range(1, args.seeds + 1))

    load0 = loadavg()
    with work_dir("car-bench-runtime-", args.dir) as work:
        say(quiet, f"record: {len(seeds)} heists x {args.reps} reps, alternating")
        res: dict[str, Any] = {"record": section_record(work, seeds, args.rounds, args.reps, quiet)}
        say(quiet, "parts")
        res["parts"] = section_parts(work, seeds, args.rounds, args.passes)
    res["env"] = environment(loadavg_start=load0, loadavg_end=loadavg())
    emit(res, args.json, print_table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
