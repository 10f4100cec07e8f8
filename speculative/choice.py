"""Which token to draft, from the continuation counts of the context's suffixes.

The target draws a sampled position with the exponential race, argmax_x log p'(x) + g(x),
g = -log(-log u(seed, position, x)) (rollout/sampling.py), and accepts a draft exactly when
the draft is that draw. A point-mass draft (the latest continuation) is accepted with
probability p'(draft): at temperature 1 the mode of a broad distribution. A drafter that
knows samples of the same distribution can do better: build their empirical distribution q
and run the same race with the same noise, d = argmax_{x in supp q} log q(x) + g(x)
(noise.py computes g on the host, bit for bit). As q approaches p', d and the target's draw
coincide with probability approaching 1: the race couples them. Verification is unchanged,
so outputs stay plain decoding's token for token whatever the drafts.

q blends the matched suffix lengths, longest first (an interpolated estimate, as PPM does):
q_n(x) = (c_n(x) + BLEND * q_{n-1}(x)) / (|c_n| + BLEND), where c_n are the counts after the
context's last n tokens and q_{n-1} the estimate from the next shorter match. A long match
is the closer context; the shorter ones add the draws a long match has too few of.

The walk drafts position after position: each draft is appended to the context and the
next one is chosen after the new suffix, with that position's own noise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from speculative.index import ContinuationIndex, Counts
from speculative.noise import position_key, race_noise

BLEND = 1.0  # weight of the shorter matches' estimate against a level's own counts


@dataclass(frozen=True)
class DraftSpec:
    """What a drafter knows of a request's next positions."""

    seed: int  # the request's own seed (the sampler's noise)
    position: int  # index in the sequence of the first drafted token
    coupled: bool  # race with the sampler's noise (sampled requests); else the latest continuation


def latest(levels: list[Counts]) -> int:
    """The point-mass draft: the latest continuation of the longest match."""
    return next(reversed(levels[0]))


def blended(levels: list[Counts], blend: float = BLEND) -> dict[int, float]:
    """q over the union of the matched continuations, longest match first (the recursion
    above unrolled: each level takes its share of the mass the longer ones left)."""
    q: dict[int, float] = {}
    left = 1.0  # mass the longer levels left to the shorter ones
    last = len(levels) - 1 if blend > 0 else 0
    for i, counts in enumerate(levels[: last + 1]):
        total = sum(counts.values())
        w = left / (total if i == last else total + blend)
        for x, c in counts.items():
            q[x] = q.get(x, 0.0) + w * c
        left *= blend / (total + blend)
    return q


def race(q: dict[int, float], key: int) -> int:
    """argmax_x log q(x) + g(x): the target's race run over q, with the noise of `key`."""
    if len(q) == 1:
        return next(iter(q))
    return max(q, key=lambda x: math.log(q[x]) + race_noise(key, x))


def coupled(levels: list[Counts], key: int) -> int:
    """The coupled draft after matches `levels`: the race over their blended estimate."""
    return race(blended(levels, BLEND), key)


def walk(index: ContinuationIndex, context: Sequence[int], k: int, min_n: int, spec: DraftSpec) -> list[int]:
    """Up to k drafts after `context` (its last tokens suffice: index.max_n of them)."""
    tail = list(context[len(context) - index.max_n :])
    drafts: list[int] = []
    while len(drafts) < k:
        levels = index.matches(tail, min_n)
        if not levels:
            break
        if spec.coupled:
            token = coupled(levels, position_key(spec.seed, spec.position + len(drafts)))
        else:
            token = latest(levels)
        drafts.append(token)
        tail.append(token)
    return drafts
