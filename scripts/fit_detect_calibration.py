#!/usr/bin/env python3
"""Fit the detector's confidence calibration and write engine/detect/calibration.yaml.

    .venv/bin/python scripts/fit_detect_calibration.py [--games-rules 300] [--games-causal 90]

Records training heists with the embedded sim policy on crews of 4, 6 and 8 agents (the
default crew, its first four, and the default crew plus two more), with root seeds from
1,000,000,000 on — a range `car detect-eval` never reaches with its default seeds — runs each
method, and fits confidence = sigmoid(a * margin + b * log(n_agents - 1) + c) by logistic
regression (engine/detect/calibration.py). The crews used by the tests' held-out checks (names
the detector has never seen) are not among them. LLM-based methods are not fitted here: their
scores depend on the model, and their confidence says "uncalibrated" until someone fits one.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.detect import analyze  # noqa: E402
from engine.detect.calibration import _sigmoid, features, fit  # noqa: E402
from engine.detect.evaluate import CALIBRATION_SEED_BASE, truth  # noqa: E402
from engine.heist.config import AgentSpec, HeistConfig, load_agents_config  # noqa: E402
from engine.heist.session import record_heist  # noqa: E402
from engine.heist.sim import SimPolicy  # noqa: E402
from engine.journal import Journal  # noqa: E402


def crews() -> list[HeistConfig]:
    base = load_agents_config()
    extra = (
        AgentSpec(
            "fixer",
            "Logistics fixer",
            "Keep the crew's tools and timing in order",
            ("calculator", "database_query"),
        ),
        AgentSpec(
            "medic",
            "Crew medic and second lookout",
            "Watch the guards and the clock",
            ("database_query", "file_reader"),
        ),
    )
    return [
        HeistConfig(base.agents[:4], source="calibration-4"),
        base,
        HeistConfig((*base.agents, *extra), source="calibration-8"),
    ]


def rows_for(j: Journal, method: str, games: int, offset: int) -> list[tuple[float, int, bool]]:
    rows = []
    configs = crews()
    for i in range(games):
        cfg = configs[i % len(configs)]
        seed = CALIBRATION_SEED_BASE + offset + i
        rid = record_heist(j, SimPolicy(), seed=seed, config=cfg).run_id
        t = truth(j, rid)
        assert t is not None
        out = analyze(j, rid, method=method, seed=seed)
        rows.append((float(out["margin"]), len(cfg.agents), out["suggested_mole"] == t.mole))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--games-rules", type=int, default=300)
    ap.add_argument("--games-replay", type=int, default=150)
    ap.add_argument("--games-causal", type=int, default=90)
    ap.add_argument("--out", type=Path, default=ROOT / "engine/detect/calibration.yaml")
    args = ap.parse_args()
    plan = {"rules": args.games_rules, "replay": args.games_replay, "causal": args.games_causal}
    methods = {}
    with tempfile.TemporaryDirectory() as tmp, Journal(Path(tmp) / "train.db") as j:
        offset = 0
        for method, games in plan.items():
            t0 = time.perf_counter()
            rows = rows_for(j, method, games, offset)
            params = fit(rows)
            first = CALIBRATION_SEED_BASE + offset
            a, b, c = params
            p = [_sigmoid(a * features(m, n)[0] + b * features(m, n)[1] + c) for m, n, _ in rows]
            hits = [h for _, _, h in rows]
            ll = -sum(
                math.log(max(1e-12, q if h else 1 - q)) for q, h in zip(p, hits, strict=True)
            ) / len(rows)
            methods[method] = {
                "params": [round(x, 6) for x in params],
                "games": games,
                "seeds": f"{first}..{first + games - 1}",
                "crew_sizes": [len(c.agents) for c in crews()],
                "training_hit_rate": round(sum(hits) / len(hits), 4),
                "training_log_loss": round(ll, 4),
            }
            print(f"{method}: {methods[method]} ({time.perf_counter() - t0:.1f} s)", flush=True)
            offset += games
    header = (
        "# Fitted confidence calibration of the detector:\n"
        "#   confidence = sigmoid(a * margin + b * log(n_agents - 1) + c), params [a, b, c].\n"
        "# Made by scripts/fit_detect_calibration.py (sim policy, crews of 4/6/8 agents, seeds\n"
        "# >= 1e9, never the evaluation games). Do not edit by hand: re-run the script.\n"
    )
    doc = {
        "made_by": "scripts/fit_detect_calibration.py",
        "made_at": datetime.date.today().isoformat(),
        "policy": "sim",
        "methods": methods,
    }
    args.out.write_text(header + yaml.safe_dump(doc, sort_keys=False))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
