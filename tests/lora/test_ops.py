"""Multi-LoRA SGMV ops (lora.ops): the torch references against a naive per-token loop, the
Triton kernels (lora.kernels.sgmv) against the references (tiling choices: test_tiling.py).

Without CUDA the kernels run under Triton's CPU interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py before anything imports triton) on tiny shapes, in float32 and float16.
The interpreter's tl.dot multiplies bf16 bit patterns as integers (numpy has no bf16), so
bf16 is checked on a GPU only, together with realistic shapes and CUDA-graph replay.

The kernels' contract on what they leave alone is checked, not assumed: shrink is compared
only where it must write (its h comes from torch.empty), expand's h is poisoned with NaN
wherever shrink may leave it unwritten (padding positions, columns past a slot's rank) so
reading any of it shows up in out, and rows of out outside every segment are compared bit
for bit, -0.0 included (a rewrite as out + 0.0 would turn it into +0.0).

Tolerances: float32 1e-5 (fp32 accumulation in another order); float16/bfloat16 one or two
units in the last place of the output (the same fp32 sum rounded once, whose last fp32 bits
may differ - on a GPU expand multiplies in TF32 - can round to the neighbouring value).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from lora import ops
from lora.kernels import tiling
from rollout.kernels.options import KernelOptions
from rollout.model.lora_segments import plan_segments

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
    """One projection of a mixed batch: requests' tokens in rows, adapters in slots."""

    x: torch.Tensor  # [T, K]
    lora_a: torch.Tensor  # [S, num_slices * max_rank, K], zero past each slot's rank
    lora_b: torch.Tensor  # [S, N_out, max_rank], zero past each slot's rank
    out: torch.Tensor  # [T, N_out], the base projection's output
    row_ids: torch.Tensor  # int32 [R]
    seg_indptr: torch.Tensor  # int32 [G + 1]
    seg_slots: torch.Tensor  # int32 [G], -1 = none (padding)
    slot_ranks: torch.Tensor  # int32 [S]
    slice_offsets: tuple[int, ...]
    max_rank: int

    @property
    def num_slices(self) -> int:
        return len(self.slice_offsets) - 1

    def segments(self) -> tuple[torch.Tensor, ...]:
        return self.row_ids, self.seg_indptr, self.seg_slots, self.slot_ranks

    def shrink(self, fn: Any = None, **kw: Any) -> torch.Tensor:
        """`kw`: fn's own keywords (ops' `options`, the kernel's forced `split_k`)."""
        fn = fn or ops.sgmv_shrink
        return fn(self.x, self.lora_a, *self.segments(), num_slices=self.num_slices, max_rank=self.max_rank, **kw)

    def expand(self, h: torch.Tensor, out: torch.Tensor, fn: Any = None, **kw: Any) -> None:
        fn = fn or ops.sgmv_expand
        fn(h, self.lora_b, out, *self.segments(), slice_offsets=self.slice_offsets, max_rank=self.max_rank, **kw)

    def positions(self) -> list[tuple[int, int, int]]:
        """(position in row_ids, token row, rank) of every position that runs an adapter."""
        indptr, slots, rows = self.seg_indptr.tolist(), self.seg_slots.tolist(), self.row_ids.tolist()
        ranks = self.slot_ranks.tolist()
        return [(i, rows[i], ranks[slot]) for g, slot in enumerate(slots) if slot >= 0 and ranks[slot] > 0
                for i in range(indptr[g], indptr[g + 1])]

    def slot_of(self, position: int) -> int:
        return int(self.seg_slots[int(np.searchsorted(self.seg_indptr.cpu().numpy(), position, side="right")) - 1])

    def h_valid(self) -> torch.Tensor:
        """[R, num_slices * max_rank] bool: the entries of h that shrink must write."""
        valid = torch.zeros(self.row_ids.shape[0], self.num_slices, self.max_rank, dtype=torch.bool)
        for i, _, rank in self.positions():
            valid[i, :, :rank] = True
        return valid.view(self.row_ids.shape[0], -1).to(self.x.device)

    def untouched_rows(self) -> torch.Tensor:
        """[T] bool: rows of out that expand must leave alone (base rows, empty slots)."""
        touched = torch.zeros(self.x.shape[0], dtype=torch.bool)
        for _, row, _ in self.positions():
            touched[row] = True
        return (~touched).to(self.out.device)


