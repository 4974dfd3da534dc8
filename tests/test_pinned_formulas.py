"""Every interval the project prints, pinned against an independent computation: scipy's
quantiles and binomial intervals, or a case worked by hand in this file — never the function
under test. Deterministic forward models (a boolean function of the kept steps) make the
estimators' exact answers known.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np
import pytest
from attribution_helpers import Rule
from scipy import stats
from scipy.stats import binomtest

from engine.attribution import ForwardRequest
from engine.attribution.base import Player
from engine.attribution.contrastive import (
    _runs_for_half_width,
    adaptive_schedule,
    contrastive,
    z_value,
)
from engine.attribution.contrastive import (
    wilson as attr_wilson,
)
from engine.attribution.shapley import RARE_PAIRS, _difference_ci, _values, rare_interval, shapley
from engine.detect import calibration
from engine.detect.evaluate import Game, Truth, _accuracy, _reliability, summarize
from engine.detect.stats import auroc, newcombe, wilson, z_for


def scipy_wilson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    ci = binomtest(k, n).proportion_ci(confidence_level=level, method="wilson")
    return (ci.low, ci.high)


def newcombe_by_hand(x1: int, n1: int, x2: int, n2: int, level: float) -> tuple[float, float]:
    """Newcombe (1998) method 10, from scipy's Wilson ends."""
    p1, p2 = x1 / n1, x2 / n2
    l1, u1 = scipy_wilson(x1, n1, level)
    l2, u2 = scipy_wilson(x2, n2, level)
    d = p1 - p2
    return (
        d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2),
        d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2),
    )


# ------------------------------------------------------------------ Wilson and friends

CASES = [(0, 10), (1, 10), (5, 10), (9, 10), (10, 10), (3, 47), (0, 1), (1, 1), (17, 200)]


@pytest.mark.parametrize("k,n", CASES)
@pytest.mark.parametrize("level", [0.9, 0.95, 0.99])
def test_detector_wilson_matches_scipy(k: int, n: int, level: float) -> None:
    """detect.stats.wilson equals scipy's Wilson interval at every count and level."""
    assert wilson(k, n, level) == pytest.approx(scipy_wilson(k, n, level), abs=1e-12)


@pytest.mark.parametrize("k,n", CASES)
@pytest.mark.parametrize("alpha", [0.1, 0.05, 0.0125])
def test_attribution_wilson_matches_scipy(k: int, n: int, alpha: float) -> None:
    """The estimators' Wilson interval equals scipy's; at 0 bad its low end is exactly 0 and
    at all bad its high end exactly 1."""
    lo, hi = attr_wilson(k, n, alpha)
    assert (lo, hi) == pytest.approx(scipy_wilson(k, n, 1 - alpha), abs=1e-12)
    assert (lo == 0.0) == (k == 0)
    assert (hi == 1.0) == (k == n)


def test_wilson_hand_worked_case() -> None:
    """3 of 10 at 95%: centre (0.3 + z^2/20) / (1 + z^2/10), worked out with z = 1.959964."""
    z = 1.959963984540054
    centre = (0.3 + z * z / 20) / (1 + z * z / 10)
    half = z * math.sqrt(0.3 * 0.7 / 10 + z * z / 400) / (1 + z * z / 10)
    assert wilson(3, 10) == pytest.approx((centre - half, centre + half), abs=1e-12)
    assert wilson(3, 10) == pytest.approx((0.10779126740630201, 0.6032218525388546), abs=1e-12)
    assert wilson(0, 0) == (0.0, 1.0)
    # all of 9: the closed form's upper end rounds to 1.0000000000000002; it is clipped to 1
    assert wilson(9, 9)[1] == 1.0 and attr_wilson(9, 9, 0.05)[1] == 1.0
    assert newcombe(8, 10, 2, 10) == newcombe(8, 10, 2, 10, 0.95)
    assert newcombe(8, 10, 2, 10) == pytest.approx(newcombe_by_hand(8, 10, 2, 10, 0.95), abs=1e-12)
    assert attr_wilson(0, 0, 0.05) == (0.0, 1.0)


