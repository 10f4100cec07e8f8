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

import numpy as np
import torch

from rollout import kernels
from rollout.device import upload
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


def _as_int32(c: int) -> int:
    """A 32-bit pattern as the int32 that holds it."""
    return c - (1 << 32) if c >= 1 << 31 else c


_M1, _M2, _GOLDEN = _as_int32(0x7FEB352D), _as_int32(0x846CA68B), _as_int32(0x9E3779B9)


def _mix32_inplace(x: torch.Tensor) -> torch.Tensor:
    """_mix32 on int32 lanes, in place: products wrap mod 2**32 (two's complement, the low 32
    bits of the int64 product), and each logical shift is the arithmetic one masked."""
    x ^= (x >> 16) & 0xFFFF
    x *= _M1
    x ^= (x >> 15) & 0x1FFFF
    x *= _M2
    x ^= (x >> 16) & 0xFFFF
    return x


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[B] int64 holding the 32-bit key each row's vocab ids are hashed with."""
    lo, hi = seeds & _MASK32, (seeds >> 32) & _MASK32
    return _mix32(lo ^ _mix32(hi ^ _mix32(positions & _MASK32)))


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32 in (0, 1): a pure function of (seed, position, vocab id),
    u = (mix32(mix32(key ^ (id * golden)) ^ key) >> 8 + 0.5) / 2**24 with key = row_keys(...).
    The [B, V] rounds run in place on int32 lanes: the same bits as int64 lanes masked to 32
    bits (tests keep that form as the reference), 7.7x faster on a 2-core CPU at 64 x 49152."""
    key = row_keys(seeds, positions)
    key32 = torch.where(key >= 1 << 31, key - (1 << 32), key).to(torch.int32)[:, None]
    h = torch.arange(vocab_size, device=seeds.device, dtype=torch.int32) * _GOLDEN
    h = h[None, :] ^ key32
    _mix32_inplace(h)
    h ^= key32
    _mix32_inplace(h)
    h = (h >> 8) & 0xFFFFFF
    # 24 high bits -> (0, 1), never exactly 0 or 1
    return (h.to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def race(processed: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, fused: bool | None = None) -> torch.Tensor:
    """[B] the exponential race's winners: argmax p / E == argmax (log p - log E), E = -log U
    ~ Exp(1); filtered tokens (-inf) never win. On CUDA one Triton launch (kernels/race.py),
    the same tokens bit for bit: the torch ops below, a dozen elementwise passes over
    [rows, vocab], are a large share of a sampled step at RL batch sizes (BENCHMARKS.md,
    "GRPO's decode step: shared-prefix attention and the sampler's race"). They run elsewhere
    and are its reference. `fused`: KernelOptions.fused (None: the kernel on CUDA tensors)."""
    if kernels.use_fused(processed, fused):
        from rollout.kernels.race import race_argmax

        return race_argmax(processed.contiguous(), seeds, positions)
    noise = uniform_noise(seeds, positions, processed.shape[-1])
    return (processed - torch.log(-torch.log(noise))).argmax(dim=-1)


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

        # the seven columns in one host-to-device copy (each its own cost the host ~20 us,
        # which a verify step, not overlapped, waits for)
        temperatures, top_ks_d, top_ps, min_ps, seeds, positions, greedy = upload([
            np.array([x if x > 0 else 1.0 for x in temps], dtype=np.float32),
            np.array(top_ks, dtype=np.int64),
            np.array([p.top_p for p in params], dtype=np.float32),
            np.array([p.min_p for p in params], dtype=np.float32),
            np.array([r.seed for r in reqs], dtype=np.int64),
            np.array([r.seq_len + (offsets[i] if offsets else 0) for i, r in enumerate(reqs)], dtype=np.int64),
            np.array([x == 0 for x in temps], dtype=np.bool_),
        ], torch.device(device))
        return cls(
            temperatures=temperatures,
            top_ks=top_ks_d,
            top_ps=top_ps,
            min_ps=min_ps,
            seeds=seeds,
            positions=positions,
            greedy=greedy,
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


def sample(logits: torch.Tensor, sb: SamplingBatch, mask: TokenMask | None = None,
           fused: bool | None = None) -> SampleOutput:
    """logits: [B, V] float32 -> tokens and log-probs, with no host sync.

    `mask` (structured output): its rows draw only the tokens their grammar allows, and their
    processed log-probs are under that masked distribution; raw log-probs stay those of the
    unmodified logits. `logits` is masked in place. `fused`: the race's kernel (`race`)."""
    raw = torch.log_softmax(logits, dim=-1)
    if mask is not None:
        apply_mask_(logits, mask)
    if sb.all_greedy:
        tokens = logits.argmax(dim=-1)
        processed = raw
    else:
        processed = torch.log_softmax(filtered_logits(logits, sb), dim=-1)
        tokens = torch.where(sb.greedy, logits.argmax(dim=-1), race(processed, sb.seeds, sb.positions, fused))
    idx = tokens[:, None]
    raw_lp = raw.gather(-1, idx)[:, 0]
    processed_lp = raw_lp if sb.all_greedy else torch.where(sb.greedy, raw_lp, processed.gather(-1, idx)[:, 0])
    top_raw = top_processed = None
    if sb.max_top_logprobs:
        k = min(sb.max_top_logprobs, logits.shape[-1])
        top_raw = tuple(raw.topk(k, dim=-1))
        if not sb.all_greedy:
            # Greedy rows report the raw values: a point mass has no useful log-prob.
            processed = torch.where(sb.greedy[:, None], raw, processed)
        top_processed = top_raw if sb.all_greedy else tuple(processed.topk(k, dim=-1))
    return SampleOutput(
        token_ids=tokens,
        raw_logprobs=raw_lp,
        processed_logprobs=processed_lp,
        top_raw=top_raw,  # type: ignore[arg-type]
        top_processed=top_processed,  # type: ignore[arg-type]
    )