def make_problem(slots: list[int], extend_lens: list[int], ranks: list[int], widths: tuple[int, ...], *,
                 hidden: int = 32, max_rank: int = 16, dtype: torch.dtype = torch.float32, seed: int = 0,
                 extra_rows: int = 0, extra_segments: int = 0, device: str = DEVICE) -> Problem:
    """Requests (slot, extend_len) planned by plan_segments, padded by extra rows / segments."""
    g = torch.Generator().manual_seed(seed)
    num_slots, num_slices, n_out = len(ranks), len(widths), sum(widths)
    num_tokens = sum(extend_lens)
    # Scaled so h and the LoRA delta are O(1): absolute tolerances then mean what they say.
    x = torch.randn(num_tokens, hidden, generator=g)
    lora_a = torch.randn(num_slots, num_slices, max_rank, hidden, generator=g) / hidden**0.5
    lora_b = torch.randn(num_slots, n_out, max_rank, generator=g) / max_rank**0.5
    for slot, rank in enumerate(ranks):  # padding past the rank is zero by contract
        lora_a[slot, :, rank:] = 0
        lora_b[slot, :, rank:] = 0
    out = torch.randn(num_tokens, n_out, generator=g)
    base = plan_segments(slots, extend_lens)
    plan = plan_segments(slots, extend_lens, num_rows=base.num_rows + extra_rows,
                         num_segments=base.num_segments + extra_segments)
    offsets = tuple(int(v) for v in np.cumsum((0,) + widths))

    def floats(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype)

    def ints(a: np.ndarray | list[int]) -> torch.Tensor:
        return torch.as_tensor(np.asarray(a, dtype=np.int32), device=device)

    return Problem(
        x=floats(x), lora_a=floats(lora_a.view(num_slots, num_slices * max_rank, hidden)), lora_b=floats(lora_b),
        out=floats(out), row_ids=ints(plan.row_ids), seg_indptr=ints(plan.seg_indptr),
        seg_slots=ints(plan.seg_slots), slot_ranks=ints(ranks), slice_offsets=offsets, max_rank=max_rank,
    )


def random_problem(widths: tuple[int, ...], *, seed: int, max_rank: int = 16, ranks: list[int] | None = None,
                   num_requests: int = 9, max_len: int = 5, **kwargs: Any) -> Problem:
    """Random requests: base (-1) ones, empty ones, repeated slots, an empty slot (rank 0)."""
    g = torch.Generator().manual_seed(seed)
    ranks = [8, max_rank, 4, 0] if ranks is None else ranks
    lens = torch.randint(0, max_len + 1, (num_requests,), generator=g).tolist()
    slots = torch.randint(-1, len(ranks), (num_requests,), generator=g).tolist()
    slots[0], lens[0] = -1, max(lens[0], 1)  # always a base row
    slots[1], lens[1] = 0, max(lens[1], 1)  # and a LoRA one
    return make_problem(slots, lens, ranks, widths, max_rank=max_rank, seed=seed, **kwargs)


def poisoned(h: torch.Tensor, p: Problem) -> torch.Tensor:
    """h with NaN wherever shrink may leave it unwritten: expand must never read there."""
    return torch.where(p.h_valid(), h, torch.full_like(h, float("nan")))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality: a rewrite of out + 0.0 turns -0.0 into +0.0, which == misses."""
    as_int = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(as_int), b.view(as_int))


@pytest.fixture
def triton_on() -> KernelOptions:
    """Options that route the dispatchers to the kernels, also for CPU tensors (the interpreter)."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    return KernelOptions(lora_triton=True)


# --------------------------------------------------------------- naive per-token loop


def naive_shrink(p: Problem) -> torch.Tensor:
    """float64 h [R, num_slices * max_rank], one position and one slice at a time; zeros
    where nothing is defined."""
    h = torch.zeros(p.row_ids.shape[0], p.num_slices, p.max_rank, dtype=torch.float64)
    a = p.lora_a.cpu().double().view(p.lora_a.shape[0], p.num_slices, p.max_rank, -1)
    for i, row, rank in p.positions():
        for j in range(p.num_slices):
            h[i, j, :rank] = a[p.slot_of(i), j, :rank] @ p.x[row].cpu().double()
    return h.view(p.row_ids.shape[0], -1)


