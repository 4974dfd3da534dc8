"""`confidence`: the probability that the suggested agent is the mole, calibrated on games.

Each method's raw evidence for its top suspect is the margin between its two highest scores
(scores are in [0, 1]). A Platt-style logistic map turns that margin, together with the crew
size (the chance level is 1/#agents), into a probability:

    confidence = sigmoid(a * margin + b * log(n_agents - 1) + c)

The parameters are fitted by `fit` on recorded games that are never the ones evaluated (seeds
in a range of their own, see `scripts/fit_detect_calibration.py`) and shipped as data in
`calibration.yaml` with how they were made. A method without fitted parameters (e.g. an LLM
model the calibration never saw) falls back to `1/n + margin x (1 - 1/n)`, and the analysis says
that its confidence is uncalibrated.
"""

from __future__ import annotations

import functools
import importlib.resources
import math
from collections.abc import Sequence
from typing import Any

import yaml

CALIBRATION_FILE = "calibration.yaml"


def _sigmoid(z: float) -> float:
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


def features(margin: float, n_agents: int) -> tuple[float, float]:
    return (margin, math.log(max(n_agents - 1, 1)))


@functools.cache
def shipped() -> dict[str, Any]:
    """The fitted parameters shipped with the package (method -> entry)."""
    res = importlib.resources.files("engine.detect").joinpath(CALIBRATION_FILE)
    if not res.is_file():
        return {}
    data = yaml.safe_load(res.read_text()) or {}
    return dict(data.get("methods", {}))


def key_for(method: str, model: str | None) -> str:
    """LLM-based methods are calibrated per model: another model gives other scores."""
    return f"{method}@{model}" if method in ("llm", "rules+llm") and model else method


def confidence(
    method: str, margin: float, n_agents: int, model: str | None = None
) -> tuple[float, bool]:
    """(confidence, calibrated?) for a top suspect with this margin in a crew of n agents."""
    entry = shipped().get(key_for(method, model))
    if entry is None:
        base = 1.0 / max(n_agents, 1)
        return base + max(0.0, min(margin, 1.0)) * (1.0 - base), False
    a, b, c = (float(x) for x in entry["params"])
    x1, x2 = features(margin, n_agents)
    return _sigmoid(a * x1 + b * x2 + c), True


def fit(rows: Sequence[tuple[float, int, bool]], l2: float = 1e-3) -> list[float]:
    """Logistic fit of (margin, n_agents, suggested agent was the mole) rows; returns a, b, c.

    A small L2 penalty on the slopes keeps the fit finite when margins separate hits from
    misses perfectly."""
    import numpy as np
    from scipy.optimize import minimize

    if not rows:
        raise ValueError("cannot fit a calibration on no games")
    x = np.array([[*features(m, n), 1.0] for m, n, _ in rows])
    # Platt's target smoothing: hits count as (N+ + 1)/(N+ + 2), misses as 1/(N- + 2). Without
    # it a method that was right on every training game gets a confidence of 1.0, which no
    # finite sample supports.
    pos = sum(1 for *_, hit in rows if hit)
    neg = len(rows) - pos
    y = np.array([(pos + 1) / (pos + 2) if hit else 1 / (neg + 2) for *_, hit in rows])

    def loss(w: Any) -> tuple[float, Any]:
        z = x @ w
        p = 1.0 / (1.0 + np.exp(-z))
        eps = 1e-12
        nll = -np.sum(y * np.log(p + eps) + (1 - y) * np.log(1 - p + eps)) / len(y)
        grad = x.T @ (p - y) / len(y)
        reg = l2 * np.sum(w[:2] ** 2)
        grad_reg = np.concatenate([2 * l2 * w[:2], [0.0]])
        return float(nll + reg), grad + grad_reg

    res = minimize(loss, np.zeros(3), jac=True, method="L-BFGS-B")
    return [float(v) for v in res.x]
