"""Small statistics of the detector: Wilson intervals, Newcombe's difference interval, AUROC.

Closed forms (with the normal quantile from the standard library) rather than scipy's
`binomtest`: the causal detector's sequential rule looks at intervals after every round, and
a closed form costs microseconds. tests/test_detect_stats.py checks them against scipy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist


def z_for(level: float) -> float:
    """The two-sided normal quantile for a confidence level (1.96 at 0.95)."""
    return NormalDist().inv_cdf(0.5 + level / 2.0)


def wilson(successes: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a proportion; (0, 1) when there is no trial."""
    if n <= 0:
        return (0.0, 1.0)
    z = z_for(level)
    p = successes / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def newcombe(x1: int, n1: int, x2: int, n2: int, level: float = 0.95) -> tuple[float, float]:
    """Newcombe's hybrid score interval (his method 10) of p1 - p2 from two Wilson intervals."""
    p1, p2 = x1 / n1, x2 / n2
    l1, u1 = wilson(x1, n1, level)
    l2, u2 = wilson(x2, n2, level)
    d = p1 - p2
    return (d - math.hypot(p1 - l1, u2 - p2), d + math.hypot(u1 - p1, p2 - l2))


def auroc(positives: Sequence[float], negatives: Sequence[float]) -> float | None:
    """P(score of a random positive > score of a random negative), ties counted half."""
    if not positives or not negatives:
        return None
    wins = 0.0
    for p in positives:
        for q in negatives:
            wins += 1.0 if p > q else 0.5 if p == q else 0.0
    return wins / (len(positives) * len(negatives))
