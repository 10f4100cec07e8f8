"""Multi-LoRA SGMV ops (lora.ops): the torch references against a naive per-token loop,
and the Triton kernels (lora.kernels.sgmv) against the references.

Without CUDA the kernels run under Triton's CPU interpreter (TRITON_INTERPRET=1, set
below before lora.kernels.sgmv first imports triton) on tiny shapes, in float32 and
float16. The interpreter's tl.dot multiplies bf16 bit patterns as integers (numpy has no
bf16), so bf16 is checked on a GPU only, together with a realistic shape and CUDA-graph
capture.

The kernels' contract on what they leave alone is checked, not assumed: shrink is
compared only where it must write (its h comes from torch.empty), expand's h is poisoned
with NaN wherever shrink may leave it unwritten (rows of base segments, columns past a
slot's rank) so reading any of it shows up in out, and base rows of out are compared bit
for bit, -0.0 included (a rewrite as out + 0.0 would turn it into +0.0).

Tolerances: float32 1e-5 (fp32 accumulation in another order); float16/bfloat16 one or two
units in the last place of the output (the same fp32 sum rounded once, whose last fp32
bits may differ, can round to the neighbouring 16-bit value).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import

from lora import ops  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not ON_GPU, reason="needs CUDA (bf16 and real shapes run compiled on a GPU)")
# bf16 is exact only on a GPU (see the module docstring); fp16/fp32 everywhere.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
       torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}
# Slice widths of the fused projections: o/down (1), gate/up (2), q/k/v with GQA (3);
# widths that are not multiples of any block size leave partial N-blocks.
SLICES = {"one": (24,), "two": (20, 20), "three": (32, 12, 12)}


@dataclass
class Problem:
    """One projection of a mixed batch: tokens in segments, adapters in slots."""

    x: torch.Tensor  # [T, K]
    lora_a: torch.Tensor  # [S, num_slices * max_rank, K], zero past each slot's rank
    lora_b: torch.Tensor  # [S, N_out, max_rank], zero past each slot's rank
    out: torch.Tensor  # [T, N_out], the base projection's output
    seg_indptr: torch.Tensor  # int32 [G + 1]
    seg_slots: torch.Tensor  # int32 [G], -1 = base
    slot_ranks: torch.Tensor  # int32 [S]
    slice_offsets: tuple[int, ...]
    max_rank: int
    max_seg_len: int

    @property
    def num_slices(self) -> int:
        return len(self.slice_offsets) - 1

    def shrink_args(self) -> tuple[torch.Tensor, ...]:
        return self.x, self.lora_a, self.seg_indptr, self.seg_slots, self.slot_ranks

    def shrink_kwargs(self, max_seg_len: int | None = None) -> dict[str, int]:
        return dict(num_slices=self.num_slices, max_rank=self.max_rank,
                    max_seg_len=self.max_seg_len if max_seg_len is None else max_seg_len)

    def expand_kwargs(self, max_seg_len: int | None = None) -> dict[str, object]:
        return dict(slice_offsets=self.slice_offsets, max_rank=self.max_rank,
                    max_seg_len=self.max_seg_len if max_seg_len is None else max_seg_len)

    def row_slots(self) -> list[int]:
        """Each row's slot (-1: base segment, empty slot, or outside every segment)."""
        slots = [-1] * self.x.shape[0]
        indptr = self.seg_indptr.tolist()
        for g, slot in enumerate(self.seg_slots.tolist()):
            if slot >= 0 and int(self.slot_ranks[slot]) > 0:
                slots[indptr[g]:indptr[g + 1]] = [slot] * (indptr[g + 1] - indptr[g])
        return slots

    def h_valid(self) -> torch.Tensor:
        """[T, num_slices * max_rank] bool: the entries of h that shrink must write."""
        valid = torch.zeros(self.x.shape[0], self.num_slices, self.max_rank, dtype=torch.bool)
        for t, slot in enumerate(self.row_slots()):
            if slot >= 0:
                valid[t, :, : int(self.slot_ranks[slot])] = True
        return valid.view(self.x.shape[0], -1).to(self.x.device)


