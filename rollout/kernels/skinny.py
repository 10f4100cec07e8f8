"""Skinny matmul: y = x @ W^T (+ bias) for the one row of a batch-1 decode step, one
launch that streams W once.

At batch 1 a decode step is the weights read once (15 GB for Llama-3.1-8B), and the GEMVs
are most of the step. cuBLAS's GEMV reads them below the device's copy rate, furthest below
on the narrow qkv and o projections, and o and down add a split-K reduce kernel each
(BENCHMARKS.md, "Run 3 (H200, 2026-11-29): ..." and "Batch 1, H200, 2026-12-01 (issue #16
(b)): a one-row GEMV, ..."). This kernel cuts W's rows into blocks of BLOCK_N, one program
per block that walks the whole of K (no split-K, so no second kernel), with every load a
whole [BLOCK_N, BLOCK_K] tile in flight; the products accumulate elementwise in an fp32
tile, reduced once at the end (there is nothing for tensor cores to do at one row). The
output is rounded once, with the bias added in fp32 before, as cuBLAS's epilogue does: only
the order of the fp32 sums differs from cuBLAS.

Where PDL is available (rollout/kernels/pdl.py) it launches beside the tail of the kernel
before it and has its first tile of W in flight while that kernel finishes: W is written
by no kernel of a step, x is the only input it waits for.

`linear_silu_mul` is the gate_up projection with SiLU-mul as its epilogue: each program
takes rows j of gate and I + j of up, so it holds both halves of its outputs and writes
silu(gate) * up (rounded where fused.silu_and_mul rounds) instead of gate_up: the SiLU-mul
kernel and half of gate_up's writes are gone, and no work is repeated. `linear_rope_kv` is
the qkv projection with the rotary and the K/V store as its epilogue, the same pairing
within a head (rows j and D/2 + j): it writes q and k rotated, v as it is, and k and v into
the KV pool at the token's slot, bit-equal to the GEMV, then rotary.rotary_embedding with
its store (the rotary launch, one a layer, is gone). (Folding a kernel into the GEMV *after*
it, the norm before qkv or SiLU-mul before down, was measured and dropped: every program
then redid it over the whole row, BENCHMARKS.md "Batch 1, H200, 2026-12-01 (issue #16 (b)):
the K/V store inside the rotary, ...".)

Each form takes a low-rank term (`low_rank`: a LoRA adapter's, rollout/kernels/low_rank.py),
added to its rows before the epilogue: the adapter's B rows are loaded before the PDL wait
(no kernel of the step writes them) and the shrink's partial sums right after it, beside x's
first tile, so the epilogue waits on no load (loaded there, they lengthened every program;
BENCHMARKS.md, multi-LoRA, "H200, 2026-12-02: batch 1, the adapter's expand in the GEMV's
epilogue").
The delta `h . B[n]` is formed there too, before the K loop, so the loop holds one value a row
rather than h and B: the GEMV keeps its registers, and its programs an SM, with a term.

A form for 2-16 rows (tl.dot, rows padded to 16) was measured and dropped: at the default
tiles it lost to cuBLAS on gate_up and down, and the best tiles per shape won a little on
the narrow projections only (BENCHMARKS.md, "Batch 1, H200, 2026-12-01 (issue #16 (b)): a
one-row GEMV, ..."). The torch path (F.linear) is the reference; tests run the kernel under
TRITON_INTERPRET=1 on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rollout.kernels.pdl import launch as pdl_launch
from rollout.kernels.low_rank import MAX_SPLIT, LowRank

__all__ = ["RopeKV", "Tiles", "linear", "linear_rope_kv", "linear_silu_mul", "tiles_for"]

_DTYPES = (torch.float16, torch.bfloat16)
_MAX_LOW_RANK_SLICES = 3  # the epilogue finds a row's slice among q/k/v at most


@dataclass(frozen=True)
class Tiles:
    block_n: int  # W rows per program
    block_k: int  # K per load
    num_warps: int
    num_stages: int = 1


def tiles_for(n: int, k: int) -> Tiles:
    """The launch shape for x [1, k] @ W [n, k]^T, chosen by `python -m
    benchmarks.kernels.skinny`'s sweep: the best for Llama-3.1-8B's o and down, close to the
    best for gate_up, and with it a step's projections beat cuBLAS's (BENCHMARKS.md, "Batch 1,
    H200, 2026-12-01 (issue #16 (b)): a one-row GEMV, ...")."""
    return Tiles(block_n=4, block_k=1024, num_warps=2)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_w,
                 cos_ptr, sin_ptr, pos_ptr, kc_ptr, vc_ptr, slot_ptr, stride_cs, stride_kc0, stride_kc1,
                 stride_vc0, stride_vc1, n_q_heads, n_kv_heads,
                 lh_ptr, lb_ptr, lslot_ptr, lranks_ptr, stride_lbs, stride_lbn, l_off1, l_off2, l_split,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
                 SILU_MUL: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr,
                 LOW_RANK: tl.constexpr, L_COLS: tl.constexpr, L_MAX_RANK: tl.constexpr, L_SPLIT: tl.constexpr,
                 L_RANK_P2: tl.constexpr):
    pid = tl.program_id(0)
    lane = tl.arange(0, BLOCK_N)
    if SILU_MUL:  # W is [gate; up], N = 2I: rows j and I + j side by side (even and odd lanes)
        half = N // 2
        j = pid * (BLOCK_N // 2) + lane // 2
        rows = (tl.minimum(j, half - 1) + (lane % 2) * half).to(tl.int64)  # past I: re-read row I - 1's pair
    elif ROPE:  # W is qkv, heads of 2 HALF rows: pair p = (head, j) takes rows j and HALF + j of its head
        p = tl.minimum(pid * (BLOCK_N // 2) + lane // 2, N // 2 - 1)  # past N: re-read the last pair
        rows = ((p // HALF) * (2 * HALF) + p % HALF + (lane % 2) * HALF).to(tl.int64)
    else:
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        # rows past N (the last block of an N that BLOCK_N does not divide) re-read row N - 1, so
        # the loads need no row mask; their results are not stored
        rows = tl.minimum(rn, N - 1).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None] * stride_w + rk[None, :]
    full = K // BLOCK_K * BLOCK_K  # whole tiles go unmasked (a K mask would stop vector loads)
    # the first tile of W is in flight before the wait: no kernel of the step writes W
    first = (rk < full)[None, :]
    w = tl.load(w_ptrs, mask=first, other=0.0)
    if LOW_RANK:  # the adapter's B rows too (no kernel of the step writes them), masked past the rank
        l_b, l_h_ptrs, l_h_mask = _low_rank_start(rows, lb_ptr, lh_ptr, lslot_ptr, lranks_ptr, stride_lbs, stride_lbn,
                                                  l_off1, l_off2, l_split, L_COLS, L_MAX_RANK, L_SPLIT, L_RANK_P2)
    if USE_PDL:  # x is the output of the kernel right before this one (and h, with a low-rank term)
        tl.extra.cuda.gdc_wait()
    x0 = tl.load(x_ptr + rk, mask=rk < full, other=0.0)
    if LOW_RANK:  # h's partials in flight beside x's first tile, summed at once: no load left for the epilogue
        l_h = tl.sum(tl.load(l_h_ptrs, mask=l_h_mask, other=0.0), axis=1)
        # the delta now, so only [BLOCK_N] of it lives through the K loop: h and B held there took
        # 168 registers a thread against 128, 6 programs an SM instead of 8 (benchmarks/diagnostics/gemv_regs.py)
        l_delta = tl.sum(l_h * l_b, axis=1)
    # explicit FMAs: the same sums whether or not the launch lets the compiler contract (ROPE's does not)
    acc = w.to(tl.float32) * x0.to(tl.float32)[None, :]
    for k in range(BLOCK_K, full, BLOCK_K):
        w = tl.load(w_ptrs + k)
        acc = tl.fma(w.to(tl.float32), tl.load(x_ptr + k + rk).to(tl.float32)[None, :], acc)
    if full < K:
        kk = full + rk
        w = tl.load(w_ptrs + full, mask=(kk < K)[None, :], other=0.0)
        acc = tl.fma(w.to(tl.float32), tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)[None, :], acc)
    if USE_PDL:  # the next kernel may launch now (it waits for this one before reading y)
        tl.extra.cuda.gdc_launch_dependents()
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows).to(tl.float32)
    dtype = y_ptr.dtype.element_ty
    y = y.to(dtype).to(tl.float32)  # rounded as the matmul's output
    if LOW_RANK:  # then the adapter's delta, rounded once more as the in-place expand rounds
        y = (y + l_delta).to(dtype).to(tl.float32)
    if SILU_MUL:
        # gate_up rounded as the matmul's output is, then fused.silu_and_mul's two roundings
        gate, up = tl.split(tl.reshape(y, (BLOCK_N // 2, 2)))
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        jo = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(y_ptr + jo, (silu * up).to(dtype), mask=jo < half)
    elif ROPE:
        _rope_kv_epilogue(y, y_ptr, cos_ptr, sin_ptr, pos_ptr, kc_ptr, vc_ptr, slot_ptr,
                          stride_cs, stride_kc0, stride_kc1, stride_vc0, stride_vc1, n_q_heads, n_kv_heads,
                          pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2), N // 2, BLOCK_N, HALF)
    else:
        tl.store(y_ptr + rn, y.to(dtype), mask=rn < N)


@triton.jit
def _low_rank_start(rows, b_ptr, h_ptr, slot_ptr, ranks_ptr, stride_bs, stride_bn, off1, off2, n_split,
                    COLS: tl.constexpr, MAX_RANK: tl.constexpr, SPLIT: tl.constexpr, RANK_P2: tl.constexpr):
    """A low-rank term's loads for the program's rows (W's row indices: output columns), row n
    in slice j(n): b[slot, n, :] as fp32 [BLOCK_N, RANK_P2] (loaded now), and the pointers
    and mask of h's partials of its slice, [BLOCK_N, SPLIT, RANK_P2], to load once h is
    written. h is masked (zero) past the slot's rank, so slot -1 or rank 0 adds nothing
    (low_rank.LowRank).

    B's load waits for the slot alone, not for the rank after it: b is zero past each slot's
    rank (LoraPool.write zeroes a slot before filling it; LowRank's contract), so it needs no
    rank mask, and the rank is read beside it. A program's B otherwise trails W's first tile
    by two dependent reads, which every wave of programs after the first (PDL hides the
    first's) pays before its first FMA: gate_up's GEMV runs 7 waves at batch 1."""
    slot = tl.load(slot_ptr)  # written before the step, by no kernel of it
    rs = tl.arange(0, RANK_P2)
    b_ptrs = b_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_bs + rows[:, None] * stride_bn + rs[None, :]
    b = tl.load(b_ptrs, mask=(rs < tl.where(slot >= 0, MAX_RANK, 0))[None, :], other=0.0).to(tl.float32)
    rank = tl.where(slot >= 0, tl.load(ranks_ptr + tl.maximum(slot, 0)), 0)
    r_ok = rs < rank
    j = (rows >= off1).to(tl.int32) + (rows >= off2).to(tl.int32)  # [BLOCK_N] (unused slices: off = N)
    splits = tl.arange(0, SPLIT)
    h_ptrs = h_ptr + splits[None, :, None] * COLS + (j * MAX_RANK)[:, None, None] + rs[None, None, :]
    h_mask = (splits < n_split)[None, :, None] & r_ok[None, None, :]
    return b, h_ptrs, h_mask


@triton.jit
def _rope_kv_epilogue(y, y_ptr, cos_ptr, sin_ptr, pos_ptr, kc_ptr, vc_ptr, slot_ptr, stride_cs, stride_kc0,
                      stride_kc1, stride_vc0, stride_vc1, n_q_heads, n_kv_heads, pairs, n_pairs,
                      BLOCK_N: tl.constexpr, HALF: tl.constexpr):
    """y: this program's qkv outputs (rounded, as fp32), its pairs' two rows side by side.
    Rotates q's and k's pairs as rotary._rope_heads does (each product and sum rounded to the
    model dtype), passes v's through, writes all of qkv and stores k and v at the slot."""
    dtype = y_ptr.dtype.element_ty
    x1, x2 = tl.split(tl.reshape(y, (BLOCK_N // 2, 2)))
    valid = pairs < n_pairs
    head = pairs // HALF
    j = pairs % HALF
    rotated = head < n_q_heads + n_kv_heads  # q and k heads; v's come after
    pos = tl.load(pos_ptr).to(tl.int64)
    cos = tl.load(cos_ptr + pos * stride_cs + j, mask=valid & rotated, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cs + j, mask=valid & rotated, other=0.0).to(dtype).to(tl.float32)
    r1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    r2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    o1 = tl.where(rotated, r1, x1).to(dtype)
    o2 = tl.where(rotated, r2, x2).to(dtype)
    col = head * (2 * HALF) + j
    tl.store(y_ptr + col, o1, mask=valid)
    tl.store(y_ptr + col + HALF, o2, mask=valid)
    slot = tl.load(slot_ptr).to(tl.int64)
    is_k = valid & rotated & (head >= n_q_heads)
    is_v = valid & (head >= n_q_heads + n_kv_heads)
    # masked lanes' offsets may be negative: they are never dereferenced
    k_off = slot * stride_kc0 + (head - n_q_heads).to(tl.int64) * stride_kc1 + j
    v_off = slot * stride_vc0 + (head - n_q_heads - n_kv_heads).to(tl.int64) * stride_vc1 + j
    tl.store(kc_ptr + k_off, o1.to(kc_ptr.dtype.element_ty), mask=is_k)
    tl.store(kc_ptr + k_off + HALF, o2.to(kc_ptr.dtype.element_ty), mask=is_k)
    tl.store(vc_ptr + v_off, o1.to(vc_ptr.dtype.element_ty), mask=is_v)
    tl.store(vc_ptr + v_off + HALF, o2.to(vc_ptr.dtype.element_ty), mask=is_v)


def _check(name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           tiles: Tiles | None = None, pairs: str | None = None) -> None:
    """`pairs`: the epilogue's programs hold rows in pairs (what they pair, for the error), so
    tiles need an even block_n."""
    if pairs is not None and tiles is not None and tiles.block_n % 2:
        raise ValueError(f"skinny.{name}: tiles.block_n must be even ({pairs} in pairs), got {tiles.block_n}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"skinny.{name}: x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [M, K] and [N, K]")
    m, k = x.shape
    n = weight.shape[0]
    if m != 1:
        raise ValueError(f"skinny.{name}: x has {m} rows, expected 1")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"skinny.{name}: x, weight and bias must share float16 or bfloat16, got {x.dtype}, "
                         f"{weight.dtype}" + (f", {bias.dtype}" if bias is not None else ""))
    if (k > 1 and x.stride(1) != 1) or not weight.is_contiguous() or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"skinny.{name}: x must be contiguous in its last dim, weight contiguous and bias [{n}]")


@dataclass(frozen=True)
class RopeKV:
    """The qkv GEMV's rotary + KV-store epilogue: what rotary.rotary_embedding takes for
    one token (cos/sin tables [max_pos, head_dim / 2] fp32, positions and slots [1] on the
    device) and the layer's pool buffers [num_slots, n_kv_heads, head_dim]."""

    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slots: torch.Tensor
    n_q_heads: int
    n_kv_heads: int


def _check_low_rank(name: str, term: LowRank | None, weight: torch.Tensor) -> None:
    if term is None:
        return
    n, device = weight.shape[0], weight.device
    offs, r = term.slice_offsets, term.max_rank
    if not 1 <= term.num_slices <= _MAX_LOW_RANK_SLICES or offs[0] != 0 or offs[-1] != n \
            or any(lo > hi for lo, hi in zip(offs[:-1], offs[1:])) or r < 1:
        raise ValueError(f"skinny.{name}: low_rank needs 1..{_MAX_LOW_RANK_SLICES} slices rising from 0 to N={n} "
                         f"and max_rank >= 1, got slice_offsets={offs}, max_rank={r}")
    b, h, cols = term.b, term.h, term.num_slices * r
    if b.dim() != 3 or b.shape[1:] != (n, r) or b.stride(2) != 1 or b.dtype != weight.dtype or b.device != device:
        raise ValueError(f"skinny.{name}: low_rank.b must be [num_slots, {n}, {r}] {weight.dtype} contiguous in its "
                         f"last dim on {device}, got {tuple(b.shape)} {b.dtype} on {b.device}")
    if h.dim() != 2 or h.shape[1] != cols or not 1 <= h.shape[0] <= MAX_SPLIT or not h.is_contiguous() \
            or h.dtype != torch.float32 or h.device != device:
        raise ValueError(f"skinny.{name}: low_rank.h must be contiguous fp32 [1..{MAX_SPLIT}, {cols}] on "
                         f"{device}, got {tuple(h.shape)} {h.dtype} on {h.device}")
    for what, v, length in (("slot", term.slot, 1), ("ranks", term.ranks, b.shape[0])):
        if v.shape != (length,) or v.dtype != torch.int32 or v.device != device:
            raise ValueError(f"skinny.{name}: low_rank.{what} must be int32 [{length}] on {device}, got {v.dtype} "
                             f"{tuple(v.shape)} on {v.device}")


def _low_rank_args(term: LowRank | None, n: int, y: torch.Tensor) -> tuple[tuple, dict]:
    """The kernel's low-rank arguments and constexprs (valid pointers it never reads without a term)."""
    if term is None:
        return (y, y, y, y, 0, 0, n, n, 1), dict(LOW_RANK=False, L_COLS=1, L_MAX_RANK=1, L_SPLIT=1, L_RANK_P2=1)
    offs = list(term.slice_offsets[1:-1]) + [n] * (_MAX_LOW_RANK_SLICES - term.num_slices)
    b, h, r = term.b, term.h, term.max_rank
    args = (h, b, term.slot, term.ranks, b.stride(0), b.stride(1), offs[0], offs[1], h.shape[0])
    return args, dict(LOW_RANK=True, L_COLS=term.num_slices * r, L_MAX_RANK=r,
                      L_SPLIT=triton.next_power_of_2(h.shape[0]), L_RANK_P2=triton.next_power_of_2(r))


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tiles: Tiles | None,
            silu_mul: bool = False, rope: RopeKV | None = None, low_rank: LowRank | None = None,
            pdl: bool = True) -> torch.Tensor:
    n, k = weight.shape
    t = tiles or tiles_for(n, k)
    y = torch.empty(1, n // 2 if silu_mul else n, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(n, t.block_n),)
    b = bias if bias is not None else weight  # a valid pointer the kernel never reads
    if rope is None:  # valid pointers and strides the kernel never reads
        tables, kc, vc, ints, half, heads = (y, y), y, y, (y, y), 1, (0, 0)
        c_strides = (0, 0, 0, 0, 0)
    else:
        tables, kc, vc, ints = (rope.cos, rope.sin), rope.k_cache, rope.v_cache, (rope.positions, rope.slots)
        half, heads = rope.cos.shape[1], (rope.n_q_heads, rope.n_kv_heads)
        c_strides = (rope.cos.stride(0), kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1))
    l_args, l_consts = _low_rank_args(low_rank, n, y)
    _gemv_kernel[grid](x, weight, b, y, n, k, weight.stride(0), *tables, ints[0], kc, vc, ints[1], *c_strides, *heads,
                       *l_args, **l_consts,
                       HAS_BIAS=bias is not None, BLOCK_N=t.block_n, BLOCK_K=t.block_k, SILU_MUL=silu_mul,
                       ROPE=rope is not None, HALF=half, num_warps=t.num_warps, num_stages=t.num_stages,
                       # the rotary's products and sums round one by one, as in rotary._rope_heads: in 16
                       # bits the compiler would otherwise narrow them to half-precision FMAs; and a
                       # low-rank term sums the same way in every epilogue form (tests compare them)
                       enable_fp_fusion=rope is None and low_rank is None,
                       **pdl_launch(x.device, pdl))
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           tiles: Tiles | None = None, low_rank: LowRank | None = None, pdl: bool = True) -> torch.Tensor:
    """F.linear(x, weight, bias) for one row: x [1, K] @ weight [N, K]^T -> [1, N].

    x: [1, K], contiguous in its last dim; weight: contiguous [N, K];
    bias: [N] or None; all one float16/bfloat16 dtype on one device. `tiles`: the launch
    shape (default `tiles_for`; benchmarks pass others).
    `low_rank`: an adapter's term added in the epilogue (low_rank.LowRank says how). `pdl`: launch
    early where the GPU can (KernelOptions.pdl)."""
    _check("linear", x, weight, bias)
    _check_low_rank("linear", low_rank, weight)
    return _launch(x, weight, bias, tiles, low_rank=low_rank, pdl=pdl)


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    tiles: Tiles | None = None, low_rank: LowRank | None = None, pdl: bool = True) -> torch.Tensor:
    """fused.silu_and_mul(linear(x, weight, bias)) in one launch: weight [2I, K] is gate's rows
    then up's (the fused gate_up projection), the result [1, I]. Tiles need an even block_n.
    `low_rank`: an adapter's term, added to gate_up before the SiLU-mul."""
    _check("linear_silu_mul", x, weight, bias, tiles, pairs="gate and up rows")
    if weight.shape[0] % 2:
        raise ValueError(f"skinny.linear_silu_mul: weight must have an even number of rows (gate | up), "
                         f"got {weight.shape[0]}")
    _check_low_rank("linear_silu_mul", low_rank, weight)
    return _launch(x, weight, bias, tiles, silu_mul=True, low_rank=low_rank, pdl=pdl)


def linear_rope_kv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rope: RopeKV,
                   tiles: Tiles | None = None, low_rank: LowRank | None = None, pdl: bool = True) -> torch.Tensor:
    """The qkv projection of one token with the rotary and the KV store as its epilogue, in one
    launch: linear(x, weight, bias) -> [1, (H + 2 Hkv) D] with q's and k's heads rotated at
    rope.positions (rotary.rotary_embedding's result, bit for bit) and v's as they are, and
    the rotated k and v also written to rope.k_cache / v_cache at rope.slots (what the rotary
    with a store does). weight's rows are q's heads, then k's, then v's, D = 2 * the tables'
    width each. Positions and slots are not bounds-checked (a device sync). Tiles need an even
    block_n. `low_rank`: an adapter's term, added to qkv before the rotary."""
    _check("linear_rope_kv", x, weight, bias, tiles, pairs="a head's two halves")
    half = rope.cos.shape[1] if rope.cos.dim() == 2 else 0
    n_heads = rope.n_q_heads + 2 * rope.n_kv_heads
    if half < 1 or rope.sin.shape != rope.cos.shape or rope.cos.stride(0) != rope.sin.stride(0) \
            or rope.cos.stride(1) != 1 or rope.cos.dtype != torch.float32 or rope.sin.dtype != torch.float32 \
            or rope.cos.device != x.device or rope.sin.device != x.device:
        raise ValueError(f"skinny.linear_rope_kv: cos/sin must be fp32 [max_pos, D/2] with one row stride on "
                         f"{x.device}, got {tuple(rope.cos.shape)} {rope.cos.dtype} and {tuple(rope.sin.shape)} "
                         f"{rope.sin.dtype} on {rope.cos.device}")
    if rope.n_q_heads < 1 or rope.n_kv_heads < 1 or weight.shape[0] != n_heads * 2 * half:
        raise ValueError(f"skinny.linear_rope_kv: weight has {weight.shape[0]} rows, expected "
                         f"({rope.n_q_heads} + 2 x {rope.n_kv_heads}) heads x {2 * half}")
    cache_shape = (rope.n_kv_heads, 2 * half)
    for name, c in (("k_cache", rope.k_cache), ("v_cache", rope.v_cache)):
        if c.dim() != 3 or tuple(c.shape[1:]) != cache_shape or c.stride(2) != 1 or c.device != x.device:
            raise ValueError(f"skinny.linear_rope_kv: {name} must be [num_slots, {cache_shape[0]}, {cache_shape[1]}] "
                             f"contiguous in its last dim on {x.device}, got {tuple(c.shape)} on {c.device}")
    for name, v in (("positions", rope.positions), ("slots", rope.slots)):
        if v.shape != (1,) or v.dtype not in (torch.int32, torch.int64) or v.device != x.device:
            raise ValueError(f"skinny.linear_rope_kv: {name} must be int [1] on {x.device}, got {v.dtype} "
                             f"{tuple(v.shape)} on {v.device}")
    _check_low_rank("linear_rope_kv", low_rank, weight)
    return _launch(x, weight, bias, tiles, rope=rope, low_rank=low_rank, pdl=pdl)
