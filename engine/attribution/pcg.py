"""numpy's `default_rng(seed).integers(low, high)` stream in pure Python, for the branch
seeds of the contrastive estimator: the same seeds as `np.random.default_rng(seed)` draws
(so a re-run finds the branches an earlier attribution made), without importing numpy, which
costs a default `car attribute` 0.1 s of its serial start-up.

The generator is PCG64 (O'Neill's PCG XSL-RR 128/64) seeded through numpy's SeedSequence, and
a bounded draw is Lemire's multiply-and-reject on 64-bit outputs, as numpy does for a range
wider than 32 bits. tests/test_attribution_pcg.py compares the streams with numpy's."""

from __future__ import annotations

_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
_M128 = (1 << 128) - 1
# SeedSequence's hash constants (numpy/random/bit_generator.pyx)
_INIT_A = 0x43B0D7E5
_MULT_A = 0x931E8875
_INIT_B = 0x8B51F9DD
_MULT_B = 0x58F38DED
_MIX_MULT_L = 0xCA01F9DD
_MIX_MULT_R = 0x4973F715
_XSHIFT = 16
_POOL = 4
# PCG's 128-bit LCG multiplier
_PCG_MULT = 0x2360ED051FC65DA44385DF649FCCF645


def seed_sequence_state(seed: int, words: int) -> list[int]:
    """SeedSequence(seed).generate_state(words, uint64) (no spawn key, pool size 4)."""
    if seed < 0:
        raise ValueError(f"a seed must be non-negative, got {seed!r}")
    entropy: list[int] = []
    v = seed
    while True:
        entropy.append(v & _M32)
        v >>= 32
        if not v:
            break
    h = _INIT_A

    def hashmix(value: int) -> int:
        nonlocal h
        value = (value ^ h) & _M32
        h = (h * _MULT_A) & _M32
        value = (value * h) & _M32
        return value ^ (value >> _XSHIFT)

    def mix(x: int, y: int) -> int:
        r = (_MIX_MULT_L * x - _MIX_MULT_R * y) & _M32
        return r ^ (r >> _XSHIFT)

    pool = [hashmix(entropy[i] if i < len(entropy) else 0) for i in range(_POOL)]
    for src in range(_POOL):
        for dst in range(_POOL):
            if src != dst:
                pool[dst] = mix(pool[dst], hashmix(pool[src]))
    for src in range(_POOL, len(entropy)):
        for dst in range(_POOL):
            pool[dst] = mix(pool[dst], hashmix(entropy[src]))
    hb = _INIT_B
    out: list[int] = []
    for i in range(2 * words):
        w = (pool[i % _POOL] ^ hb) & _M32
        hb = (hb * _MULT_B) & _M32
        w = (w * hb) & _M32
        out.append(w ^ (w >> _XSHIFT))
    return [out[2 * i] | (out[2 * i + 1] << 32) for i in range(words)]


class SeedStream:
    """Draws of `np.random.default_rng(seed).integers(low, high, size)` for ranges wider
    than 32 bits, in the same order, as Python ints."""

    def __init__(self, seed: int) -> None:
        s = seed_sequence_state(seed, 4)
        self._inc = (((s[2] << 64) | s[3]) << 1 | 1) & _M128
        self._state = 0
        self._step()
        self._state = (self._state + ((s[0] << 64) | s[1])) & _M128
        self._step()

    def _step(self) -> None:
        self._state = (self._state * _PCG_MULT + self._inc) & _M128

    def next_uint64(self) -> int:
        self._step()
        st = self._state
        rot = st >> 122
        x = ((st >> 64) ^ st) & _M64
        return ((x >> rot) | (x << (-rot & 63))) & _M64

    def integers(self, low: int, high: int, size: int) -> list[int]:
        """`size` draws from [low, high): numpy's Lemire rejection on 64-bit outputs."""
        span = high - low - 1  # numpy's `rng`
        if not _M32 < span < _M64:
            raise ValueError(f"only ranges wider than 32 bits are drawn here, got [{low}, {high})")
        excl = span + 1
        threshold = (_M64 - span) % excl
        out: list[int] = []
        for _ in range(size):
            m = self.next_uint64() * excl
            while (m & _M64) < threshold:
                m = self.next_uint64() * excl
            out.append(low + (m >> 64))
        return out
