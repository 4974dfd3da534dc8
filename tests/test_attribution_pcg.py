"""The contrastive estimator's branch seeds come from a pure-Python copy of numpy's
`default_rng(seed).integers` (engine/attribution/pcg.py): it must draw exactly numpy's numbers,
call after call, or a re-run would not find the branches an earlier attribution made."""

from __future__ import annotations

import numpy as np
import pytest

from engine.attribution.contrastive import _SEED_BOUND
from engine.attribution.pcg import SeedStream, seed_sequence_state

SEEDS = [*range(64), 1000, 4242, 2**31 - 1, 2**32, 2**32 + 5, 2**63 + 9, 2**70 + 3, 10**30]


@pytest.mark.parametrize("seed", SEEDS)
def test_seed_sequence_state_is_numpys(seed: int) -> None:
    ref = np.random.SeedSequence(seed).generate_state(4, np.uint64)
    assert seed_sequence_state(seed, 4) == [int(x) for x in ref]


@pytest.mark.parametrize("seed", SEEDS)
def test_raw_outputs_are_pcg64s(seed: int) -> None:
    ref = np.random.default_rng(seed).bit_generator.random_raw(50)
    mine = SeedStream(seed)
    assert [mine.next_uint64() for _ in range(50)] == [int(x) for x in ref]


@pytest.mark.parametrize("seed", SEEDS)
def test_branch_seed_draws_are_numpys_call_after_call(seed: int) -> None:
    """The estimator's calls (a quick look, a settle look, a refine look, ...) in one stream."""
    ref = np.random.default_rng(seed)
    mine = SeedStream(seed)
    for size in (16, 13, 73, 0, 1, 102, 5):
        want = [int(x) for x in ref.integers(0, _SEED_BOUND, size=size)]
        assert mine.integers(0, _SEED_BOUND, size) == want


@pytest.mark.parametrize(
    ("low", "high"),
    [(0, 2**63 + 1), (0, 3 * 2**62), (5, 2**40 + 17), (-(2**40), 2**40), (0, 2**64 - 3)],
)
def test_other_wide_ranges_reject_as_numpy_does(low: int, high: int) -> None:
    """Ranges that are no power of two, where Lemire's method rejects draws (2**63 + 1:
    about half of them)."""
    for seed in range(20):
        want = np.random.default_rng(seed).integers(
            low, high, size=40, dtype=np.int64 if high <= 2**63 else np.uint64
        )
        assert SeedStream(seed).integers(low, high, 40) == [int(x) for x in want]


def test_what_it_does_not_draw_is_refused() -> None:
    with pytest.raises(ValueError, match="32 bits"):
        SeedStream(1).integers(0, 1000, 3)
    with pytest.raises(ValueError, match="non-negative"):
        SeedStream(-1)
