"""`car attribute --settle N`: scan until the locus is settled against the later steps.

Each scan runs at 1/N of the error rate, so that the answer holds at 95% whichever scan it
comes from (union bound); a later scan draws forward runs of its own, independent of the data
its target was chosen on, at the --half-width (or -K) the scan before suggested."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import pytest
from scipy.stats import binom

from engine.attribution import ForwardRequest
from engine.attribution.contrastive import (
    MAX_SETTLE_ROUNDS,
    ContrastiveMode,
    Settling,
    contrastive,
    locus_settling,
    settle_contrastive,
)
from engine.attribution.pcg import SeedStream
from engine.attribution.report import scan_seed
from engine.commands.counterfactual import MAX_SETTLE
from engine.errors import ConfigError
from engine.journal import Journal
from tests.test_attribute_cli import failed_heist

ROOT = Path(__file__).resolve().parent.parent


class Weak:
    """Re-deciding step 3 rescues the run 1 time in 20 (the branch seed decides); no other
    step ever does: exact effects 0, 0, 0, -0.05, 0, 0 and the locus 3. It keeps the branch
    seeds it was asked for, batch by batch."""

    n_steps = 6
    step_agents: ClassVar[list[str | None]] = [None] * 6
    step_labels: ClassVar[list[str]] = [str(i) for i in range(6)]
    exact = (0.0, 0.0, 0.0, -0.05, 0.0, 0.0)

    def __init__(self) -> None:
        self.seeds: list[int] = []

    def run_batch(self, requests: Sequence[ForwardRequest]) -> list[bool]:
        self.seeds.extend(r.branch_seed for r in requests)
        return [not (len(r.keep) == 3 and r.branch_seed % 20 == 0) for r in requests]


def streams(seed: int):  # type: ignore[no-untyped-def]
    return lambda i: SeedStream(seed if i == 0 else scan_seed(seed, i))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("mode", ["adaptive", "fixed"])
def test_each_scan_is_the_one_its_predecessor_asked_for(seed: int, mode: str) -> None:
    """Scan i is exactly `contrastive` at confidence 1 - 0.05/N with scan i's seeds and the
    target the scan before suggested; the scans stop at the first settled one (or at N); the
    forward runs add up."""
    rounds = 4
    model = Weak()
    res, scans = settle_contrastive(
        model, streams(seed), rounds=rounds, mode=mode, k=40, target_half_width=0.1
    )
    each = 1 - 0.05 / rounds
    assert math.isclose(res.confidence, each)
    target, k = 0.1, 40
    for i, scan in enumerate(scans):
        again = contrastive(Weak(), rng=streams(seed)(i), mode=mode, k=k, confidence=each,
                            target_half_width=target)  # fmt: skip
        settling = locus_settling(again)
        assert scan.forward_runs == again.forward_runs and scan.locus == again.locus
        assert scan.settled == (None if settling is None else settling.settled)
        if mode == ContrastiveMode.FIXED.value:
            assert scan.runs_per_step == k and scan.half_width is None
        else:
            assert scan.half_width == target and scan.runs_per_step is None
        last = i == len(scans) - 1
        assert last == (settling is None or settling.settled or settling.runs_per_step is None
                        or i == rounds - 1)  # fmt: skip
        if not last:
            assert settling is not None
            k = settling.runs_per_step or k
            target = settling.half_width or target
    assert sum(s.forward_runs for s in scans) == len(model.seeds)


def test_a_later_scan_draws_forward_runs_of_its_own() -> None:
    """No branch seed of a later scan is one of an earlier scan's (they were chosen on them)."""
    model = Weak()
    _, scans = settle_contrastive(model, streams(3), rounds=3, target_half_width=0.1)
    assert len(scans) >= 2
    first = set(model.seeds[: scans[0].forward_runs])
    later = set(model.seeds[scans[0].forward_runs :])
    assert first and later and not (first & later)


def test_one_round_is_the_plain_scan() -> None:
    """--settle 1 is today's attribution: the same runs, intervals and locus at 95%."""
    for seed in range(3):
        res, scans = settle_contrastive(Weak(), streams(seed), rounds=1, target_half_width=0.1)
        plain = contrastive(Weak(), rng=SeedStream(seed), target_half_width=0.1)
        assert res == plain and len(scans) == 1


def test_settling_holds_its_level_and_settles_over_seeds() -> None:
    """Over 200 seeds of the model: with 3 scans, the reported intervals all cover the exact
    effects in at least 95% of the attributions (binomial, one-sided 1%); and the locus is
    settled in most of them (one default scan settles none: 29 rescue-free runs cannot
    exclude an effect of -0.05)."""
    seeds = 200
    missed = settled = plain_settled = right = 0
    for seed in range(seeds):
        model = Weak()
        res, scans = settle_contrastive(model, streams(seed), rounds=3, target_half_width=0.1)
        missed += any(not e.ci[0] <= Weak.exact[e.step] <= e.ci[1] for e in res.steps)
        settled += bool(scans[-1].settled)
        right += res.locus == 3
        plain = locus_settling(contrastive(Weak(), rng=SeedStream(seed), target_half_width=0.1))
        plain_settled += bool(plain and plain.settled)
    assert binom.sf(missed - 1, seeds, 0.05) > 0.01, missed  # P(X >= missed) at 5%
    assert plain_settled == 0
    assert settled >= seeds // 2, settled
    assert right >= seeds // 2, right


