"""Forward runs the attribution estimators need on the built-in SCMs, and what CRN buys.

Run: .venv/bin/python bench/bench_attribution.py [--seeds 50] [--target 0.05]

Criterion ("done"): the estimated locus equals the exact locus AND the effect intervals of the
locus step and of every later step (the intervals the point-of-commitment claim rests on) have
half-width <= target. Earlier steps are reported but not held to the target.

Compared, per model, averaged over seeds:
  fixed K (formula)  the paper's estimator with the K a user must plan for: the smallest K
                     whose 95% Wilson interval meets the target in the worst case (p = 1/2),
                     spent at every step;
  fixed K (oracle)   the smallest K that happened to meet the criterion for that seed, found
                     after the fact on the same runs (no fixed design can know it in advance:
                     a lower bound for fixed K);
  adaptive + CRN     the adaptive scan with common random numbers (its intervals carry the
                     alpha split over looks, so they are wider per run than the fixed ones).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from engine.attribution import ForwardRequest, contrastive
from engine.attribution.contrastive import _runs_for_half_width, wilson
from engine.attribution.scm import SCM, builtin_models, seeds_array
from engine.attribution.shapley import shapley
from engine.attribution.validate import covers


def criterion_met(
    steps: list[tuple[float, float]], locus: int | None, exact: int | None, target: float
) -> bool:
    if locus != exact or locus is None:
        return False
    return all((hi - lo) / 2 <= target for lo, hi in steps[locus:])


def oracle_fixed_k(
    model: SCM, seed: int, exact: int | None, target: float, k_max: int
) -> int | None:
    """Smallest K at which fixed-K (shared seeds, nominal 95%) meets the criterion."""
    rng = np.random.default_rng(seed)
    seeds = seeds_array(rng.integers(0, 2**63, size=k_max).tolist())
    n = model.n_steps
    cum = []
    for k in range(n):
        keep = np.zeros((k_max, n), dtype=bool)
        keep[:, :k] = True
        cum.append(np.cumsum(model.simulate(keep, seeds)))
    for kk in range(1, k_max + 1):
        cis = [wilson(int(c[kk - 1]), kk, 0.05) for c in cum]
        locus = None
        for k, (_, hi) in enumerate(cis):
            if hi < 1.0:
                locus = k
        if criterion_met(cis, locus, exact, target):
            return kk
    return None


def runs_per_second(model: SCM, runs: int = 200_000) -> tuple[float, float]:
    rng = np.random.default_rng(0)
    seeds = rng.integers(0, 2**63, size=runs).tolist()
    keep = frozenset(range(model.n_steps // 2))
    requests = [ForwardRequest(keep, s) for s in seeds]
    t = time.perf_counter()
    model.run_batch(requests)
    through_protocol = runs / (time.perf_counter() - t)
    mask = np.zeros((runs, model.n_steps), dtype=bool)
    mask[:, : model.n_steps // 2] = True
    array = seeds_array(seeds)
    t = time.perf_counter()
    model.simulate(mask, array)
    vectorised = runs / (time.perf_counter() - t)
    return through_protocol, vectorised


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=50)
    parser.add_argument("--target", type=float, default=0.05)
    args = parser.parse_args()
    seeds = range(args.seeds)
    target = args.target
    k_formula = _runs_for_half_width(target, 0.05, worst_case=True)

    doc = __doc__ or ""
    print(doc[doc.index("Criterion") : doc.index("Compared")].strip())
    print(
        f"\nseeds per model: {args.seeds}; target half-width: {target}; "
        f"fixed K from the formula: {k_formula} per step\n"
    )
    header = (
        f"{'model':<16} {'steps':>5} {'fixed K formula':>16} {'fixed K oracle':>15} "
        f"{'adaptive+CRN':>13} {'adaptive':>9} {'ratio/formula':>14} {'ratio/oracle':>13} "
        f"{'done':>6}"
    )
    print("forward runs to reach the criterion (mean over seeds)")
    print(header)
    print("-" * len(header))
    ratios_formula, ratios_oracle = [], []
    for model in builtin_models():
        exact = model.exact_locus()
        n = model.n_steps
        fixed_formula = n * k_formula
        oracle = [oracle_fixed_k(model, s, exact, target, 1000) for s in seeds]
        oracle_runs = float(np.mean([n * k for k in oracle if k is not None]))
        adaptive_runs, plain_runs, done = [], [], 0
        for s in seeds:
            r = contrastive(model, rng=np.random.default_rng(s), target_half_width=target)
            adaptive_runs.append(r.forward_runs)
            done += criterion_met([st.ci for st in r.steps], r.locus, exact, target)
            r2 = contrastive(
                model, rng=np.random.default_rng(s), target_half_width=target, crn=False
            )
            plain_runs.append(r2.forward_runs)
        a = float(np.mean(adaptive_runs))
        ratios_formula.append(a / fixed_formula)
        ratios_oracle.append(a / oracle_runs)
        print(
            f"{model.name:<16} {n:>5} {fixed_formula:>16.0f} {oracle_runs:>15.0f} "
            f"{a:>13.0f} {np.mean(plain_runs):>9.0f} {a / fixed_formula:>14.2f} "
            f"{a / oracle_runs:>13.2f} {done:>3}/{len(seeds)}"
        )
    print(
        f"{'mean ratio':<16} {'':>5} {'':>16} {'':>15} {'':>13} {'':>9} "
        f"{np.mean(ratios_formula):>14.2f} {np.mean(ratios_oracle):>13.2f}"
    )
    print(
        "(adaptive = the same scan without CRN; "
        "'done' counts adaptive+CRN seeds meeting the criterion)"
    )

    print("\nwhat common random numbers buy (fixed K = 100, 200 seeds)")
    print(
        f"{'model':<16} {'sd effect_L, CRN':>17} {'no CRN':>8} "
        f"{'sd effect_L-1 - effect_L, CRN':>30} {'no CRN':>8}   (L = the exact locus)"
    )
    for model in builtin_models():
        locus = model.exact_locus()
        assert locus is not None
        single: dict[bool, list[float]] = {True: [], False: []}
        pair: dict[bool, list[float]] = {True: [], False: []}
        for s in range(200):
            for crn in (True, False):
                r = contrastive(
                    model,
                    rng=np.random.default_rng(s),
                    mode="fixed",
                    k=100,
                    crn=crn,
                    all_steps=True,
                )
                single[crn].append(r.steps[locus].effect)
                if locus > 0:
                    pair[crn].append(r.steps[locus - 1].effect - r.steps[locus].effect)
        with_crn = f"{np.std(pair[True]):>30.4f}" if locus > 0 else f"{'(locus is step 0)':>30}"
        without = f"{np.std(pair[False]):>8.4f}" if locus > 0 else f"{'':>8}"
        print(
            f"{model.name:<16} {np.std(single[True]):>17.4f} {np.std(single[False]):>8.4f} "
            f"{with_crn} {without}"
        )
    print(
        f"\n{'model':<16} {'Shapley mean CI half-width, CRN in chain':>42} {'no CRN':>8}"
        "   (budget 2000, 100 seeds)"
    )
    for model in builtin_models():
        widths: dict[bool, list[float]] = {True: [], False: []}
        for s in range(100):
            for crn in (True, False):
                result = shapley(model, rng=np.random.default_rng(s), budget=2000, crn=crn)
                widths[crn].extend((v.ci[1] - v.ci[0]) / 2 for v in result.values)
        print(f"{model.name:<16} {np.mean(widths[True]):>42.4f} {np.mean(widths[False]):>8.4f}")

    print(
        "\ncoverage of the exact values by nominal 95% intervals "
        "(200 seeds; min over steps/players)"
    )
    print(
        f"{'model':<16} {'contrastive fixed K=100':>24} {'contrastive adaptive':>21} "
        f"{'Shapley (budget 2000)':>22}"
    )
    for model in builtin_models():
        effects = model.exact_effects()
        phi = model.exact_shapley()
        cover: dict[str, list[list[bool]]] = {"fixed": [], "adaptive": [], "shapley": []}
        for s in range(200):
            for mode in ("fixed", "adaptive"):
                r = contrastive(model, rng=np.random.default_rng(s), mode=mode, k=100)
                cover[mode].append([covers(st.ci, effects[st.step]) for st in r.steps])
            split = shapley(model, rng=np.random.default_rng(s), budget=2000)
            cover["shapley"].append([covers(v.ci, phi[v.player]) for v in split.values])
        mins = {key: float(np.min(np.mean(np.array(rows), axis=0))) for key, rows in cover.items()}
        print(
            f"{model.name:<16} {mins['fixed']:>24.3f} {mins['adaptive']:>21.3f} "
            f"{mins['shapley']:>22.3f}"
        )

    print("\nSCM forward runs per second (one process)")
    for model in builtin_models():
        proto, raw = runs_per_second(model)
        print(
            f"{model.name:<16} through run_batch(ForwardRequest...): {proto:>12,.0f}/s   "
            f"vectorised simulate(): {raw:>14,.0f}/s"
        )


if __name__ == "__main__":
    main()
