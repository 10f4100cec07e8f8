"""The host twin of the sampler's noise is the device's, bit for bit: every vocab id of many
(seed, position) pairs, including negative seeds, positions past 2**32 and the values whose
float32 rounding is a tie (the upper half of the 24-bit range)."""

from __future__ import annotations

import random
import struct

import torch

from rollout.sampling import uniform_noise
from speculative.noise import position_key, race_noise, uniform


def test_host_noise_equals_uniform_noise_bitwise() -> None:
    rng = random.Random(0)
    seeds = [0, 1, 2**63 - 1, -1, -(2**63), 0x1234_5678_9ABC_DEF0] + [rng.randrange(-(2**63), 2**63) for _ in range(10)]
    positions = [0, 1, 2**32 + 3, 2**40 + 17, 100_000] + [rng.randrange(2**20) for _ in range(11)]
    vocab = 4096
    device = uniform_noise(torch.tensor(seeds), torch.tensor(positions), vocab)  # [16, vocab] float32
    rounded_ties = 0
    for row, (seed, position) in enumerate(zip(seeds, positions)):
        key = position_key(seed, position)
        want = device[row].tolist()
        for token in range(vocab):
            got = uniform(key, token)
            assert got == want[token], (seed, position, token, got, want[token])
            assert struct.unpack("f", struct.pack("f", got))[0] == got  # a float32 value
            rounded_ties += got >= 0.5
    assert rounded_ties > len(seeds) * vocab // 3, "the rounding branch was exercised"


def test_race_noise_is_the_samplers_gumbel_term() -> None:
    """-log(-log u), as the sampler adds it to the log-probs (to float32 precision)."""
    seeds, positions = torch.tensor([5, 6]), torch.tensor([9, 12])
    device = -torch.log(-torch.log(uniform_noise(seeds, positions, 64)))
    for row in range(2):
        key = position_key(int(seeds[row]), int(positions[row]))
        host = torch.tensor([race_noise(key, t) for t in range(64)])
        torch.testing.assert_close(host.float(), device[row], atol=1e-5, rtol=1e-5)