def test_quantiles_match_scipy() -> None:
    """Both normal quantiles are scipy's two-sided ones (1.959964 at 95%)."""
    for level in (0.8, 0.9, 0.95, 0.99):
        assert z_for(level) == pytest.approx(stats.norm.ppf(0.5 + level / 2), abs=1e-9)
        assert z_value(1 - level) == pytest.approx(stats.norm.ppf(0.5 + level / 2), abs=1e-12)


@pytest.mark.parametrize(
    "x1,n1,x2,n2", [(8, 10, 2, 10), (0, 12, 5, 12), (30, 30, 0, 30), (7, 25, 9, 40), (3, 5, 3, 5)]
)
def test_newcombe_matches_hand_computation(x1: int, n1: int, x2: int, n2: int) -> None:
    """Newcombe's difference interval equals method 10 built from scipy's Wilson ends."""
    assert newcombe(x1, n1, x2, n2, 0.95) == pytest.approx(
        newcombe_by_hand(x1, n1, x2, n2, 0.95), abs=1e-12
    )
    assert newcombe(x1, n1, x2, n2, 0.9) == pytest.approx(
        newcombe_by_hand(x1, n1, x2, n2, 0.9), abs=1e-12
    )


def test_auroc_matches_mann_whitney() -> None:
    """AUROC with ties counted half is the Mann-Whitney U of the positives over n+ n-."""
    pos = [0.9, 0.4, 0.4, 0.7, 0.1]
    neg = [0.4, 0.2, 0.3, 0.8, 0.1, 0.0]
    u = stats.mannwhitneyu(pos, neg, alternative="two-sided").statistic
    assert auroc(pos, neg) == pytest.approx(u / (len(pos) * len(neg)), abs=1e-12)
    # by hand: one positive tied with one negative, nothing else
    assert auroc([0.5], [0.5]) == 0.5
    assert auroc([0.6, 0.5], [0.5]) == 0.75
    assert auroc([0.4], [0.5, 0.3]) == 0.5
    assert auroc([], [0.1]) is None
    assert auroc([0.1], []) is None


def test_detector_accuracy_interval_and_brier() -> None:
    """`car detect-eval`'s accuracy: hits/n with scipy's Wilson 95% interval, rounded to 4
    places; the Brier score and the reliability table from a hand-worked set of games."""
    assert _accuracy(7, 20) == {
        "n": 20,
        "hits": 7,
        "accuracy": 0.35,
        "ci95": [round(v, 4) for v in scipy_wilson(7, 20)],
    }
    agents = ["a", "b", "c", "d"]
    rows = [
        ("a", "a", 0.9, {"a": 0.9, "b": 0.1}),
        ("b", "a", 0.3, {"a": 0.7, "b": 0.2}),
        ("c", "c", 0.5, {"c": 0.6, "d": 0.6}),
        ("d", "a", 1.0, {"a": 1.0, "d": 0.0}),
    ]
    games = [
        Game(
            run_id=str(i),
            agents=agents,
            truth=Truth(mole, "FALSE_INFO" if i % 2 else "SLOW_DOWN"),
            results={
                "m": {
                    "suggested_mole": s,
                    "confidence": c,
                    "suspicion_scores": sc,
                    "methods_run": ["rules"],
                    "forward_runs": 3 * i,
                }
            },
            seconds={"m": 0.5},
        )
        for i, (mole, s, c, sc) in enumerate(rows)
    ]
    out = summarize(games, "m")
    assert (out["hits"], out["n"], out["accuracy"]) == (2, 4, 0.5)
    assert out["ci95"] == [round(v, 4) for v in scipy_wilson(2, 4)]
    # Brier: (0.9-1)^2 + (0.3-0)^2 + (0.5-1)^2 + (1-0)^2 = 0.01 + 0.09 + 0.25 + 1 = 1.35
    assert out["brier"] == round(1.35 / 4, 4)
    assert out["random_baseline"] == 0.25
    assert out["forward_runs_per_game"] == 4.5
    # positives: 0.9, 0.2, 0.6, 0.0; negatives: 0.1, 0.7, 0.6, 1.0 -> U counted by hand
    # 0.9 beats 0.1, 0.7, 0.6 (3); 0.2 beats 0.1 (1); 0.6 beats 0.1, ties 0.6 (1.5); 0.0: 0
    assert out["auroc"] == round(5.5 / 16, 4)
    assert out["confusion"] == {"a": {"a": 1}, "b": {"a": 1}, "c": {"c": 1}, "d": {"a": 1}}
    assert out["per_strategy"]["SLOW_DOWN"]["hits"] == 2
    assert out["per_strategy"]["FALSE_INFO"]["hits"] == 0
    bins = _reliability(
        [0.9, 0.3, 0.5, 1.0, 0.2, 0.0, 0.4], [True, False, True, False, True, False, False]
    )
    assert [b["games"] for b in bins] == [1, 2, 2, 0, 2]  # 0.2 and 0.4 open the next bin
    assert bins[4]["mean_confidence"] == 0.95 and bins[4]["accuracy"] == 0.5
    assert bins[1]["accuracy"] == 0.5 and bins[3]["accuracy"] is None


