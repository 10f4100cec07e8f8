"""Sampling: temperature / top-k / top-p / min-p, seeded per request, with log-probs.

Randomness is a counter-based hash of (request seed, token position, vocab id), so a
request draws the same noise for its i-th token whatever else is in the batch, and a
request that is retracted and resumed draws the same tokens again. The draw is the
exponential race (argmax of p / E, E ~ Exp(1)), which samples exactly from p without a
multinomial call, so there is no host sync inside sampling (as gpt-fast does).

Filters follow transformers' order: temperature, then top-k, then top-p on what top-k
kept, then min-p (relative to the most likely token, so order does not matter for it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout.device import to_device
from rollout.request import Req
from rollout.structured.bitmask import TokenMask, apply_mask_

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 integer hash on int64 tensors holding 32-bit values. Products are masked
    back to 32 bits, so int64 wrap-around never affects the result."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32 in (0, 1): a pure function of (seed, position, vocab id)."""
    lo, hi = seeds & _MASK32, (seeds >> 32) & _MASK32
    key = _mix32(lo ^ _mix32(hi ^ _mix32(positions & _MASK32)))  # [B]
    ids = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    h = _mix32((key[:, None] ^ ((ids[None, :] * 0x9E3779B9) & _MASK32)) & _MASK32)
    h = _mix32(h ^ key[:, None])
    # 24 high bits -> (0, 1), never exactly 0 or 1
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as device tensors, plus CPU flags that pick the path."""

    temperatures: torch.Tensor  # [B] float32, 0 for greedy rows (treated as 1 in the math)
    top_ks: torch.Tensor  # [B] int64, vocab_size when off
    top_ps: torch.Tensor  # [B] float32
    min_ps: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64: index in the sequence of the token being drawn
    greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    need_sort: bool  # some row uses top-k or top-p
    need_min_p: bool
    max_top_logprobs: int

    @classmethod
    def from_reqs(cls, reqs: list[Req], vocab_size: int, device: torch.device | str,
                  offsets: list[int] | None = None) -> SamplingBatch:
        """One row per entry of `reqs`; `offsets[i]`: row i draws the token `offsets[i]`
        positions past the request's next one (a draft position being verified)."""
        params = [r.params for r in reqs]
        temps = [p.temperature for p in params]
        top_ks = [vocab_size if p.top_k < 0 else min(p.top_k, vocab_size) for p in params]

        all_greedy = all(x == 0 for x in temps)
        max_top = max((p.top_logprobs for p in params), default=0)
        if all_greedy:  # argmax needs none of the per-row tensors: skip their host-to-device copies
            none = torch.empty(0, device=device)
            return cls(none, none, none, none, none, none, none, True, False, False, max_top)

        def t(values: list, dtype: torch.dtype) -> torch.Tensor:
            return to_device(torch.tensor(values, dtype=dtype), torch.device(device))

        return cls(
            temperatures=t([x if x > 0 else 1.0 for x in temps], torch.float32),
            top_ks=t(top_ks, torch.int64),
            top_ps=t([p.top_p for p in params], torch.float32),
            min_ps=t([p.min_p for p in params], torch.float32),
            seeds=t([r.seed for r in reqs], torch.int64),
            positions=t([r.seq_len + (offsets[i] if offsets else 0) for i, r in enumerate(reqs)], torch.int64),
            greedy=t([x == 0 for x in temps], torch.bool),
            all_greedy=False,
            need_sort=any(p.temperature > 0 and (p.top_p < 1.0 or k < vocab_size) for p, k in zip(params, top_ks)),
            need_min_p=any(p.temperature > 0 and p.min_p > 0 for p in params),
            max_top_logprobs=max_top,
        )


@dataclass
class SampleOutput:
    token_ids: torch.Tensor  # [B] int64
    raw_logprobs: torch.Tensor  # [B] float32: log_softmax(logits)[token]
    processed_logprobs: torch.Tensor  # [B] float32: log p'(token) under the filtered distribution
    # k most likely tokens of each distribution: (log-probs [B, k], ids [B, k])
    top_raw: tuple[torch.Tensor, torch.Tensor] | None
    top_processed: tuple[torch.Tensor, torch.Tensor] | None


def filtered_logits(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """Temperature-scaled logits with filtered-out tokens at -inf. [B, V] float32."""
    scaled = logits / sb.temperatures[:, None]
    if sb.need_sort:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        ranks = torch.arange(scaled.shape[-1], device=scaled.device)
        sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= sb.top_ks[:, None], float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        # keep the smallest head whose mass reaches top_p (the first token always stays).
        # Rows with top_p == 1 keep everything: float32 cumsum can reach 1.0 before the
        # tail, which would drop tiny-probability tokens only when batched with a top-p row.
        drop = ((probs.cumsum(dim=-1) - probs) >= sb.top_ps[:, None]) & (sb.top_ps[:, None] < 1.0)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)
    if sb.need_min_p:
        probs = scaled.softmax(dim=-1)
        threshold = sb.min_ps[:, None] * probs.max(dim=-1, keepdim=True).values
        scaled = scaled.masked_fill(probs < threshold, float("-inf"))
    return scaled


def sample(logits: torch.Tensor, sb: SamplingBatch, mask: TokenMask | None = None) -> SampleOutput:
    """logits: [B, V] float32 -> tokens and log-probs, with no host sync.

    `mask` (structured output): its rows draw only the tokens their grammar allows, and their
    processed log-probs are under that masked distribution; raw log-probs stay those of the
    unmodified logits. `logits` is masked in place."""
    raw = torch.log_softmax(logits, dim=-1)
    if mask is not None:
        apply_mask_(logits, mask)
    if sb.all_greedy:
        tokens = logits.argmax(dim=-1)
        processed = raw
    else:
        processed = torch.log_softmax(filtered_logits(logits, sb), dim=-1)
        noise = uniform_noise(sb.seeds, sb.positions, logits.shape[-1])
        # argmax p/E == argmax (log p - log E), E = -log U ~ Exp(1); filtered tokens are -inf
        race = processed - torch.log(-torch.log(noise))
        sampled = race.argmax(dim=-1)
        tokens = torch.where(sb.greedy, logits.argmax(dim=-1), sampled)
        # Greedy rows report the raw value: a point mass has no useful log-prob.
        processed = torch.where(sb.greedy[:, None], raw, processed)
    idx = tokens[:, None]
    top_raw = top_processed = None
    if sb.max_top_logprobs:
        k = min(sb.max_top_logprobs, logits.shape[-1])
        top_raw = tuple(raw.topk(k, dim=-1))
        top_processed = top_raw if sb.all_greedy else tuple(processed.topk(k, dim=-1))
    return SampleOutput(
        token_ids=tokens,
        raw_logprobs=raw.gather(-1, idx)[:, 0],
        processed_logprobs=processed.gather(-1, idx)[:, 0],
        top_raw=top_raw,  # type: ignore[arg-type]
        top_processed=top_processed,  # type: ignore[arg-type]
    )
