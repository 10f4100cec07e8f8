"""The low-rank (LoRA) term of the skinny GEMV's epilogue (rollout/kernels/low_rank.py): against
its torch twin, through the SiLU-mul and rotary epilogues, for base rows and empty slots, and
its refusals. The one-row path that builds the term is checked in tests/lora/test_one_row.py.

On CPU the kernel runs under TRITON_INTERPRET=1 on tiny shapes, as in test_skinny.py, whose
cases and tiles these tests share.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import
pytest.importorskip("triton", reason="triton is not installed")

from rollout import kernels  # noqa: E402
from rollout.kernels import skinny  # noqa: E402

from tests.kernels.test_skinny import DEVICE, DTYPES, GPU, SMALL, _case, _ints, _rope_case  # noqa: E402

NUM_SLOTS = 3


def _term(n: int, slices: tuple[int, ...], max_rank: int, dtype: torch.dtype, slot: int, split: int = 3,
          ranks: tuple[int, ...] = (5, 3, 0), seed: int = 0):
    """A LowRank over slots of `ranks` whose never-read parts are NaN (h past the slot's rank)
    and whose b is zero past each slot's rank, as the pool keeps it (LowRank's contract)."""
    from rollout.kernels.low_rank import LowRank

    g = torch.Generator().manual_seed(seed)
    cols = (len(slices) - 1) * max_rank
    h = torch.randn(split, cols, generator=g)
    b = torch.randn(NUM_SLOTS, n, max_rank, generator=g)
    for s, rank in enumerate(ranks):
        b[s, :, rank:] = 0.0
    rank = ranks[slot] if slot >= 0 else 0
    h.view(split, len(slices) - 1, max_rank)[:, :, rank:] = float("nan")
    ranks_t = torch.tensor(ranks, dtype=torch.int32, device=DEVICE)
    return LowRank(h.to(DEVICE), b.to(DEVICE, dtype), _ints(slot, torch.int32), ranks_t, slices, max_rank)


def _check_term(y: torch.Tensor, plain: torch.Tensor, term) -> None:
    """y = plain (the GEMV's output) plus the term, rounded once: within one unit of the last
    place of the torch twin (the fp32 sums run in another order; the interpreter truncates)."""
    from rollout.kernels import low_rank

    ref = low_rank.reference(plain, term).float()
    ulp = torch.finfo(y.dtype).eps * ref.abs().clamp_min(1.0)
    assert torch.isfinite(y).all() and ((y.float() - ref).abs() <= 2 * ulp).all(), (y.float() - ref).abs().max()
    assert not torch.equal(y, plain), "the term added nothing"


# (N, K, slice offsets, max_rank): one slice, q/k/v-like slices, gate/up halves; a rank
# past one 16-column block (two blocks, the second partly past the rank)
TERM_SHAPES = [(24, 40, (0, 24), 8), (40, 33, (0, 16, 28, 40), 8), (34, 64, (0, 17, 34), 20)]


@pytest.mark.parametrize("n,k,slices,max_rank", TERM_SHAPES, ids=str)
def test_low_rank_term_adds_the_adapters_delta_once_rounded(n, k, slices, max_rank):
    for dtype in DTYPES:
        x, w, b = _case(1, n, k, dtype, True, seed=n + k)
        for slot in (0, 1):
            term = _term(n, slices, max_rank, dtype, slot, ranks=(max_rank, 3, 0), seed=slot)
            for tiles in SMALL + ([None] if GPU else []):
                plain = skinny.linear(x, w, b, tiles=tiles)
                _check_term(skinny.linear(x, w, b, tiles=tiles, low_rank=term), plain, term)


def test_low_rank_term_of_a_base_row_or_an_empty_slot_adds_nothing():
    """slot -1 (a base request in a LoRA step) or a slot of rank 0 (cleared, its b left as it
    was): bit-equal to no term, with all of h NaN."""
    x, w, b = _case(1, 40, 33, torch.bfloat16, True)
    for slot in (-1, 2):
        term = _term(40, (0, 16, 28, 40), 8, torch.bfloat16, slot)
        term.h.fill_(float("nan"))
        term.b[2].normal_()  # what a cleared slot keeps: finite, never read past rank 0
        for tiles in SMALL:
            assert torch.equal(skinny.linear(x, w, b, tiles=tiles, low_rank=term), skinny.linear(x, w, b, tiles=tiles))


def test_low_rank_term_in_the_silu_and_rope_epilogues_is_added_before_them():
    """linear_silu_mul / linear_rope_kv with a term = linear with the term, then SiLU-mul / the
    rotary with its store, bit for bit."""
    from rollout.kernels import fused, rotary

    for dtype in DTYPES:
        x, w, b = _case(1, 34, 64, dtype, True, seed=4)
        term = _term(34, (0, 17, 34), 8, dtype, 0, ranks=(8, 3, 0))
        for tiles in SMALL:
            with_term = skinny.linear(x, w, b, tiles=tiles, low_rank=term)
            got = skinny.linear_silu_mul(x, w, b, tiles=tiles, low_rank=term)
            assert torch.equal(got, fused.silu_and_mul(with_term)), (dtype, tiles)
        n_q, n_kv, d = 4, 2, 8
        x, w, b, cos, sin, caches = _rope_case(n_q, n_kv, d, 40, dtype, False, seed=9)
        n = (n_q + 2 * n_kv) * d
        term = _term(n, (0, n_q * d, (n_q + n_kv) * d, n), 8, dtype, 1, ranks=(2, 8, 0))
        for tiles in SMALL:
            kc, vc = caches[0].clone(), caches[1].clone()
            rope = skinny.RopeKV(cos, sin, _ints(5), kc, vc, _ints(2), n_q, n_kv)
            got = skinny.linear_rope_kv(x, w, b, rope, tiles=tiles, low_rank=term)
            q, kk, v = skinny.linear(x, w, b, tiles=tiles, low_rank=term).split([n_q * d, n_kv * d, n_kv * d], dim=-1)
            ref_kc, ref_vc = caches[0].clone(), caches[1].clone()
            q, kk = rotary.rotary_embedding(q.view(1, n_q, d), kk.view(1, n_kv, d), cos, sin, _ints(5),
                                            v=v.view(1, n_kv, d), k_cache=ref_kc, v_cache=ref_vc, slots=_ints(2))
            assert torch.equal(got, torch.cat([q.flatten(), kk.flatten(), v.flatten()]).view(1, -1)), (dtype, tiles)
            assert torch.equal(kc, ref_kc) and torch.equal(vc, ref_vc)


def test_low_rank_term_refuses_bad_input():
    x, w, b = _case(1, 24, 40, torch.float16, False)
    term = _term(24, (0, 12, 24), 8, torch.float16, 0)
    for bad, match in [
        (dict(slice_offsets=(0, 12, 23)), "rising from 0 to N=24"),
        (dict(slice_offsets=(0, 6, 12, 18, 24)), "1..3 slices"),
        (dict(b=term.b[:, :20]), r"low_rank.b must be \[num_slots, 24, 8\]"),
        (dict(b=term.b.half().to(torch.bfloat16)), "low_rank.b must be"),
        (dict(h=term.h.double()), "low_rank.h must be contiguous fp32"),
        (dict(h=term.h[:, :8]), "low_rank.h must be"),
        (dict(slot=term.slot.long()), "low_rank.slot must be int32"),
        (dict(ranks=term.ranks[:2]), r"low_rank.ranks must be int32 \[3\]"),
    ]:
        with pytest.raises(ValueError, match=match):
            skinny.linear(x, w, b, low_rank=dataclasses.replace(term, **bad))
    with pytest.raises(ValueError, match="needs the skinny kernel's one row"):
        kernels.linear(x.float(), w.float(), low_rank=term)


@pytest.mark.skipif(not GPU, reason="Llama-3-8B's shapes on the compiled kernels")
def test_low_rank_term_on_llama_shapes_after_its_shrink():
    """Llama-3-8B's qkv, gate_up and down with a rank-16 term whose h the one-row shrink kernel
    writes right before each GEMV (which loads h beside x, after its PDL wait), launched back
    to back with a new x each time: every output matches its own reference, so no GEMV read
    an h before its shrink had written it (the previous launch's h would be another x's)."""
    from lora import ops

    for n, k, slices in ((6144, 4096, (0, 4096, 5120, 6144)), (28672, 4096, (0, 14336, 28672)),
                         (4096, 14336, (0, 4096))):
        _, w, _ = _case(1, n, k, torch.bfloat16, False, seed=n)
        term = _term(n, slices, 16, torch.bfloat16, 0, ranks=(16, 8, 0))
        a = (torch.randn(NUM_SLOTS, term.h.shape[1], k, device=DEVICE) / k**0.5).to(torch.bfloat16)
        xs = [_case(1, 8, k, torch.bfloat16, False, seed=i)[0] for i in range(40)]
        terms, outs = [], []
        for x in xs:
            h = ops.shrink_row(x, a, term.slot, term.ranks, num_slices=len(slices) - 1, max_rank=16)
            terms.append(dataclasses.replace(term, h=h))
            outs.append(skinny.linear(x, w, low_rank=terms[-1]))
        for x, t, y in zip(xs, terms, outs):
            _check_term(y, skinny.linear(x, w), t)