def make_problem(seg_lens: list[int], seg_slots: list[int], ranks: list[int], widths: tuple[int, ...], *,
                 hidden: int = 32, max_rank: int = 16, dtype: torch.dtype = torch.float32, seed: int = 0,
                 max_seg_len: int | None = None, device: str = DEVICE) -> Problem:
    g = torch.Generator().manual_seed(seed)
    num_slots, num_slices, n_out = len(ranks), len(widths), sum(widths)
    num_tokens = sum(seg_lens)
    # Scaled so h and the LoRA delta are O(1): absolute tolerances then mean what they say.
    x = torch.randn(num_tokens, hidden, generator=g)
    lora_a = torch.randn(num_slots, num_slices, max_rank, hidden, generator=g) / hidden**0.5
    lora_b = torch.randn(num_slots, n_out, max_rank, generator=g) / max_rank**0.5
    for slot, rank in enumerate(ranks):  # padding past the rank is zero by contract
        lora_a[slot, :, rank:] = 0
        lora_b[slot, :, rank:] = 0
    out = torch.randn(num_tokens, n_out, generator=g)
    indptr = [0]
    for length in seg_lens:
        indptr.append(indptr[-1] + length)
    offsets = [0]
    for width in widths:
        offsets.append(offsets[-1] + width)

    def floats(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype)

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    return Problem(
        x=floats(x), lora_a=floats(lora_a.view(num_slots, num_slices * max_rank, hidden)), lora_b=floats(lora_b),
        out=floats(out), seg_indptr=ints(indptr), seg_slots=ints(seg_slots), slot_ranks=ints(ranks),
        slice_offsets=tuple(offsets), max_rank=max_rank,
        max_seg_len=max(seg_lens, default=0) if max_seg_len is None else max_seg_len,
    )


def random_problem(widths: tuple[int, ...], *, seed: int, max_rank: int = 16, ranks: list[int] | None = None,
                   num_segments: int = 9, max_len: int = 5, **kwargs: Any) -> Problem:
    """Random segments: empty ones, base (-1) ones, repeated slots, and an empty slot."""
    g = torch.Generator().manual_seed(seed)
    ranks = [8, max_rank, 4, 0] if ranks is None else ranks
    seg_lens = torch.randint(0, max_len + 1, (num_segments,), generator=g).tolist()
    seg_lens[1] = 0  # always at least one empty segment
    seg_slots = torch.randint(-1, len(ranks), (num_segments,), generator=g).tolist()
    seg_slots[0], seg_lens[0] = -1, max(seg_lens[0], 1)  # and one non-empty base segment
    return make_problem(seg_lens, seg_slots, ranks, widths, max_rank=max_rank, seed=seed, **kwargs)


def poisoned_h(h: torch.Tensor, p: Problem) -> torch.Tensor:
    """h with NaN wherever shrink may leave it unwritten: expand must never read there."""
    return torch.where(p.h_valid(), h, torch.full_like(h, float("nan")))


