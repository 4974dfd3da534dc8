"""What detection costs: rules analysis per game, and the causal detector's sequential rule.

Run: .venv/bin/python bench/bench_detect.py [--games 20] [--causal-games 10] [--json]

1. Rules, per 24-step game of the default crew (medians over games of the median of --reps
   timings each): the time to read the game's public view from the journal (the floor every
   detector pays) beside the rules' analysis of that view, and `analyze(method="rules")` end
   to end (view + analysis + output + calibration). Target: analysis <= 20 ms.
2. Causal: forward runs and wall time to a confident answer with the sequential rule, against
   the same detector spending a fixed K = 20 forward runs per agent (120 a game), on the same
   games, in the same run. Target: <= 1/2 of the fixed runs. The accuracy of both is printed
   too: stopping early must not cost the answer.
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import (
    add_output_options,
    emit,
    environment,
    loadavg,
    ms,
    print_footer,
    print_rows,
    say,
    verdict,
    work_dir,
)

from engine.detect import analyze
from engine.detect.analysis import inputs
from engine.detect.evaluate import record_games, truth
from engine.detect.rules import rule_scores
from engine.heist.sim import SimPolicy
from engine.journal import Journal
from engine.public import public_view

SEED = 90_000
FIXED_K = 20


def _median(fn, reps: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(games: int, causal_games: int, reps: int, parent: str | None, quiet: bool) -> dict:  # type: ignore[type-arg]
    env = environment(loadavg_start=loadavg())
    t_start = time.perf_counter()
    with work_dir("bench-detect-", parent) as work, Journal(work / "j.db") as j:
        say(quiet, f"recording {games} games (seeds {SEED}..{SEED + games - 1})")
        runs = record_games(j, games, seed=SEED, policy=SimPolicy())
        view_ms, rules_ms, e2e_ms = [], [], []
        for rid in runs:
            view = public_view(j, rid)
            agents, msgs, tools = inputs(view)
            view_ms.append(ms(_median(lambda rid=rid: public_view(j, rid), reps)))
            rules_ms.append(
                ms(_median(lambda a=agents, m=msgs, t=tools: rule_scores(m, t, a), reps))
            )
            e2e_ms.append(ms(_median(lambda rid=rid: analyze(j, rid, method="rules"), reps)))
        causal = []
        for i, rid in enumerate(runs[:causal_games]):
            say(quiet, f"causal game {i + 1}/{causal_games}")
            mole = truth(j, rid)
            row = {}
            for mode, sequential in (("sequential", True), ("fixed", False)):
                t0 = time.perf_counter()
                out = analyze(j, rid, method="causal", k_max=FIXED_K, sequential=sequential, seed=i)
                row[mode] = {
                    "forward_runs": out["forward_runs"],
                    "seconds": time.perf_counter() - t0,
                    "right": mole is not None and out["suggested_mole"] == mole.mole,
                    "separated": out["separated"],
                }
            causal.append(row)
    env["loadavg_end"] = loadavg()
    env["wall_s"] = time.perf_counter() - t_start

    def total(mode: str, key: str) -> float:
        return sum(float(r[mode][key]) for r in causal)

    return {
        "env": env,
        "games": games,
        "causal_games": causal_games,
        "public_view_ms": statistics.median(view_ms),
        "rules_analysis_ms": statistics.median(rules_ms),
        "rules_analysis_ms_max": max(rules_ms),
        "analyze_rules_ms": statistics.median(e2e_ms),
        "causal_sequential_runs_per_game": total("sequential", "forward_runs") / len(causal),
        "causal_fixed_runs_per_game": total("fixed", "forward_runs") / len(causal),
        "causal_runs_ratio": total("sequential", "forward_runs") / total("fixed", "forward_runs"),
        "causal_sequential_s_per_game": total("sequential", "seconds") / len(causal),
        "causal_fixed_s_per_game": total("fixed", "seconds") / len(causal),
        "causal_wall_ratio": total("sequential", "seconds") / total("fixed", "seconds"),
        "causal_sequential_right": total("sequential", "right"),
        "causal_fixed_right": total("fixed", "right"),
        "causal_sequential_separated": total("sequential", "separated"),
    }


def table(r: dict) -> None:  # type: ignore[type-arg]
    n = r["causal_games"]
    rows = [
        ("read the public view of a game (floor)", f"{r['public_view_ms']:.2f} ms", "", ""),
        (
            "rules analysis of the view (median; max)",
            f"{r['rules_analysis_ms']:.2f} ms; {r['rules_analysis_ms_max']:.2f}",
            "<= 20 ms",
            verdict(r["rules_analysis_ms_max"] <= 20.0),
        ),
        ("analyze(method=rules) end to end", f"{r['analyze_rules_ms']:.2f} ms", "", ""),
        (
            "causal forward runs per game: sequential vs fixed K=20",
            f"{r['causal_sequential_runs_per_game']:.1f} vs {r['causal_fixed_runs_per_game']:.0f}"
            f" = {r['causal_runs_ratio']:.2f}",
            "<= 0.5",
            verdict(r["causal_runs_ratio"] <= 0.5),
        ),
        (
            "causal wall time per game: sequential vs fixed",
            f"{r['causal_sequential_s_per_game']:.2f} vs {r['causal_fixed_s_per_game']:.2f} s"
            f" = {r['causal_wall_ratio']:.2f}",
            "<= 0.5",
            verdict(r["causal_wall_ratio"] <= 0.5),
        ),
        (
            "causal right: sequential vs fixed (separated)",
            f"{r['causal_sequential_right']:.0f}/{n} vs {r['causal_fixed_right']:.0f}/{n} "
            f"({r['causal_sequential_separated']:.0f}/{n})",
            "",
            "",
        ),
    ]
    print_rows(rows)
    print_footer(
        r["env"],
        f"{r['games']} sim games of 24 steps (default crew), seeds {SEED}+; "
        f"causal on the first {n}",
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--games", type=int, default=20)
    p.add_argument("--causal-games", type=int, default=10)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--quiet", action="store_true")
    add_output_options(p)
    a = p.parse_args()
    res = run(a.games, min(a.causal_games, a.games), a.reps, a.dir, a.quiet or a.json)
    emit(res, a.json, table)


if __name__ == "__main__":
    main()
