"""The sampler's race kernel (rollout/kernels/race.py) against the torch race of rollout.sampling
(uniform_noise, two logs, argmax), and the sampler through it.

On CPU the kernel runs under TRITON_INTERPRET=1 with CHUNK and BLOCK shrunk, so a small
vocabulary spans several chunks and blocks (where a wrong index or tie rule would show). On a
GPU it runs compiled at a real vocabulary and must pick torch's tokens on the same device.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import
pytest.importorskip("triton", reason="triton is not installed")

from rollout.kernels import race  # noqa: E402
from rollout.sampling import SamplingBatch, sample, uniform_noise  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB = 128256 if DEVICE == "cuda" else 1000


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    if DEVICE == "cpu":
        monkeypatch.setattr(race, "CHUNK", 256)
        monkeypatch.setattr(race, "BLOCK", 64)


def torch_race(scores: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    noise = uniform_noise(seeds, positions, scores.shape[-1])
    return (scores - torch.log(-torch.log(noise))).argmax(dim=-1)


def case(rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    scores = torch.log_softmax(3 * torch.randn(rows, vocab, generator=g), dim=-1)
    seeds = torch.randint(-2**62, 2**62, (rows,), generator=g)  # negative seeds too: the key masks them
    positions = torch.randint(0, 1 << 20, (rows,), generator=g)
    return scores.to(DEVICE), seeds.to(DEVICE), positions.to(DEVICE)


@pytest.mark.parametrize("vocab", [VOCAB, 999, 64])
def test_winners_equal_the_torch_race(vocab: int) -> None:
    scores, seeds, positions = case(48, vocab, seed=vocab)
    got = race.race_argmax(scores, seeds, positions)
    assert got.dtype == torch.int64 and got.device == scores.device
    assert torch.equal(got, torch_race(scores, seeds, positions))


def test_filtered_tokens_never_win_and_ties_take_the_first() -> None:
    scores, seeds, positions = case(6, 700, seed=1)
    keep = torch.zeros_like(scores, dtype=torch.bool)
    keep[0, 650] = True  # one token left, in the last chunk
    keep[1, [3, 300, 699]] = True
    scores = scores.masked_fill(~keep, float("-inf"))
    scores[2:4] = float("-inf")  # nothing left: torch's argmax says 0, the first index
    scores[4] = 0.0
    scores[4, 5] = float("inf")  # a row with equal winners: +inf at 5 and 600, the first wins
    scores[4, 600] = float("inf")
    got = race.race_argmax(scores, seeds, positions)
    assert got[0] == 650 and int(got[1]) in (3, 300, 699) and got[2] == got[3] == 0 and got[4] == 5
    assert torch.equal(got, torch_race(scores, seeds, positions))


def test_refuses_bad_shapes() -> None:
    scores, seeds, positions = case(4, 100, seed=2)
    with pytest.raises(ValueError, match="float32"):
        race.race_argmax(scores.double(), seeds, positions)
    with pytest.raises(ValueError, match="seeds and positions"):
        race.race_argmax(scores, seeds[:3], positions)
    assert race.race_argmax(scores[:0], seeds[:0], positions[:0]).shape == (0,)


def test_sampler_through_the_kernel_equals_the_torch_path() -> None:
    """sample() with the race on the kernel and on torch: the same tokens and log-probs, for
    sampled rows (temperature, min-p, top-k) beside greedy ones and with top log-probs."""
    from rollout.request import Req, SamplingParams

    vocab = 500
    g = torch.Generator().manual_seed(3)
    logits = (4 * torch.randn(8, vocab, generator=g)).to(DEVICE)
    params = [SamplingParams(temperature=t, min_p=mp, top_k=k, seed=i, top_logprobs=2)
              for i, (t, mp, k) in enumerate([(1.0, 0.0, -1), (0.7, 0.0, -1), (0.0, 0.0, -1), (1.3, 0.05, -1),
                                              (1.0, 0.0, 20), (0.0, 0.0, -1), (2.0, 0.0, -1), (1.0, 0.0, -1)])]
    reqs = [Req(rid=str(i), prompt_ids=[1, 2, 3 + i], params=p, seed=100 + i) for i, p in enumerate(params)]
    outs = {}
    for fused in (True, False):
        sb = SamplingBatch.from_reqs(reqs, vocab, DEVICE)
        outs[fused] = sample(logits.clone(), sb, fused=fused)
    a, b = outs[True], outs[False]
    assert torch.equal(a.token_ids, b.token_ids)
    assert torch.equal(a.raw_logprobs, b.raw_logprobs) and torch.equal(a.processed_logprobs, b.processed_logprobs)
    for x, y in ((a.top_raw, b.top_raw), (a.top_processed, b.top_processed)):
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
    greedy = torch.tensor([p.temperature == 0 for p in params], device=DEVICE)
    assert torch.equal(a.token_ids[greedy], logits.argmax(-1)[greedy])
    assert torch.equal(a.processed_logprobs[greedy], a.raw_logprobs[greedy])  # a point mass reports raw