def test_calibration_formula() -> None:
    """The calibrated confidence is sigmoid(a*margin + b*log(n-1) + c) with the shipped
    parameters; without parameters it is 1/n + margin*(1 - 1/n), the margin clipped to [0,1]."""
    a, b, c = (float(x) for x in calibration.shipped()["rules"]["params"])
    for margin, n in [(0.0, 6), (0.3, 4), (1.0, 8), (0.55, 2)]:
        z = a * margin + b * math.log(max(n - 1, 1)) + c
        got, calibrated = calibration.confidence("rules", margin, n)
        assert calibrated
        assert got == pytest.approx(1 / (1 + math.exp(-z)), abs=1e-12)
    assert calibration.confidence("nobody", 0.5, 4) == (0.25 + 0.5 * 0.75, False)
    assert calibration.confidence("nobody", 1.5, 5) == (1.0, False)
    assert calibration.confidence("nobody", -0.5, 5) == (0.2, False)
    assert calibration._sigmoid(-800.0) == pytest.approx(0.0) and calibration._sigmoid(800.0) == 1.0
    assert calibration._sigmoid(-2.0) == pytest.approx(1 / (1 + math.e**2), abs=1e-15)
    assert calibration.key_for("llm", "m1") == "llm@m1"
    assert calibration.key_for("rules+llm", "m1") == "rules+llm@m1"
    assert calibration.key_for("rules", "m1") == "rules"
    assert calibration.key_for("llm", None) == "llm"


def test_calibration_fit_recovers_a_known_logistic() -> None:
    """fit() on rows drawn from a known logistic law (seed printed) recovers its slope sign
    and puts the predicted probability at margin 0.8 near the law's."""
    seed = 20261201
    print("seed", seed)
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(3000):
        m, n = float(rng.random()), int(rng.choice([4, 6, 8]))
        p = 1 / (1 + math.exp(-(4.0 * m - 0.5 * math.log(n - 1) - 0.5)))
        rows.append((m, n, bool(rng.random() < p)))
    a, b, c = calibration.fit(rows)
    assert 3.0 < a < 5.0
    assert -1.5 < b < 0.5
    pred = 1 / (1 + math.exp(-(a * 0.8 + b * math.log(5) + c)))
    true = 1 / (1 + math.exp(-(4.0 * 0.8 - 0.5 * math.log(5) - 0.5)))
    assert abs(pred - true) < 0.05


# ------------------------------------------------------------------ deterministic forward models


class BoolModel(Rule):
    """A forward model whose outcome is a fixed boolean function of the kept steps (no noise):
    the exact v(S) of every coalition is known, so are the exact Shapley values."""

    def __init__(
        self, n: int, bad: Callable[[frozenset[int]], bool], agents: Sequence[str] | None = None
    ) -> None:
        super().__init__(n, bad, list(agents) if agents else [f"a{i}" for i in range(n)])

    @property
    def step_labels(self) -> Sequence[str]:
        return [f"step {i}" for i in range(self.n)]


class CoinModel(BoolModel):
    """Bad with a probability that depends on the kept steps, drawn from the branch seed."""

    def __init__(self, n: int, p: Callable[[frozenset[int]], float]) -> None:
        super().__init__(n, lambda keep: False)
        self.p = p

    def run_batch(self, requests: Sequence[ForwardRequest]) -> list[bool]:
        self.requests.extend(requests)
        return [
            bool(np.random.default_rng([r.branch_seed, len(r.keep)]).random() < self.p(r.keep))
            for r in requests
        ]