def naive_expand(p: Problem, h: torch.Tensor) -> torch.Tensor:
    """float64 out + delta, one position and one slice at a time; h: [R, N] (summed)."""
    out = p.out.cpu().double().clone()
    h3 = h.cpu().double().view(h.shape[0], p.num_slices, p.max_rank)
    for i, row, rank in p.positions():
        for j in range(p.num_slices):
            lo, hi = p.slice_offsets[j], p.slice_offsets[j + 1]
            out[row, lo:hi] += p.lora_b[p.slot_of(i), lo:hi, :rank].cpu().double() @ h3[i, j, :rank]
    return out


@pytest.mark.parametrize("max_rank", [16, 32], ids=lambda r: f"max_rank{r}")
@pytest.mark.parametrize("slices", list(SLICES), ids=str)
@pytest.mark.parametrize("seed", [0, 1])
def test_reference_matches_naive_loop(slices: str, max_rank: int, seed: int) -> None:
    # max_rank 32 > every rank (8, 16, 4, 0): padding rows of A / columns of B never count;
    # seed 1 pads the plan (padding positions and empty segments are never read)
    p = random_problem(SLICES[slices], seed=seed, max_rank=max_rank, extra_rows=3 * seed, extra_segments=2 * seed,
                       device="cpu")
    h = p.shrink(ops.shrink_reference)
    assert h.shape == (1, p.row_ids.shape[0], p.num_slices * p.max_rank) and h.dtype == torch.float32
    torch.testing.assert_close(h[0].double(), naive_shrink(p), rtol=1e-5, atol=1e-5)  # zeros off the valid entries

    out0, expected = p.out.clone(), naive_expand(p, h[0])
    p.expand(poisoned(h, p), p.out, ops.expand_reference)
    torch.testing.assert_close(p.out.double(), expected, rtol=1e-5, atol=1e-5)
    untouched = p.untouched_rows()
    assert untouched.any() and same_bits(p.out[untouched], out0[untouched])