def base_rows(p: Problem) -> torch.Tensor:
    return torch.tensor([slot < 0 for slot in p.row_slots()], device=p.out.device)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality: a rewrite of out + 0.0 turns -0.0 into +0.0, which == misses."""
    as_int = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(as_int), b.view(as_int))


@pytest.fixture
def triton_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Route the dispatchers to the kernels, also for CPU tensors (the interpreter)."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    monkeypatch.setattr(ops, "enabled", True)


# --------------------------------------------------------------- naive per-token loop


def naive_shrink(p: Problem) -> torch.Tensor:
    """float64 h, one token and one slice at a time; zeros where nothing is defined."""
    h = torch.zeros(p.x.shape[0], p.num_slices, p.max_rank, dtype=torch.float64)
    a = p.lora_a.cpu().double().view(p.lora_a.shape[0], p.num_slices, p.max_rank, -1)
    for t, slot in enumerate(p.row_slots()):
        if slot >= 0:
            rank = int(p.slot_ranks[slot])
            for j in range(p.num_slices):
                h[t, j, :rank] = a[slot, j, :rank] @ p.x[t].cpu().double()
    return h.view(p.x.shape[0], -1)


def naive_expand(p: Problem, h: torch.Tensor) -> torch.Tensor:
    """float64 out + delta, one token and one slice at a time."""
    out = p.out.cpu().double().clone()
    h3 = h.cpu().double().view(h.shape[0], p.num_slices, p.max_rank)
    for t, slot in enumerate(p.row_slots()):
        if slot >= 0:
            rank = int(p.slot_ranks[slot])
            for j in range(p.num_slices):
                lo, hi = p.slice_offsets[j], p.slice_offsets[j + 1]
                out[t, lo:hi] += p.lora_b[slot, lo:hi, :rank].cpu().double() @ h3[t, j, :rank]
    return out


@pytest.mark.parametrize("max_rank", [16, 32], ids=lambda r: f"max_rank{r}")
@pytest.mark.parametrize("slices", list(SLICES), ids=str)
@pytest.mark.parametrize("seed", [0, 1])
def test_reference_matches_naive_loop(slices: str, max_rank: int, seed: int) -> None:
    # max_rank 32 > every rank (8, 16, 4, 0): padding rows of A / columns of B never count
    p = random_problem(SLICES[slices], seed=seed, max_rank=max_rank, ranks=[8, 16, 4, 0], device="cpu")
    h = ops.shrink_reference(*p.shrink_args(), **p.shrink_kwargs())
    assert h.shape == (p.x.shape[0], p.num_slices * p.max_rank) and h.dtype == p.x.dtype
    torch.testing.assert_close(h.double(), naive_shrink(p), rtol=1e-5, atol=1e-5)  # zeros off the valid entries too

    out0, expected = p.out.clone(), naive_expand(p, h)
    ops.expand_reference(poisoned_h(h, p), p.lora_b, p.out, p.seg_indptr, p.seg_slots, p.slot_ranks,
                         **p.expand_kwargs())
    torch.testing.assert_close(p.out.double(), expected, rtol=1e-5, atol=1e-5)
    base = base_rows(p)
    assert base.any() and same_bits(p.out[base], out0[base])


def test_reference_rejects_a_segment_longer_than_max_seg_len() -> None:
    p = make_problem([2, 5], [0, 1], [4, 4], (8,), device="cpu")
    with pytest.raises(ValueError, match="max_seg_len"):
        ops.shrink_reference(*p.shrink_args(), **p.shrink_kwargs(max_seg_len=4))


# ---------------------------------------------------------- Triton vs the reference


def check_triton_vs_reference(p: Problem, max_seg_len: int | None = None) -> None:
    """Shrink's written entries and expand's whole out against the references; base rows
    of out bit-identical (never rewritten), h's unwritten entries never read."""
    from lora.kernels import sgmv

    tol = TOL[p.x.dtype]
    valid = p.h_valid()
    h = sgmv.sgmv_shrink(*p.shrink_args(), **p.shrink_kwargs(max_seg_len))
    h_ref = ops.shrink_reference(*p.shrink_args(), **p.shrink_kwargs())
    assert h.shape == h_ref.shape and h.dtype == p.x.dtype
    torch.testing.assert_close(h[valid], h_ref[valid], **tol)

    h_in = poisoned_h(h_ref, p)  # the same input for both expands isolates expand's error
    out, out_ref = p.out.clone(), p.out.clone()
    sgmv.sgmv_expand(h_in, p.lora_b, out, p.seg_indptr, p.seg_slots, p.slot_ranks, **p.expand_kwargs(max_seg_len))
    ops.expand_reference(h_in, p.lora_b, out_ref, p.seg_indptr, p.seg_slots, p.slot_ranks, **p.expand_kwargs())
    torch.testing.assert_close(out, out_ref, **tol)
    base = base_rows(p)
    assert same_bits(out[base], p.out[base]), "base rows must not be rewritten"


@needs_triton
@pytest.mark.parametrize("slices,dtype", [(slices, torch.float32) for slices in SLICES]
                         + [("three", dtype) for dtype in DTYPES[1:]], ids=str)
