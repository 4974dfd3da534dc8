#!/usr/bin/env python
"""How often `car validate` fails by chance: its claim is a family-wise error rate of at most
5% on the built-in causal models, whose truth is known exactly.

    .venv/bin/python bench/bench_validate_rates.py                 # 2000 seeds a setting
    .venv/bin/python bench/bench_validate_rates.py --seeds 300 --json

For each setting (the adaptive default, --players agents, --all-steps, fixed --runs 2, 3, 5)
it runs the validation of every built-in model over seeds 10000.. and prints the share of
seeds whose report was not ok, with its Wilson 95% interval, beside the 5% claim.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from common import add_output_options, emit, environment, loadavg, say  # noqa: E402

from engine.attribution.contrastive import wilson  # noqa: E402
from engine.attribution.scm import builtin_models  # noqa: E402
from engine.attribution.validate import validate  # noqa: E402

SETTINGS: dict[str, dict[str, Any]] = {
    "adaptive (default)": {},
    "--players agents": {"players": "agents"},
    "--all-steps": {"all_steps": True},
    "--runs 2": {"k": 2},
    "--runs 3": {"k": 3},
    "--runs 5": {"k": 5},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_options(p)
    p.add_argument("--seeds", type=int, default=2000, help="seeds per setting")
    p.add_argument("--only", nargs="*", default=None, help="settings to run (names as printed)")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args()
    env = environment(loadavg_start=loadavg())
    models = builtin_models()
    rows = []
    for name, kw in SETTINGS.items():
        if a.only and name not in a.only:
            continue
        say(a.quiet, f"{name}: {a.seeds} seeds")
        t0 = time.perf_counter()
        failed = sum(
            not all(r.ok for r in validate(models, seed, **kw))
            for seed in range(10_000, 10_000 + a.seeds)
        )
        lo, hi = wilson(failed, a.seeds, 0.05)
        rows.append(
            {"setting": name, "seeds": a.seeds, "failed": failed, "rate": failed / a.seeds,
             "ci": [lo, hi], "seconds": time.perf_counter() - t0}
        )  # fmt: skip
    emit({"env": {**env, "loadavg_end": loadavg()}, "rows": rows}, a.json, _table)


def _table(res: dict[str, Any]) -> None:
    print("car validate failing by chance on the built-in models (claim: at most 5%)")
    for r in res["rows"]:
        print(
            f"  {r['setting']:<20} {r['failed']:>4}/{r['seeds']} = {100 * r['rate']:.1f}%"
            f"  (95% CI {100 * r['ci'][0]:.1f}-{100 * r['ci'][1]:.1f}%)  {r['seconds']:.0f} s"
        )


if __name__ == "__main__":
    main()
