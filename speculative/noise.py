"""The sampler's noise on the host, for the few tokens a drafter considers.

`rollout.sampling.uniform_noise` draws every position with a pure integer hash of (request
seed, token position, vocab id); this is its twin in plain Python integers, bit for bit
(the same lowbias32 rounds, then the float32 rounding the device applies), so a drafter can
run the target's exponential race over its own candidates without a tensor op. A twin that
differed would only lower acceptance (verification is the device's), never change outputs;
tests/speculative/test_noise.py holds it to the device's bits.
"""

from __future__ import annotations

import math

MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
_SCALE = 1.0 / (1 << 24)
_HALF_ULP_BOUND = 1 << 23  # from here a float32 holds integers only: m + 0.5 rounds to even


def mix32(x: int) -> int:
    """lowbias32 on a 32-bit value (Python ints do not wrap, so each product is masked)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def position_key(seed: int, position: int) -> int:
    """The per-(seed, position) key every vocab id of that position is hashed with.
    (A negative seed shifts and masks as the device's int64 does: Python ints act as
    two's complement under >> and &.)"""
    lo, hi = seed & MASK32, (seed >> 32) & MASK32
    return mix32(lo ^ mix32(hi ^ mix32(position & MASK32)))


def uniform(key: int, token: int) -> float:
    """u in (0, 1) for `token` at the position of `key`: exactly the float32 the device draws.
    (mix32 twice, written out: a drafter calls this per candidate token.)"""
    x = key ^ ((token * _GOLDEN) & MASK32)
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    x ^= (x >> 16) ^ key
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    m = (x ^ (x >> 16)) >> 8  # 24 high bits
    # float32(m + 0.5): exact below 2**23; above, the half is a tie and rounds to even
    return (m + 0.5 if m < _HALF_ULP_BOUND else m + (m & 1)) * _SCALE


def race_noise(key: int, token: int) -> float:
    """-log E with E = -log u ~ Exp(1) (a Gumbel draw): the target draws
    argmax_x log p'(x) + race_noise(x), so a draft maximizes log q(x) + race_noise(x)."""
    return -math.log(-math.log(uniform(key, token)))