def test_triton_matches_reference(slices: str, dtype: torch.dtype) -> None:
    check_triton_vs_reference(random_problem(SLICES[slices], seed=3, dtype=dtype))


@needs_triton
def test_triton_max_rank_above_every_rank() -> None:
    # N-blocks past a slot's rank are skipped in shrink; expand's K loop stops at the rank
    check_triton_vs_reference(random_problem(SLICES["three"], seed=4, max_rank=32, ranks=[8, 16, 4, 0]))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_decode_segments(dtype: torch.dtype) -> None:
    # decode: every segment one token (max_seg_len 1), slots interleaved
    slots = [0, 2, -1, 1, 0, -1, 3, 2]
    check_triton_vs_reference(make_problem([1] * len(slots), slots, [8, 16, 4, 0], SLICES["three"], dtype=dtype))


@needs_triton
def test_triton_more_segments_than_one_lookup_block(monkeypatch: pytest.MonkeyPatch) -> None:
    # a program finds its segment _BLOCK_G (256) segments at a time; with 8 (for speed in
    # the interpreter), 20 segments of mixed lengths take three
    from lora.kernels import sgmv

    monkeypatch.setattr(sgmv, "_BLOCK_G", 8)
    g = torch.Generator().manual_seed(8)
    seg_lens = torch.randint(0, 4, (20,), generator=g).tolist()
    slots = torch.randint(-1, 3, (20,), generator=g).tolist()
    check_triton_vs_reference(make_problem(seg_lens, slots, [8, 16, 4], (16,), hidden=16))


@needs_triton
def test_triton_long_segments() -> None:
    # prefill: 64-row M-blocks, a segment spanning two of them; K=40 is not a multiple of
    # the K step (masked tail; the other tests' K=32 is)
    p = make_problem([70, 3, 0, 20], [1, -1, 2, 0], [8, 16, 4], SLICES["three"], hidden=40)
    check_triton_vs_reference(p)


@needs_triton
def test_triton_max_seg_len_larger_than_needed() -> None:
    # a loose bound only picks larger row blocks (and idle tile ids between segments)
    p = random_problem(SLICES["two"], seed=5)
    for max_seg_len in (p.max_seg_len + 1, 70):
        check_triton_vs_reference(p, max_seg_len=max_seg_len)


@needs_triton
@pytest.mark.parametrize("max_seg_len", [1, 37])
def test_triton_mixed_decode_and_prefill(max_seg_len: int) -> None:
    # A chunked-prefill step: decode tokens around a long segment, segments starting off the
    # 16/64-row block grid, empty segments in between. The kernels number only the M-blocks
    # that exist (compact tile ids), so every row is covered even with max_seg_len=1 (which
    # only picks 16-row blocks; the reference, given the true bound, is the oracle).
    seg_lens = [1] * 6 + [37] + [1, 0, 1, 1] + [20, 0]
    slots = [0, 2, -1, 1, 0, 2, 1, 2, 0, -1, 0, 2, 1]
    check_triton_vs_reference(make_problem(seg_lens, slots, [8, 16, 4], SLICES["three"]), max_seg_len=max_seg_len)


@needs_triton
def test_triton_expand_leaves_base_rows_bit_identical() -> None:
    # h is NaN everywhere but the LoRA segment's valid entries, and out's base rows hold
    # -0.0: a base row that read h, or was rewritten even as out + 0.0, would change
    p = make_problem([3, 4, 2], [-1, 0, -1], [8], (24, 8), dtype=torch.float16)
    p.out[:3, ::2] = -0.0
    p.out[7:, ::2] = -0.0
    h = torch.full((p.x.shape[0], 2 * p.max_rank), float("nan"), dtype=p.x.dtype, device=p.x.device)
    h[3:7, :8] = 1.0
    h[3:7, p.max_rank:p.max_rank + 8] = 1.0
    out0 = p.out.clone()
    from lora.kernels import sgmv

    sgmv.sgmv_expand(h, p.lora_b, p.out, p.seg_indptr, p.seg_slots, p.slot_ranks, **p.expand_kwargs())
    assert same_bits(p.out[:3], out0[:3]) and same_bits(p.out[7:], out0[7:])
    assert not torch.equal(p.out[3:7], out0[3:7]) and not p.out.isnan().any()