def test_bad_round_counts_are_refused() -> None:
    for rounds in (0, MAX_SETTLE_ROUNDS + 1):
        with pytest.raises(ConfigError, match="rounds must lie within"):
            settle_contrastive(Weak(), streams(0), rounds=rounds)
    assert MAX_SETTLE == MAX_SETTLE_ROUNDS  # the CLI's bound is the engine's


def test_cli_settles_a_real_heist_and_says_how(tmp_path: Path) -> None:
    """`car attribute RUN --settle 3` on the seed-7 heist: --json carries every scan, the
    forward runs of all of them and the level of each; the text says how settling ended; a
    re-run with the same seed adds no branch."""
    jp = tmp_path / "j.db"
    with Journal(jp) as j:
        run = failed_heist(j)
    base = [sys.executable, "-m", "cli", "--journal", str(jp), "attribute", run, "--seed", "1",
            "-c", "2", "--settle", "3"]  # fmt: skip
    res = subprocess.run([*base, "--json"], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    settle = data["settle"]
    assert settle["rounds"] == 3 and math.isclose(settle["confidence_each"], 1 - 0.05 / 3)
    assert 1 <= len(settle["scans"]) <= 3
    assert data["forward_runs"] == sum(s["forward_runs"] for s in settle["scans"])
    assert data["branches_added"] == data["forward_runs"]
    assert data["locus_settled"] == settle["scans"][-1]["settled"]
    assert settle["scans"][0]["half_width"] == 0.1
    text = subprocess.run(base, capture_output=True, text=True, cwd=ROOT)
    assert text.returncode == 0, text.stderr
    line = next(ln for ln in text.stdout.splitlines() if ln.startswith("settling:"))
    assert f"after {len(settle['scans'])} scan" in line and "98.33%, 95% in all" in line
    assert ("settled after" in line) == bool(data["locus_settled"])
    assert "0 new branches" in text.stdout  # the same seed: every forward run read back


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--settle", "2", "--method", "shapley"], "applies to --method contrastive only"),
        (["--settle", "9"], "'--settle': Input should be less than or equal to 8"),
        (["--settle", "0"], "'--settle': Input should be greater than or equal to 1"),
    ],
)
def test_cli_refuses_what_settling_cannot_do(
    tmp_path: Path, extra: list[str], message: str
) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "cli", "--journal", str(tmp_path / "j.db"), "attribute", "abc",
         *extra],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert res.returncode == 2 and message in res.stderr, res.stderr


def test_progress_counts_every_scan_on_from_the_last() -> None:
    """Progress rises over the scans as one count: in the fixed mode with every step, each
    scan's total is what came before plus its own; the last report is all forward runs."""
    calls: list[tuple[int, int | None]] = []
    model = Weak()
    res, scans = settle_contrastive(
        model, streams(2), rounds=3, mode="fixed", k=40, all_steps=True,
        progress=lambda done, total: calls.append((done, total)),
    )  # fmt: skip
    assert len(scans) == 3 and len(res.steps) == 6
    spent = sum(s.forward_runs for s in scans)
    assert calls[-1] == (spent, spent) == (len(model.seeds), len(model.seeds))
    assert [c[0] for c in calls] == sorted(c[0] for c in calls)
    before = 0
    for scan in scans:
        assert (before + scan.forward_runs, before + 6 * scan.runs_per_step) in calls  # type: ignore[operator]
        before += scan.forward_runs
    calls.clear()
    settle_contrastive(Weak(), streams(1), rounds=2, target_half_width=0.1,
                       progress=lambda done, total: calls.append((done, total)))  # fmt: skip
    assert calls and all(total is None for _, total in calls)


def test_defaults_are_the_scans_own() -> None:
    """Without a target, -K or a level, a settling attribution of one scan is `contrastive`'s
    own default scan, adaptive and fixed (k 100); every step with `all_steps`."""
    for mode in ("adaptive", "fixed"):
        res, _ = settle_contrastive(Weak(), streams(2), rounds=1, mode=mode)
        assert res == contrastive(Weak(), rng=SeedStream(2), mode=mode)
    res, _ = settle_contrastive(Weak(), streams(2), rounds=1, mode="fixed", all_steps=True)
    assert [s.n for s in res.steps] == [100] * 6


def test_levels_and_round_counts_at_their_bounds() -> None:
    """A level out of (0, 1) is refused; another level is split as 0.95 is; N = 8 is taken."""
    for confidence in (0.0, 1.0, 1.5):
        with pytest.raises(ConfigError, match="confidence must lie strictly between 0 and 1"):
            settle_contrastive(Weak(), streams(0), rounds=2, confidence=confidence)
    res, _ = settle_contrastive(Weak(), streams(0), rounds=4, confidence=0.9,
                                target_half_width=0.1)  # fmt: skip
    assert math.isclose(res.confidence, 1 - 0.1 / 4)
    res, _ = settle_contrastive(Weak(), streams(0), rounds=MAX_SETTLE_ROUNDS,
                                target_half_width=0.1)  # fmt: skip
    assert math.isclose(res.confidence, 1 - 0.05 / MAX_SETTLE_ROUNDS)


def test_a_suggestion_out_of_reach_ends_the_scans(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unsettled locus with no budget within reach (the suggestion is None): no further
    scan, whatever N allows."""
    import importlib

    module = importlib.import_module("engine.attribution.contrastive")
    monkeypatch.setattr(
        module, "locus_settling",
        lambda result: Settling(settled=False, not_excluded=(4,)),
    )  # fmt: skip
    for mode in ("adaptive", "fixed"):
        model = Weak()
        _, scans = settle_contrastive(model, streams(0), rounds=4, mode=mode, k=40)
        assert len(scans) == 1 and scans[0].settled is False