def test_reference_sums_split_partials() -> None:
    # h from the kernels has SPLIT_K partials: the reference expand sums them too
    p = random_problem(SLICES["two"], seed=2, device="cpu")
    h = p.shrink(ops.shrink_reference)
    parts = torch.randn((3,) + h.shape[1:], generator=torch.Generator().manual_seed(2))
    split = torch.cat([parts, h - parts.sum(0, keepdim=True)])  # [4, R, N] summing to h
    out = p.out.clone()
    p.expand(h, out, ops.expand_reference)
    p.expand(poisoned(split, p), p.out, ops.expand_reference)
    torch.testing.assert_close(p.out, out, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------- Triton vs the reference


def check_triton_vs_reference(p: Problem, split_k: int | None = None, block_n: int | None = None) -> None:
    """Shrink's written entries and expand's whole out against the references; untouched
    rows of out bit-identical (never rewritten), h's unwritten entries never read. `split_k`,
    `block_n`: the kernels' forced split and column block (None: from the shapes)."""
    from lora.kernels import sgmv

    tol = TOL[p.x.dtype]
    valid = p.h_valid()
    h = p.shrink(sgmv.sgmv_shrink, split_k=split_k)
    h_ref = p.shrink(ops.shrink_reference)
    assert h.dtype == torch.float32 and h.shape[1:] == h_ref.shape[1:] and h.is_contiguous()
    torch.testing.assert_close(h.sum(0)[valid], h_ref[0][valid], **tol)

    out, out_ref = p.out.clone(), p.out.clone()
    p.expand(poisoned(h, p), out, sgmv.sgmv_expand, block_n=block_n)
    p.expand(h_ref, out_ref, ops.expand_reference)
    torch.testing.assert_close(out, out_ref, **tol)
    untouched = p.untouched_rows()
    assert same_bits(out[untouched], p.out[untouched]), "rows outside every segment must not be rewritten"


@pytest.fixture
def gpu_tiling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tile as for a 132-SM GPU (narrow blocks, many programs) rather than the
    interpreter's few wide ones: covers column blocks skipped past the rank."""
    from lora.kernels import sgmv

    monkeypatch.setattr(sgmv, "_num_sms", lambda device: tiling.DEFAULT_NUM_SMS)


@needs_triton
@pytest.mark.parametrize("slices,dtype", [(slices, torch.float32) for slices in SLICES]
                         + [("three", dtype) for dtype in DTYPES[1:]], ids=str)
def test_triton_matches_reference(slices: str, dtype: torch.dtype) -> None:
    check_triton_vs_reference(random_problem(SLICES[slices], seed=3, dtype=dtype))


@needs_triton
@pytest.mark.parametrize("split_k,hidden", [(2, 384), (3, 80), (5, 80)], ids=str)
def test_triton_split_k(split_k: int, hidden: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # K=384 in 128-wide steps: splits of 256 and 128, the last one a step short (unmasked);
    # K=80 in 32- and 16-wide steps: 32/32/16 and 16 x 5 (masked). Expand sums the partials
    # two at a time (a small register budget), the last pair half past SPLIT_K.
    from lora.kernels import sgmv

    monkeypatch.setattr(tiling, "PARTIALS_TILE", 2 * 16 * 16)
    p = random_problem(SLICES["three"], seed=4, hidden=hidden)
    assert p.shrink(sgmv.sgmv_shrink, split_k=split_k).shape[0] == split_k
    assert tiling.expand_tiling(p.row_ids.shape[0], p.seg_slots.shape[0], (32, 12, 12), 16, split_k).split_chunk == 2
    check_triton_vs_reference(p, split_k=split_k)


@needs_triton
def test_triton_split_k_with_a_ragged_k() -> None:
    # K=40 is no multiple of the 16-wide step: the last split's last step is masked
    check_triton_vs_reference(random_problem(SLICES["two"], seed=5, hidden=40, dtype=torch.float16), split_k=2)


@needs_triton
@pytest.mark.parametrize("max_rank", [16, 32], ids=lambda r: f"max_rank{r}")
def test_triton_gpu_tiling_and_ranks_below_max_rank(max_rank: int, gpu_tiling: None) -> None:
    # 16-column shrink blocks: those past a slot's rank return at once (rank 24 of 32 keeps
    # the block at 16-31, masked past 24); expand's rank loop stops at the rank; 0: empty slot
    ranks = [8, max_rank - 8 if max_rank > 16 else 16, 4, 0]
    check_triton_vs_reference(random_problem(SLICES["three"], seed=6, max_rank=max_rank, ranks=ranks))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_decode_plan_padded_for_a_graph(dtype: torch.dtype) -> None:
    # decode: one row per request, slots interleaved, plan padded like a CUDA graph's buffers
    slots = [0, 2, -1, 1, 0, -1, 3, 2, 1, 0]
    p = make_problem(slots, [1] * len(slots), [8, 16, 4, 0], SLICES["three"], dtype=dtype, extra_rows=2,
                     extra_segments=3)
    check_triton_vs_reference(p)


@needs_triton
def test_triton_padding_does_not_change_the_answer() -> None:
    # one split so both plans add in the same order: padded and unpadded agree to rounding
    from lora.kernels import sgmv

    outs = []
    for extra_rows, extra_segments in ((0, 0), (5, 4)):
        p = random_problem(SLICES["two"], seed=7, extra_rows=extra_rows, extra_segments=extra_segments)
        p.expand(p.shrink(sgmv.sgmv_shrink, split_k=1), p.out, sgmv.sgmv_expand)
        outs.append(p.out)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)


@needs_triton
def test_triton_more_segments_than_one_lookup_block(monkeypatch: pytest.MonkeyPatch) -> None:
    # a program finds its segment _MAX_BLOCK_G (128) segments at a time; with 8, 11 slots
    # padded to 20 segments take three vector loads
    from lora.kernels import sgmv

    monkeypatch.setattr(sgmv, "_MAX_BLOCK_G", 8)
    g = torch.Generator().manual_seed(8)
    slots = torch.randint(-1, 11, (24,), generator=g).tolist()
    lens = torch.randint(0, 3, (24,), generator=g).tolist()
    ranks = [8, 16, 4, 16, 8, 0, 4, 8, 16, 4, 8]
    p = make_problem(slots, lens, ranks, (16,), hidden=16, extra_segments=20 - len(set(slots) - {-1}))
    assert p.seg_slots.shape[0] == 20
    check_triton_vs_reference(p)


@needs_triton
def test_triton_long_segments() -> None:
    # prefill: 64-row tiles (R/G ~ 30), a slot whose rows span two tiles and two requests
    # (rows 0-69 and 93-112), segments starting off the tile grid; K=40 not a multiple of the step
    p = make_problem([1, -1, 2, 1, 0], [70, 3, 20, 20, 1], [8, 16, 4], SLICES["three"], hidden=40)
    check_triton_vs_reference(p)


@needs_triton
def test_triton_expand_leaves_untouched_rows_bit_identical() -> None:
    # h is NaN everywhere but the LoRA positions' valid entries, and out's other rows hold
    # -0.0: a row that read h, or was rewritten even as out + 0.0, would change
    from lora.kernels import sgmv

    p = make_problem([-1, 0, -1], [3, 4, 2], [8], (24, 8), dtype=torch.float16, extra_rows=2, extra_segments=1)
    p.out[:3, ::2] = -0.0
    p.out[7:, ::2] = -0.0
    h = torch.full((2, p.row_ids.shape[0], 2 * p.max_rank), float("nan"), device=p.x.device)
    h[:, :4, :8] = 0.5
    h[:, :4, p.max_rank:p.max_rank + 8] = 0.5
    out0 = p.out.clone()
    p.expand(h, p.out, sgmv.sgmv_expand)
    assert same_bits(p.out[:3], out0[:3]) and same_bits(p.out[7:], out0[7:])
    assert not torch.equal(p.out[3:7], out0[3:7]) and not p.out.isnan().any()


# --------------------------------------------------------------------- dispatch, checks


def test_cpu_tensors_take_the_reference_by_default() -> None:
    automatic = KernelOptions(lora_triton=None)  # whatever ROLLOUT_LORA_TRITON says
    assert not ops.use_triton(torch.zeros(1)) and ops.use_triton(torch.zeros(1, device=DEVICE)) == ON_GPU
    p = random_problem(SLICES["two"], seed=9, device="cpu")
    h = p.shrink(options=automatic)
    assert torch.equal(h, p.shrink(ops.shrink_reference))  # zeros where unwritten: the reference
    out = p.out.clone()
    p.expand(h, out, options=automatic)
    p.expand(h, p.out, ops.expand_reference)
    assert torch.equal(out, p.out)


def test_dispatch_to_triton_when_enabled(triton_on: KernelOptions, monkeypatch: pytest.MonkeyPatch) -> None:
    # the whole LoRA update through the public entry points, against the naive loop
    from lora.kernels import sgmv

    calls = []
    for name in ("sgmv_shrink", "sgmv_expand"):
        real = getattr(sgmv, name)

        def counted(*args, _real=real, _name=name, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(sgmv, name, counted)
    p = random_problem(SLICES["three"], seed=10)
    expected = naive_expand(p, naive_shrink(p))  # [T, N_out] float64, on the CPU
    p.expand(p.shrink(options=triton_on), p.out, options=triton_on)
    assert calls == ["sgmv_shrink", "sgmv_expand"]
    torch.testing.assert_close(p.out.cpu().double(), expected, rtol=1e-5, atol=1e-5)


def test_rejects_bad_arguments() -> None:
    p = make_problem([0, -1], [2, 3], [4], (8, 8), device="cpu")
    h = torch.zeros(1, 2, 2 * p.max_rank)

    def shrink(**changes: object) -> None:
        args = dict(x=p.x, weights=p.lora_a, row_ids=p.row_ids, seg_indptr=p.seg_indptr, seg_slots=p.seg_slots,
                    slot_ranks=p.slot_ranks) | changes
        ops.sgmv_shrink(*args.values(), num_slices=2, max_rank=p.max_rank)  # type: ignore[arg-type]

    def expand(slice_offsets: tuple[int, ...] = p.slice_offsets, **changes: object) -> None:
        args = dict(h=h, weights=p.lora_b, out=p.out, row_ids=p.row_ids, seg_indptr=p.seg_indptr,
                    seg_slots=p.seg_slots, slot_ranks=p.slot_ranks) | changes
        ops.sgmv_expand(*args.values(), slice_offsets=slice_offsets, max_rank=p.max_rank)  # type: ignore[arg-type]

    with pytest.raises(ValueError, match="row_ids"):
        shrink(row_ids=p.row_ids.long())
    with pytest.raises(ValueError, match="seg_indptr"):
        shrink(seg_indptr=p.seg_indptr.long())
    with pytest.raises(ValueError, match="seg_"):
        shrink(seg_slots=torch.zeros(2, dtype=torch.int32))
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
        expand(h=torch.zeros(1, 3, 2 * p.max_rank))  # R must match row_ids
    with pytest.raises(ValueError, match="h must be"):
        expand(h=h.half())  # h is shrink's fp32 partials
    with pytest.raises(ValueError, match="h must be"):
        expand(h=h[0])  # with its split dim
    with pytest.raises(ValueError, match="h must be"):
        expand(h=torch.zeros(1, 4, 2 * p.max_rank)[:, ::2])  # rows not dense


@pytest.mark.parametrize("use_kernels", [False, True] if HAS_TRITON else [False], ids=["reference", "triton"])
def test_batches_without_lora_rows(use_kernels: bool) -> None:
    options = KernelOptions(lora_triton=use_kernels)
    cases = (([], [], 0, 0), ([-1, -1], [2, 1], 0, 0), ([-1], [2], 2, 2), ([0, 1], [0, 0], 1, 1), ([0], [2], 0, 0))
    for slots, lens, extra_rows, extra_segments in cases:
        ranks = [0] if slots == [0] else [4, 4]  # the last case: a slot of rank 0 (cleared)
        p = make_problem(slots, lens, ranks, (8,), extra_rows=extra_rows, extra_segments=extra_segments)
        h = p.shrink(options=options)
        assert h.shape[1:] == (p.row_ids.shape[0], p.max_rank)
        out0 = p.out.clone()
        p.expand(h, p.out, options=options)
        assert same_bits(p.out, out0)


# ---------------------------------------------------------------------- GPU only (H200)


@needs_cuda
@pytest.mark.parametrize("batch", ["mixed", "decode256"])
def test_realistic_shape_bf16_gpu(batch: str) -> None:
    # Llama-3-8B qkv (4096 -> 4096 + 1024 + 1024), rank 16, 8 slots: 64 decode requests
    # (some base) and a 512-token prefill in one call, or a decode batch of 256 padded like a graph
    g = torch.Generator().manual_seed(11)
    if batch == "mixed":
        slots = torch.randint(-1, 8, (65,), generator=g).tolist()
        lens = [1] * 64 + [512]
    else:
        slots, lens = torch.randint(-1, 8, (256,), generator=g).tolist(), [1] * 256
    p = make_problem(slots, lens, [16] * 8, (4096, 1024, 1024), hidden=4096, dtype=torch.bfloat16,
                     extra_segments=1, extra_rows=3)
    check_triton_vs_reference(p)


@needs_cuda
@pytest.mark.parametrize("num_requests", [1, 16])
def test_cuda_graph_replay_with_new_segments(num_requests: int) -> None:
    # Captured once with a plan padded to fixed sizes, replayed after the plan's contents
    # change in place (other slots, fewer LoRA rows): nothing on the host depends on them.
    from lora.kernels import sgmv

    ranks = [16, 8, 16, 4]
    first = [0, 1, -1, 2] * (num_requests // 4) if num_requests > 1 else [1]
    second = [3, -1, 0, 0] * (num_requests // 4) if num_requests > 1 else [-1]
    kw = dict(extra_rows=sum(s < 0 for s in first), extra_segments=len(ranks), hidden=4096, dtype=torch.bfloat16)
    p = make_problem(first, [1] * num_requests, ranks, (4096, 1024, 1024), **kw)
    out = p.out.clone()
    p.expand(p.shrink(sgmv.sgmv_shrink), out.clone(), sgmv.sgmv_expand)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        p.expand(p.shrink(sgmv.sgmv_shrink), out, sgmv.sgmv_expand)
    for slots in (second, first):
        plan = plan_segments(slots, [1] * num_requests, num_rows=p.row_ids.shape[0],
                             num_segments=p.seg_slots.shape[0])
        for dst, src in zip((p.row_ids, p.seg_indptr, p.seg_slots), (plan.row_ids, plan.seg_indptr, plan.seg_slots)):
            dst.copy_(torch.from_numpy(src))
        out.copy_(p.out)
        graph.replay()
        expected = p.out.clone()
        p.expand(p.shrink(ops.shrink_reference), expected, ops.expand_reference)
        torch.testing.assert_close(out, expected, **TOL[torch.bfloat16])
        untouched = p.untouched_rows()
        assert same_bits(out[untouched], p.out[untouched])