def exact_shapley(n: int, v: Callable[[frozenset[int]], float]) -> list[float]:
    """Shapley values by enumerating every order (small n only)."""
    phi = [0.0] * n
    orders = list(itertools.permutations(range(n)))
    for order in orders:
        s: set[int] = set()
        for i in order:
            before = v(frozenset(s))
            s.add(i)
            phi[i] += v(frozenset(s)) - before
    return [x / len(orders) for x in phi]


def test_shapley_exact_on_a_symmetric_and() -> None:
    """Bad iff steps 0 and 1 are both kept: every antithetic pair credits each step 1/2 exactly,
    so phi = (0.5, 0.5, 0) with zero spread; efficiency v(all) = 1, v(none) = 0."""
    model = BoolModel(3, lambda keep: {0, 1} <= keep)
    res = shapley(model, rng=np.random.default_rng(1), permutations=80, efficiency_runs=10)
    assert [v.phi for v in res.values] == [0.5, 0.5, 0.0]
    assert [v.sd for v in res.values] == [0.0, 0.0, 0.0]
    assert res.values[0].ci == (0.5, 0.5) and res.values[1].ci == (0.5, 0.5)
    # step 2 never matters: every pair is zero, so the rare-event bound widens [0, 0]
    lo, hi = res.values[2].ci
    assert lo < 0 < hi
    assert (lo, hi) == pytest.approx(rare_by_hand(np.zeros(40), 0.05), abs=1e-12)
    eff = res.efficiency
    assert (eff.sum_phi, eff.v_all, eff.v_none, eff.difference) == (1.0, 1.0, 0.0, 1.0)
    assert eff.runs == 20
    assert eff.difference_ci == pytest.approx(newcombe_by_hand(10, 10, 0, 10, 0.95), abs=1e-12)
    assert res.permutations == 80 and not res.partial
    assert res.forward_runs == 40 * 2 * 4 + 20 == len(model.requests)


def test_shapley_covers_the_exact_values_over_many_seeds() -> None:
    """bad = step 0 kept, or steps 1 and 2 both kept: exact phi = (2/3, 1/6, 1/6) by
    enumeration. Over 200 seeds (0..199) of 200 permutations each, each player's 95% interval
    covers its exact value in at least 90% of the runs, the estimates centre on it, and the
    phi always sum to v(all) - v(none) = 1 (by construction of the chains)."""
    f = lambda keep: 0 in keep or {1, 2} <= keep  # noqa: E731
    exact = exact_shapley(3, lambda s: float(f(s)))
    assert exact == pytest.approx([2 / 3, 1 / 6, 1 / 6])
    seeds = range(200)
    covered = np.zeros(3)
    phis = np.zeros((len(seeds), 3))
    for seed in seeds:
        res = shapley(
            BoolModel(3, f), rng=np.random.default_rng(seed), permutations=200, efficiency_runs=8
        )
        for i, (v, want) in enumerate(zip(res.values, exact, strict=True)):
            phis[seed, i] = v.phi
            if v.ci[0] <= want <= v.ci[1]:
                covered[i] += 1
            else:
                print("seed", seed, "player", i, "missed", v.phi, v.ci)
        assert sum(v.phi for v in res.values) == pytest.approx(1.0), seed
    print("coverage", covered / len(seeds))
    assert (covered / len(seeds) >= 0.9).all()
    assert np.abs(phis.mean(axis=0) - exact).max() < 0.01