# --------------------------------------------------------------------- dispatch, checks


def test_cpu_tensors_take_the_reference_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops, "enabled", None)
    assert not ops.use_triton(torch.zeros(1)) and ops.use_triton(torch.zeros(1, device=DEVICE)) == ON_GPU
    p = random_problem(SLICES["two"], seed=6, device="cpu")
    h = ops.sgmv_shrink(*p.shrink_args(), **p.shrink_kwargs())
    assert torch.equal(h, ops.shrink_reference(*p.shrink_args(), **p.shrink_kwargs()))  # zeros: the reference
    out = p.out.clone()
    ops.sgmv_expand(h, p.lora_b, out, p.seg_indptr, p.seg_slots, p.slot_ranks, **p.expand_kwargs())
    ops.expand_reference(h, p.lora_b, p.out, p.seg_indptr, p.seg_slots, p.slot_ranks, **p.expand_kwargs())
    assert torch.equal(out, p.out)


def test_dispatch_to_triton_when_enabled(triton_on: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # the whole LoRA update through the public entry points, against the naive loop
    from lora.kernels import sgmv

    calls = []
    for name in ("sgmv_shrink", "sgmv_expand"):
        real = getattr(sgmv, name)

        def counted(*args, _real=real, _name=name, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(sgmv, name, counted)
    p = random_problem(SLICES["three"], seed=7)
    expected = naive_expand(p, naive_shrink(p))  # [T, N_out] float64
    h = ops.sgmv_shrink(*p.shrink_args(), **p.shrink_kwargs())
    ops.sgmv_expand(h, p.lora_b, p.out, p.seg_indptr, p.seg_slots, p.slot_ranks, **p.expand_kwargs())
    assert calls == ["sgmv_shrink", "sgmv_expand"]
    torch.testing.assert_close(p.out.double(), expected, rtol=1e-5, atol=1e-5)


def test_rejects_bad_arguments() -> None:
    p = make_problem([2, 3], [0, -1], [4], (8, 8), device="cpu")
    h = torch.zeros(5, 2 * p.max_rank)

    def shrink(**changes: object) -> None:
        args = dict(x=p.x, weights=p.lora_a, seg_indptr=p.seg_indptr, seg_slots=p.seg_slots,
                    slot_ranks=p.slot_ranks) | changes
        ops.sgmv_shrink(*args.values(), **p.shrink_kwargs())  # type: ignore[arg-type]

    def expand(slice_offsets: tuple[int, ...] = p.slice_offsets, **changes: object) -> None:
        args = dict(h=h, weights=p.lora_b, out=p.out, seg_indptr=p.seg_indptr, seg_slots=p.seg_slots,
                    slot_ranks=p.slot_ranks) | changes
        ops.sgmv_expand(*args.values(), slice_offsets=slice_offsets, max_rank=p.max_rank,  # type: ignore[arg-type]
                        max_seg_len=p.max_seg_len)

    with pytest.raises(ValueError, match="seg_indptr"):
        shrink(seg_indptr=p.seg_indptr.long())
    with pytest.raises(ValueError, match="seg_"):
        shrink(seg_slots=p.seg_slots[:1])
    with pytest.raises(ValueError, match="slot_ranks"):
        shrink(slot_ranks=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="weights"):
        shrink(weights=p.lora_a.half())
    with pytest.raises(ValueError, match="weights"):
        shrink(weights=p.lora_a[:, :-1])
    with pytest.raises(ValueError, match="contiguous"):
        shrink(x=torch.zeros(32, 5).t())
    with pytest.raises(ValueError, match="slice_offsets"):
        expand(slice_offsets=(0, 8, 15))
    with pytest.raises(ValueError, match="slices"):
        expand(slice_offsets=(0, 1, 2, 3, 4, 16))
    with pytest.raises(ValueError, match="h must be"):
        expand(h=torch.zeros(5, p.max_rank))
    with pytest.raises(ValueError, match="max_seg_len"):
        ops.sgmv_shrink(*p.shrink_args(), num_slices=2, max_rank=p.max_rank, max_seg_len=-1)


@pytest.mark.parametrize("use_kernels", [False, True] if HAS_TRITON else [False], ids=["reference", "triton"])
def test_empty_batches(use_kernels: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops, "enabled", use_kernels)
    for seg_lens, slots in (([], []), ([0, 0], [0, -1]), ([2], [-1])):
        p = make_problem(seg_lens, slots, [4], (8,))
        h = ops.sgmv_shrink(*p.shrink_args(), **p.shrink_kwargs())
        assert h.shape == (sum(seg_lens), p.max_rank)
        out0 = p.out.clone()
        ops.sgmv_expand(h, p.lora_b, p.out, p.seg_indptr, p.seg_slots, p.slot_ranks, **p.expand_kwargs())
        assert torch.equal(p.out, out0)


# ---------------------------------------------------------------------- GPU only (H200)


@needs_cuda
@pytest.mark.parametrize("split", [False, True], ids=["mixed", "split"])
def test_realistic_shape_bf16_gpu(split: bool) -> None:
    # Llama-3-8B qkv (4096 -> 4096 + 1024 + 1024), rank 16, 8 slots; 64 decode tokens (one
    # segment each) and a 512-token prefill, in one call (blocks sized by the prefill) or
    # split into a decode call and a prefill call (each with its own blocks).
    g = torch.Generator().manual_seed(11)
    decode_slots = torch.randint(-1, 8, (64,), generator=g).tolist()
    p = make_problem([1] * 64 + [512], decode_slots + [3], [16] * 8, (4096, 1024, 1024), hidden=4096,
                     dtype=torch.bfloat16)
    if not split:
        check_triton_vs_reference(p)
        return
    for lo, hi in ((0, 64), (64, 65)):
        start, end = int(p.seg_indptr[lo]), int(p.seg_indptr[hi])
        part = Problem(x=p.x[start:end], lora_a=p.lora_a, lora_b=p.lora_b, out=p.out[start:end].clone(),
                       seg_indptr=p.seg_indptr[lo:hi + 1] - start, seg_slots=p.seg_slots[lo:hi],
                       slot_ranks=p.slot_ranks, slice_offsets=p.slice_offsets, max_rank=16,
                       max_seg_len=1 if hi == 64 else 512)
        check_triton_vs_reference(part)


@needs_cuda
def test_cuda_graph_replay_with_new_segments() -> None:
    # Captured once, replayed after the segment tensors change in place (same shapes):
    # nothing on the host depends on device values.
    from lora.kernels import sgmv

    p = make_problem([1] * 8, [0, 1, -1, 2, 0, 3, 1, -1], [16, 8, 16, 4], (256, 64, 64), hidden=256,
                     dtype=torch.bfloat16)
    out = p.out.clone()
    kwargs = dict(max_rank=p.max_rank, max_seg_len=1)
    sgmv.sgmv_shrink(*p.shrink_args(), num_slices=3, **kwargs)  # compile outside the capture
    sgmv.sgmv_expand(p.h_valid().to(p.x.dtype), p.lora_b, out.clone(), p.seg_indptr, p.seg_slots, p.slot_ranks,
                     slice_offsets=p.slice_offsets, **kwargs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h = sgmv.sgmv_shrink(*p.shrink_args(), num_slices=3, **kwargs)
        sgmv.sgmv_expand(h, p.lora_b, out, p.seg_indptr, p.seg_slots, p.slot_ranks,
                         slice_offsets=p.slice_offsets, **kwargs)
    p.seg_slots.copy_(torch.tensor([3, -1, 0, 0, 2, 1, -1, 1], dtype=torch.int32))
    out.copy_(p.out)
    graph.replay()
    expected = p.out.clone()
    h_ref = ops.shrink_reference(*p.shrink_args(), num_slices=3, **kwargs)
    ops.expand_reference(h_ref, p.lora_b, expected, p.seg_indptr, p.seg_slots, p.slot_ranks,
                         slice_offsets=p.slice_offsets, **kwargs)
    torch.testing.assert_close(out, expected, **TOL[torch.bfloat16])
