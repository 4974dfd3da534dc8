"""The calibration of `confidence`: the fit pinned against the penalised logistic objective
written out here and minimised by scipy without the fit's own gradient; the features, the
sigmoid's two branches and the uncalibrated fallback at their edges."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.optimize import minimize

from engine.detect import calibration


def objective_by_hand(w: np.ndarray, rows: list[tuple[float, int, bool]], l2: float) -> float:
    """Mean cross-entropy against Platt's smoothed targets plus l2 x (a^2 + b^2), written out."""
    pos = sum(1 for *_, hit in rows if hit)
    neg = len(rows) - pos
    total = 0.0
    for margin, n, hit in rows:
        y = (pos + 1) / (pos + 2) if hit else 1 / (neg + 2)
        z = w[0] * margin + w[1] * math.log(max(n - 1, 1)) + w[2]
        p = 1 / (1 + math.exp(-z))
        total -= y * math.log(p) + (1 - y) * math.log(1 - p)
    return total / len(rows) + l2 * (w[0] ** 2 + w[1] ** 2)


def rows_from(seed: int, size: int) -> list[tuple[float, int, bool]]:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(size):
        m, n = float(rng.random()), int(rng.choice([3, 6, 8]))
        p = 1 / (1 + math.exp(-(3.0 * m - 0.4 * math.log(n - 1))))
        rows.append((m, n, bool(rng.random() < p)))
    return rows


@pytest.mark.parametrize(("seed", "size"), [(1, 20), (5, 20), (2, 300)])
def test_fit_minimises_the_penalised_objective(seed: int, size: int) -> None:
    """fit() returns the minimiser of the objective written out above (Platt's targets, the
    slopes penalised by l2 = 1e-3 by default, the intercept not), as scipy's Nelder-Mead
    finds it without any gradient; a stronger penalty gives other parameters. Small sets of
    games make the smoothed targets (1 / (misses + 2)) matter."""
    print("seed", seed, "games", size)
    rows = rows_from(seed, size)
    got = calibration.fit(rows)
    ref = minimize(
        objective_by_hand, np.zeros(3), args=(rows, 1e-3), method="Nelder-Mead",
        options={"xatol": 1e-9, "fatol": 1e-13, "maxiter": 20_000},
    )  # fmt: skip
    assert got == pytest.approx(list(ref.x), abs=1e-3)
    strong = calibration.fit(rows, l2=0.5)
    assert abs(strong[0]) < abs(got[0]) - 0.1  # the penalty shrinks the slope
    ref_strong = minimize(
        objective_by_hand, np.zeros(3), args=(rows, 0.5), method="Nelder-Mead",
        options={"xatol": 1e-9, "fatol": 1e-13, "maxiter": 20_000},
    )  # fmt: skip
    assert strong == pytest.approx(list(ref_strong.x), abs=1e-3)


def test_fit_on_all_hits_stays_below_one() -> None:
    """A method right on every training game gets a confidence below 1 (Platt's smoothing),
    near (N + 1) / (N + 2) for its average game."""
    rows = [(0.2 + 0.01 * i, 6, True) for i in range(40)]
    a, b, c = calibration.fit(rows)
    p = 1 / (1 + math.exp(-(a * 0.4 + b * math.log(5) + c)))
    assert p < 1.0 and p == pytest.approx(41 / 42, abs=0.01)


def test_fit_refuses_no_games() -> None:
    """No rows: a ValueError saying so."""
    with pytest.raises(ValueError, match=r"^cannot fit a calibration on no games$"):
        calibration.fit([])


def test_features_and_sigmoid_edges() -> None:
    """The crew-size feature is log(n - 1), floored at log 1 = 0 for a crew of one; the
    sigmoid is exact on both sides of 0 and at 0."""
    assert calibration.features(0.3, 6) == (0.3, math.log(5))
    assert calibration.features(0.3, 3) == (0.3, math.log(2))
    assert calibration.features(0.3, 1) == (0.3, 0.0)
    assert calibration.features(0.3, 0) == (0.3, 0.0)
    assert calibration._sigmoid(0.0) == 0.5
    for z in (0.5, 3.0, -0.5, -3.0, 1e-3, -1e-3):
        assert calibration._sigmoid(z) == pytest.approx(1 / (1 + math.exp(-z)), rel=1e-15)


def test_uncalibrated_fallback_edges() -> None:
    """Without fitted parameters: 1/n + margin x (1 - 1/n), the margin clipped to [0, 1],
    a crew of zero treated as one."""
    assert calibration.confidence("nobody", 0.0, 4) == (0.25, False)
    assert calibration.confidence("nobody", 1.0, 4) == (1.0, False)
    assert calibration.confidence("nobody", 0.5, 0) == (1.0, False)
    assert calibration.confidence("nobody", 0.5, 2) == (0.75, False)


def test_parameters_are_looked_up_under_method_at_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """An LLM method's parameters are those shipped for method@model: parameters fitted for
    another model (or for the bare method name) are not used. The shipped file holds no LLM
    entry, so the table is replaced here by one that does."""
    table = {"llm": {"params": [0.0, 0.0, 5.0]}, "llm@m1": {"params": [0.0, 0.0, -5.0]}}
    monkeypatch.setattr(calibration, "shipped", lambda: table)
    low, calibrated = calibration.confidence("llm", 0.4, 6, "m1")
    assert calibrated and low == pytest.approx(1 / (1 + math.exp(5.0)), rel=1e-12)
    other, calibrated = calibration.confidence("llm", 0.4, 6, "m2")
    assert not calibrated and other == pytest.approx(1 / 6 + 0.4 * 5 / 6, rel=1e-12)
    high, calibrated = calibration.confidence("llm", 0.4, 6)
    assert calibrated and high == pytest.approx(1 / (1 + math.exp(-5.0)), rel=1e-12)


def test_llm_methods_are_calibrated_per_model() -> None:
    """An LLM method is looked up under its model: with a model the calibration never saw it
    is uncalibrated; the rules ignore the model."""
    assert calibration.confidence("llm", 0.4, 6, "never-seen-model")[1] is False
    assert calibration.confidence("rules", 0.4, 6, "never-seen-model")[1] is True
    assert calibration.confidence("rules", 0.4, 6, "never-seen-model") == (
        calibration.confidence("rules", 0.4, 6)
    )