@pytest.mark.parametrize("pairs", [2, 3, 4, 6, 40])
def test_shapley_t_interval_degrees_of_freedom(pairs: int) -> None:
    """phi +- t(pairs - 1) * sd / sqrt(pairs), with scipy's t quantile and ddof-1 spread, for
    a column with enough non-zero pairs that the rare bound does not apply."""
    rng = np.random.default_rng(pairs)
    column = rng.choice([-0.5, 0.5, 1.0], size=(max(pairs, RARE_PAIRS), 1))[:pairs]
    if pairs < RARE_PAIRS:
        column = np.vstack([column, np.full((RARE_PAIRS - pairs, 1), 0.5)])
    n = len(column)
    (v,) = _values([Player("p", (0,))], column, 0.95)
    mean = float(column.mean())
    sd = float(np.std(column, ddof=1))
    half = stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)
    assert v.phi == pytest.approx(mean, abs=1e-12)
    assert v.sd == pytest.approx(sd, abs=1e-12)
    assert v.ci == pytest.approx((max(-1, mean - half), min(1, mean + half)), abs=1e-12)


def test_shapley_small_sample_t_interval() -> None:
    """With 3 pairs (df = 2) and every marginal non-zero but fewer than RARE_PAIRS, the interval
    is the wider of the t interval (t_2 = 4.303) and the rare-event bound; a single pair gives
    the whole range."""
    column = np.array([[0.5], [1.0], [0.5]])
    (v,) = _values([Player("p", (0,))], column, 0.95)
    t_half = 4.302652729911275 * float(np.std(column, ddof=1)) / math.sqrt(3)
    rare = rare_by_hand(column[:, 0], 0.05)
    assert v.ci == pytest.approx(
        (max(-1.0, min(2 / 3 - t_half, rare[0])), min(1.0, max(2 / 3 + t_half, rare[1]))), abs=1e-12
    )
    (one,) = _values([Player("p", (0,))], np.array([[0.5]]), 0.95)
    assert (one.phi, one.ci, one.sd) == (0.5, (-1.0, 1.0), None)


def rare_by_hand(column: np.ndarray, alpha: float) -> tuple[float, float]:
    """The rare-event bound written out: Wilson (by hand, with scipy's z) of the positive and
    the negative parts' means, combined as Newcombe's hybrid interval."""
    n = len(column)
    z = stats.norm.ppf(1 - alpha / 2)

    def w(x: float) -> tuple[float, float]:
        p = x / n
        c = (p + z * z / (2 * n)) / (1 + z * z / n)
        h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
        return (0.0 if x == 0 else c - h, 1.0 if x == n else c + h)

    pos, neg = float(np.clip(column, 0, 1).sum()), float(np.clip(-column, 0, 1).sum())
    (l1, u1), (l0, u0) = w(pos), w(neg)
    p1, p0 = pos / n, neg / n
    return (p1 - p0 - math.hypot(p1 - l1, u0 - p0), p1 - p0 + math.hypot(u1 - p1, p0 - l0))


@pytest.mark.parametrize(
    "column",
    [
        np.zeros(50),
        np.array([1.0] + [0.0] * 49),
        np.array([-1.0, 0.5] + [0.0] * 38),
        np.array([0.5] * 3 + [0.0] * 7),
    ],
)
def test_rare_interval_matches_hand_computation(column: np.ndarray) -> None:
    """The rare-event bound equals the hand computation, and contains the mean."""
    got = rare_interval(column, 0.05)
    assert got == pytest.approx(rare_by_hand(column, 0.05), abs=1e-12)
    assert got[0] < float(column.mean()) < got[1]


@pytest.mark.parametrize(
    "p1,p0,n", [(1.0, 0.0, 10), (0.6, 0.2, 50), (0.25, 0.25, 8), (0.0, 1.0, 20)]
)
def test_efficiency_difference_interval(p1: float, p0: float, n: int) -> None:
    """The efficiency check's interval for v(all) - v(none) is Newcombe's method 10 from
    scipy's Wilson ends, clipped to [-1, 1]."""
    lo, hi = newcombe_by_hand(round(p1 * n), n, round(p0 * n), n, 0.95)
    assert _difference_ci(p1, p0, n, 0.05) == pytest.approx((max(-1, lo), min(1, hi)), abs=1e-12)


# ------------------------------------------------------------------ the contrastive estimator


