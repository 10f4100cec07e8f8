"""The coupled draft choice (speculative/choice.py), against the real sampler: with q equal
to the target's distribution the draft is the target's own draw; q blends the matched
lengths longest first; the walk drafts each position with that position's noise; and with
a history of samples from the target's distribution, coupled drafts are accepted far more
often than point-mass drafts (the real noise, a known distribution)."""

from __future__ import annotations

import math
import random

import torch

from rollout.request import Req, SamplingParams
from rollout.sampling import SamplingBatch, sample
from speculative.choice import DraftSpec, blended, coupled, latest, walk
from speculative.index import ContinuationIndex
from speculative.noise import position_key, race_noise
from speculative.suffix import SuffixDrafter

VOCAB = 64
PROMPT = [60, 61, 62, 63]  # the distributions below put no mass on these


def _distribution(seed: int, scale: float) -> torch.Tensor:
    """[VOCAB] log-probs of a random distribution over tokens 0..59."""
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * scale
    logits[60:] = float("-inf")
    return torch.log_softmax(logits, -1)


def _target_draws(logp: torch.Tensor, reqs: list[Req]) -> list[int]:
    """What the engine's sampler draws for each request's next position (temperature 1)."""
    sb = SamplingBatch.from_reqs(reqs, VOCAB, "cpu")
    return sample(logp.repeat(len(reqs), 1), sb).token_ids.tolist()


def _reqs(count: int, first_seed: int) -> list[Req]:
    return [Req(rid=f"q{i}", prompt_ids=list(PROMPT), params=SamplingParams(), seed=first_seed + 7919 * i)
            for i in range(count)]


def test_coupled_choice_is_the_samplers_draw_when_q_is_its_distribution() -> None:
    counts = {x: c for x in range(60) if (c := random.Random(x).randrange(0, 9))}  # q = counts / total
    total = sum(counts.values())
    logp = torch.full((VOCAB,), float("-inf"))
    for x, c in counts.items():
        logp[x] = math.log(c / total)
    reqs = _reqs(300, first_seed=5)
    draws = _target_draws(logp, reqs)
    drafts = [coupled([counts], position_key(r.seed, r.seq_len)) for r in reqs]
    assert drafts == draws
    assert len(set(draws)) > 10, "the draws spread over q's support: the choice is not the mode"


def test_blend_weights_longer_matches_first_and_keeps_shorter_ones() -> None:
    long, short = {5: 1}, {5: 1, 7: 3}
    q = blended([long, short], blend=1.0)
    # short alone: 5 -> 1/4, 7 -> 3/4; the long level (1 count) gets weight 1/2 of its own
    assert math.isclose(q[5], 0.5 + 0.5 * 0.25) and math.isclose(q[7], 0.5 * 0.75)
    assert blended([long, short], blend=0.0) == {5: 1.0}, "no blend: the longest match alone"
    assert latest([{3: 2, 9: 1}, short]) == 9, "the point mass: the longest match's latest continuation"


def test_walk_drafts_each_position_with_its_own_noise_after_the_drafts_before_it() -> None:
    index = ContinuationIndex(3)
    sequence = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 6, 2, 3, 4]
    index.add(sequence, 0, len(sequence))
    spec = DraftSpec(seed=11, position=40, coupled=True)
    drafts = walk(index, [9, 1, 2], 3, 2, spec)
    context = [9, 1, 2]
    for j, token in enumerate(drafts):  # replay: each draft is the race after the context so far
        levels = [c for n in (3, 2) if (c := index.counts(context[-n:])) is not None]
        q = blended(levels)
        key = position_key(11, 40 + j)
        assert token == max(q, key=lambda x: math.log(q[x]) + race_noise(key, x))
        context.append(token)
    assert len(drafts) == 3
    greedy = walk(index, [9, 1, 2], 3, 2, DraftSpec(seed=11, position=40, coupled=False))
    assert greedy[0] == 3 and greedy[1] == 6, "(1, 2) -> 3, then (2, 3) last went on with 6"


def _acceptance(logp: torch.Tensor, history: list[int], coupled_drafts: bool) -> float:
    drafter = SuffixDrafter(max_tokens=1, context_len=1000, history_tokens=100_000, coupled=coupled_drafts)
    for i, token in enumerate(history):  # earlier rollouts of the prompt: one sampled token each
        done = Req(rid=f"h{i}", prompt_ids=list(PROMPT), params=SamplingParams(), seed=i)
        done.output_ids = [token]
        drafter.observe_finished(done)
    reqs = _reqs(400, first_seed=10_000)
    draws = _target_draws(logp, reqs)
    return sum(drafter.propose(r, 1) == [t] for r, t in zip(reqs, draws)) / len(reqs)


def test_coupled_drafts_from_samples_of_the_distribution_beat_the_point_mass() -> None:
    """16 earlier samples of a broad distribution (its mode has probability 0.20): a
    point-mass draft is accepted at most as often as the mode's probability (0.17 here);
    coupled drafts, the target's race over the samples' counts, more than twice as often
    (0.55), although 16 samples estimate 60 probabilities poorly."""
    logp = _distribution(seed=3, scale=1.6)
    p = logp.exp()
    rng = random.Random(0)
    history = rng.choices(range(VOCAB), weights=p.tolist(), k=16)
    point = _acceptance(logp, history, coupled_drafts=False)
    coupled_rate = _acceptance(logp, history, coupled_drafts=True)
    assert point <= p.max().item() + 0.05
    assert coupled_rate > 2 * max(point, p.max().item()), (coupled_rate, point, p.max().item())