def test_contrastive_fixed_effects_are_shifted_wilson() -> None:
    """FIXED mode on a model bad iff step 1 is kept: re-deciding step 1 or 0 always rescues
    (effect -1, interval scipy's Wilson of 0/k shifted by -1), step 2 never does (effect 0,
    interval reaching 0). The locus is step 1: the last step whose interval excludes zero."""
    k = 25
    model = BoolModel(3, lambda keep: 1 in keep)
    res = contrastive(model, rng=np.random.default_rng(3), mode="fixed", k=k, all_steps=True)
    lo0, hi0 = scipy_wilson(0, k)
    lok, hik = scipy_wilson(k, k)
    by = {s.step: s for s in res.steps}
    assert by[2].effect == 0.0 and by[2].ci == pytest.approx((lok - 1, hik - 1), abs=1e-12)
    assert by[2].ci[1] == 0.0 and not by[2].excludes_zero
    for s in (0, 1):
        assert by[s].effect == -1.0
        assert by[s].ci == pytest.approx((lo0 - 1, hi0 - 1), abs=1e-12)
        assert by[s].excludes_zero and by[s].n == k and by[s].level == pytest.approx(0.95)
    assert res.locus == 1
    assert res.forward_runs == 3 * k == len(model.requests)
    keeps = [r.keep for r in model.requests]
    assert keeps == [frozenset({0, 1})] * k + [frozenset({0})] * k + [frozenset()] * k
    # common random numbers: run i of every step shares its branch seed
    seeds = [r.branch_seed for r in model.requests]
    assert seeds[:k] == seeds[k : 2 * k] == seeds[2 * k :]
    assert len(set(seeds[:k])) == k


def test_contrastive_stops_at_the_locus_without_all_steps() -> None:
    """Scanning backwards, the scan stops at the first step whose interval excludes zero."""
    model = BoolModel(4, lambda keep: 2 in keep)
    res = contrastive(model, rng=np.random.default_rng(0), mode="fixed", k=10)
    assert [s.step for s in res.steps] == [2, 3]
    assert res.locus == 2 and not res.all_steps
    assert res.forward_runs == 20


def test_contrastive_noisy_effect_interval() -> None:
    """With a noisy rescue (bad with p = 0.4 when step 1 is re-decided), each step's effect is
    bad/k - 1 and its interval scipy's Wilson of bad/k shifted by -1."""
    model = CoinModel(2, lambda keep: 1.0 if 1 in keep else 0.4)
    res = contrastive(
        model, rng=np.random.default_rng(5), mode="fixed", k=60, all_steps=True, crn=False
    )
    for s in res.steps:
        runs = [r for r in model.requests if r.keep == frozenset(range(s.step))]
        bad = sum(model.run_batch(runs))
        assert s.effect == pytest.approx(bad / 60 - 1)
        lo, hi = scipy_wilson(bad, 60)
        assert s.ci == pytest.approx((lo - 1, hi - 1), abs=1e-12)
        assert s.excludes_zero == (hi < 1)
    seeds0 = [r.branch_seed for r in model.requests if r.keep == frozenset()]
    seeds1 = [r.branch_seed for r in model.requests if r.keep == frozenset({0})]
    assert not set(seeds0) & set(seeds1)  # without CRN every step draws its own seeds


def test_adaptive_schedule_alphas_and_sizes() -> None:
    """The looks' alphas add up to 1 - confidence; sizes are those where scipy's Wilson
    half-width first reaches the target (all bad for the settle look, half bad for refine)."""
    looks = adaptive_schedule(0.95, 0.05, 16, 100_000)
    assert sum(look.alpha for look in looks) == pytest.approx(0.05)
    assert [look.alpha for look in looks] == pytest.approx([0.0025, 0.0075, 0.04])
    assert looks[0].n == 16

    def half(bad: int, n: int, level: float) -> float:
        lo, hi = scipy_wilson(bad, n, level)
        return (hi - lo) / 2

    settle, refine = looks[1].n, looks[2].n
    assert half(settle, settle, 1 - 0.0075) <= 0.05 < half(settle - 1, settle - 1, 1 - 0.0075)
    assert half(refine // 2, refine, 0.96) <= 0.05 < half((refine - 1) // 2, refine - 1, 0.96)
    assert _runs_for_half_width(0.5, 0.05, worst_case=True) == 1
    capped = adaptive_schedule(0.95, 0.05, 16, 50)
    assert [look.n for look in capped] == [16, 50] and capped[-1].alpha == pytest.approx(0.0475)
