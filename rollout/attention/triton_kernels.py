"""Triton paged-attention kernels over slot-level (page_size=1) KV indices.

KV layout: per layer ``k_cache`` / ``v_cache`` are ``[num_slots, num_kv_heads, head_dim]``.
Request b's KV slots, in position order, are ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``.

* ``decode_attention``: one query token per request, split-KV (flash-decoding) in two
  stages; stage 1 handles a whole GQA group per program so each K/V row is read once
  per group, stage 2 merges the per-split partial results by their log-sum-exp.
* ``extend_attention``: many new tokens per request (prefill / extend), causal with a
  fully visible cached prefix, flash-attention style tiled online softmax.

Both accumulate in float32 and compute the softmax in base 2 (``exp2`` is a single
MUFU instruction on NVIDIA; the ``log2(e)`` factor is folded into the scale).
Tuned for sm90 + bf16; also run under ``TRITON_INTERPRET=1`` on CPU for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout.attention.prefix_kernel import launch_prefix, prefix_config
from rollout.batch import SharedPrefixes
from rollout.kernels.pdl import launch as pdl_launch
from rollout.kernels.pdl_device import launch_next_then_wait

__all__ = ["decode_attention", "extend_attention"]

_LOG2E = 1.4426950408889634
_MAX_HEAD_DIM = 256
_MAX_KV_SPLITS = 64
_MIN_KV_PER_SPLIT = 256  # below this a split's fixed cost (stage-2 merge, launch tail) dominates
# Decode's two stages launch early where PDL is available (rollout/kernels/pdl.py; `pdl`:
# KernelOptions.pdl and pdl_rotary_attention): stage 1 beside the rotary that stores the new
# K/V, stage 2 beside stage 1, and the o projection's GEMV beside stage 2. At batch 1 these
# kernels take little longer than a launch, so each launch hidden counts.


def _block_d(head_dim: int) -> int:
    # tl.dot needs every dim >= 16 and power-of-two blocks; other head dims are masked.
    if not 1 <= head_dim <= _MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {_MAX_HEAD_DIM}], got {head_dim}")
    return max(16, triton.next_power_of_2(head_dim))


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would default to TF32 on tensor cores (~1e-3 error); keep them exact.
    # For bf16/fp16 the option is ignored.
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_common(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    num_heads, head_dim = q.shape[-2], q.shape[-1]
    if k_cache.dim() != 3 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache/v_cache must be equal [num_slots, kv_heads, head_dim], got "
                         f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    num_kv_heads = k_cache.shape[1]
    if k_cache.shape[2] != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(f"q heads/dim {num_heads}/{head_dim} incompatible with kv cache {tuple(k_cache.shape)}")
    if q.dtype != k_cache.dtype or q.dtype != v_cache.dtype:
        raise ValueError(f"dtype mismatch: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:  # kernels index rows by strides but read head_dim contiguously
            raise ValueError(f"{name} must be contiguous in its last dim")
    return num_heads, num_kv_heads, head_dim


def _prepare_out(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError("out must match q in shape, dtype and device and be contiguous in its last dim")
    return out


def _on_gpu(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


_SM_COUNT: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: a token value, tests pass num_kv_splits explicitly
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _decode_config(block_d: int, dtype: torch.dtype, gpu: bool) -> tuple[int, dict[str, int]]:
    """(BLOCK_N, launch kwargs) for decode stage 1, the tiles a bf16 sweep chose
    (benchmarks.kernels.decode_attention times them)."""
    if not gpu:
        return 16, {}  # interpreter: small blocks so tiny tests cross several blocks
    if dtype == torch.float32:
        return 32, {"num_warps": 4, "num_stages": 2}  # 4-byte K/V: halve the staged tiles
    # ~32 KB of K+V per iteration keeps enough bytes in flight to stream the KV near the copy rate.
    if block_d <= 64:
        return 128, {"num_warps": 4, "num_stages": 2}
    return 64, {"num_warps": 4, "num_stages": 2 if block_d <= 128 else 3}


def _extend_config(block_d: int, dtype: torch.dtype, gpu: bool) -> tuple[int, int, dict[str, int]]:
    """(BLOCK_M, BLOCK_N, launch kwargs) for extend, the tiles a bf16 sweep chose."""
    if not gpu:
        return 16, 16, {}  # interpreter: small tiles so tiny tests cover several tiles
    if dtype == torch.float32:
        return 64, 32, {"num_warps": 4, "num_stages": 2}  # fits shared memory up to d=256
    if block_d <= 64:
        return 64, 64, {"num_warps": 4, "num_stages": 3}
    if block_d <= 128:
        return 128, 64, {"num_warps": 4, "num_stages": 2}
    return 128, 64, {"num_warps": 8, "num_stages": 3}


# --------------------------------------------------------------------------------------
# Decode
# --------------------------------------------------------------------------------------


@triton.jit
def _decode_stage1_kernel(
    Q, K, V, kv_indptr, kv_indices, kv_skip, MidO, MidLse,
    qk_scale,  # sm_scale * log2(e)
    stride_qb, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
    num_kv_splits,
    GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr, HAS_SKIP: tl.constexpr,
):
    if USE_PDL:
        launch_next_then_wait()
    b = tl.program_id(0)
    hb = tl.program_id(1)  # head block: kv head * HEAD_BLOCKS + block within the group
    split = tl.program_id(2)
    kvh = hb // HEAD_BLOCKS
    # Query heads of this GQA group handled here, padded to BLOCK_H (>= 16) rows so the
    # q.k and p.v products run on tensor cores; padded rows are masked on load/store.
    local_h = (hb % HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = local_h < GROUP
    offs_h = kvh * GROUP + local_h
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    kv_start = tl.load(kv_indptr + b)
    kv_len = tl.load(kv_indptr + b + 1) - kv_start
    if HAS_SKIP:  # the row's first kv_skip[b] tokens are a shared prefix, attended apart (prefix_kernel.py)
        skip = tl.load(kv_skip + b)
        kv_start += skip
        kv_len -= skip
    # Split length rounded up to BLOCK_N so no split wastes a partly-masked block in the
    # middle; stage 2 recomputes the same bounds to know which splits are non-empty.
    per_split = tl.cdiv(tl.cdiv(kv_len, num_kv_splits), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, kv_len)

    if hi > lo:
        q_ptrs = Q + b * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=mask_h[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < hi
            # int64 before multiplying by the slot stride: caches can exceed 2^31 elements.
            slot = tl.load(kv_indices + kv_start + offs_n, mask=mask_n, other=0).to(tl.int64)
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(K + slot[:, None] * stride_kn + kvh * stride_kh + offs_d[None, :],
                        mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N]
            s = tl.where(mask_n[None, :], s, float("-inf"))
            # Every block has >= 1 valid column (n0 < hi), so m_new is finite.
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + slot[:, None] * stride_vn + kvh * stride_vh + offs_d[None, :],
                        mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        o_ptrs = MidO + b * stride_mob + offs_h[:, None] * stride_moh + split * stride_mos + offs_d[None, :]
        tl.store(o_ptrs, acc / l_i[:, None], mask=mask_h[:, None] & mask_d[None, :])
        # log2-domain LSE of this split's scores (stage 2 weights splits by exp2 of it).
        tl.store(MidLse + b * stride_mlb + offs_h * stride_mlh + split, m_i + tl.log2(l_i), mask=mask_h)


@triton.jit
def _merge_split(acc, l_i, m_i, o, lse):
    # one split's normalised output o and log2-LSE into the running (acc, l, m)
    m_new = tl.maximum(m_i, lse)
    old_scale = tl.exp2(m_i - m_new)
    w = tl.exp2(lse - m_new)
    return acc * old_scale + o * w, l_i * old_scale + w, m_new


@triton.jit
def _decode_stage2_kernel(
    MidO, MidLse, Out, kv_indptr, kv_skip,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
    num_kv_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr,
    HAS_SKIP: tl.constexpr, PRE_SPLITS: tl.constexpr, PRE_BLOCK_N: tl.constexpr,
):
    if USE_PDL:
        launch_next_then_wait()
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    kv_len = tl.load(kv_indptr + b + 1) - tl.load(kv_indptr + b)
    skip = 0
    if HAS_SKIP:
        skip = tl.load(kv_skip + b)
        kv_len -= skip
    per_split = tl.cdiv(tl.cdiv(kv_len, num_kv_splits), BLOCK_N) * BLOCK_N

    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in range(0, num_kv_splits):
        # Empty splits were never written by stage 1 (the workspace is uninitialised).
        if s * per_split < kv_len:
            o = tl.load(MidO + b * stride_mob + h * stride_moh + s * stride_mos + offs_d, mask=mask_d, other=0.0)
            lse = tl.load(MidLse + b * stride_mlb + h * stride_mlh + s)
            acc, l_i, m_i = _merge_split(acc, l_i, m_i, o, lse)
    if HAS_SKIP:
        # The shared prefix's splits follow the row's own (prefix_kernel.py writes them, with
        # the same split bounds): merged by the same log-sum-exp weights.
        per_pre = tl.cdiv(tl.cdiv(skip, PRE_SPLITS), PRE_BLOCK_N) * PRE_BLOCK_N
        for s in range(0, PRE_SPLITS):
            if s * per_pre < skip:
                at = num_kv_splits + s
                o = tl.load(MidO + b * stride_mob + h * stride_moh + at * stride_mos + offs_d, mask=mask_d, other=0.0)
                lse = tl.load(MidLse + b * stride_mlb + h * stride_mlh + at)
                acc, l_i, m_i = _merge_split(acc, l_i, m_i, o, lse)
    # kv_len == 0 (no KV at all) yields zeros instead of 0/0.
    res = tl.where(l_i > 0, acc / tl.maximum(l_i, 1e-30), 0.0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, res.to(Out.dtype.element_ty), mask=mask_d)


def _default_num_kv_splits(batch: int, blocks_per_split_row: int, max_kv_len: int, device: torch.device) -> int:
    # Enough programs for ~2 waves over all SMs, but no split shorter than
    # _MIN_KV_PER_SPLIT tokens: more splits only help when batch x kv-heads is small.
    want = triton.cdiv(2 * _num_sms(device), max(1, batch * blocks_per_split_row))
    by_len = triton.cdiv(max(1, max_kv_len), _MIN_KV_PER_SPLIT)
    return max(1, min(want, by_len, _MAX_KV_SPLITS))


def decode_attention(
    q: torch.Tensor,  # [batch, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    kv_indptr: torch.Tensor,  # int32 [batch + 1]
    kv_indices: torch.Tensor,  # int32/int64 [nnz]
    sm_scale: float,
    out: torch.Tensor | None = None,  # [batch, num_heads, head_dim], q's dtype
    num_kv_splits: int | None = None,
    *,
    max_kv_len: int | None = None,  # host-side hint; avoids a device sync when splits are chosen
    shared: SharedPrefixes | None = None,  # rows grouped by a shared prefix, read once per group
    pdl: bool = True,  # launch early where the GPU can
) -> torch.Tensor:
    """Single-token attention per request over paged KV (flash-decoding, two stages). With
    `shared`, each group's prefix is attended by one pass for all its rows (prefix_kernel.py)
    and stage 1 reads only each row's tokens past it; stage 2 merges both."""
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, num_heads, head_dim], got {tuple(q.shape)}")
    num_heads, num_kv_heads, head_dim = _check_common(q, k_cache, v_cache)
    batch = q.shape[0]
    if kv_indptr.numel() != batch + 1:
        raise ValueError(f"kv_indptr must have batch+1={batch + 1} entries, got {kv_indptr.numel()}")
    out = _prepare_out(q, out)
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    block_d = _block_d(head_dim)
    # Whole group in one program up to 64 heads (MQA-like groups are split across programs).
    block_h = max(16, min(64, triton.next_power_of_2(group)))
    head_blocks = triton.cdiv(group, block_h)
    gpu = _on_gpu(q)
    block_n, extra = _decode_config(block_d, q.dtype, gpu)

    if num_kv_splits is None:
        if max_kv_len is None:
            max_kv_len = int((kv_indptr[1:] - kv_indptr[:-1]).max().item())  # device sync
        num_kv_splits = _default_num_kv_splits(batch, num_kv_heads * head_blocks, max_kv_len, q.device)
    num_kv_splits = max(1, int(num_kv_splits))
    pre_block_n, pre_splits = 16, 1  # unused without `shared`
    if shared is not None:
        if shared.row_skip.numel() != batch or shared.grp_rows.numel() != batch:
            raise ValueError(f"shared prefixes are planned for {shared.row_skip.numel()} rows, the batch has {batch}")
        _, pre_block_n, pre_splits, _ = prefix_config(q.dtype, gpu)
    skip = shared.row_skip if shared is not None else kv_indptr  # a dummy pointer without it

    # float32 workspace: partial outputs (normalised per split) and their log2-LSE; with
    # shared prefixes, each row's prefix splits follow its own.
    total = num_kv_splits + (pre_splits if shared is not None else 0)
    mid_o = torch.empty((batch, num_heads, total, head_dim), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((batch, num_heads, total), dtype=torch.float32, device=q.device)
    _decode_stage1_kernel[(batch, num_kv_heads * head_blocks, num_kv_splits)](
        q, k_cache, v_cache, kv_indptr, kv_indices, skip, mid_o, mid_lse,
        sm_scale * _LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        num_kv_splits,
        GROUP=group, HEAD_BLOCKS=head_blocks, HEAD_DIM=head_dim,
        BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_N=block_n, PRECISION=_dot_precision(q.dtype),
        HAS_SKIP=shared is not None, **extra, **pdl_launch(q.device, pdl),
    )
    if shared is not None:
        launch_prefix(q, k_cache, v_cache, kv_indptr, kv_indices, shared.grp_len, shared.grp_indptr, shared.grp_rows,
                      mid_o, mid_lse, sm_scale * _LOG2E, num_kv_splits, head_dim=head_dim, block_d=block_d,
                      precision=_dot_precision(q.dtype), pdl_kw=pdl_launch(q.device, pdl))
    _decode_stage2_kernel[(batch, num_heads)](
        mid_o, mid_lse, out, kv_indptr, skip,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        num_kv_splits,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n,
        HAS_SKIP=shared is not None, PRE_SPLITS=pre_splits, PRE_BLOCK_N=pre_block_n,
        **({"num_warps": 2 if block_d <= 128 else 4, "num_stages": 2} if gpu else {}), **pdl_launch(q.device, pdl),
    )
    return out


# --------------------------------------------------------------------------------------
# Extend (prefill with cached prefix)
# --------------------------------------------------------------------------------------


@triton.jit
def _extend_inner(
    acc, l_i, m_i, q, K, V, kv_indices, kv_start, kvh, offs_m, prefix,
    lo, hi, qk_scale, stride_kn, stride_kh, stride_vn, stride_vh,
    offs_d, mask_d, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
):
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        slot = tl.load(kv_indices + kv_start + offs_n, mask=mask_n, other=0).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(K + slot[:, None] * stride_kn + kvh * stride_kh + offs_d[None, :],
                    mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        if CAUSAL:
            # new token i sits at absolute position prefix + i and sees positions <= it
            s = tl.where((offs_n[None, :] <= prefix + offs_m[:, None]) & mask_n[None, :], s, float("-inf"))
        else:
            s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row may see nothing in this block (only padded rows / diagonal tiles); keep
        # exp2 arguments finite so such rows contribute exact zeros instead of NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + slot[:, None] * stride_vn + kvh * stride_vh + offs_d[None, :],
                    mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _extend_kernel(
    Q, K, V, Out, qo_indptr, kv_indptr, kv_indices,
    qk_scale,  # sm_scale * log2(e)
    stride_qt, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):
    mblk = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(qo_indptr + b)
    n_new = tl.load(qo_indptr + b + 1) - q_start
    # The grid covers the longest request; shorter requests' extra blocks exit here.
    if mblk * BLOCK_M >= n_new:
        return
    kv_start = tl.load(kv_indptr + b)
    kv_len = tl.load(kv_indptr + b + 1) - kv_start
    prefix = kv_len - n_new
    kvh = h // GROUP

    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)  # new-token index within the request
    mask_m = offs_m < n_new
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q_ptrs = Q + (q_start + offs_m)[:, None].to(tl.int64) * stride_qt + h * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Phase 1: positions every row of this block sees (prefix + earlier new tokens):
    # no causal mask needed, the cheap path for most of a long context.
    full_end = prefix + mblk * BLOCK_M
    acc, l_i, m_i = _extend_inner(
        acc, l_i, m_i, q, K, V, kv_indices, kv_start, kvh, offs_m, prefix,
        0, full_end, qk_scale, stride_kn, stride_kh, stride_vn, stride_vh,
        offs_d, mask_d, BLOCK_N, False, PRECISION)
    # Phase 2: the diagonal band, where the causal mask applies.
    diag_end = prefix + tl.minimum((mblk + 1) * BLOCK_M, n_new)
    acc, l_i, m_i = _extend_inner(
        acc, l_i, m_i, q, K, V, kv_indices, kv_start, kvh, offs_m, prefix,
        full_end, diag_end, qk_scale, stride_kn, stride_kh, stride_vn, stride_vh,
        offs_d, mask_d, BLOCK_N, True, PRECISION)

    res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = Out + (q_start + offs_m)[:, None].to(tl.int64) * stride_ot + h * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, res.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def extend_attention(
    q: torch.Tensor,  # [total_new_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    qo_indptr: torch.Tensor,  # int32 [batch + 1]
    kv_indptr: torch.Tensor,  # int32 [batch + 1]
    kv_indices: torch.Tensor,  # int32/int64 [nnz]; each request's prefix then its new tokens
    sm_scale: float,
    out: torch.Tensor | None = None,  # [total_new_tokens, num_heads, head_dim], q's dtype
    *,
    max_new_tokens: int | None = None,  # host-side hint; avoids a device sync for the grid
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its cached prefix plus themselves."""
    if q.dim() != 3:
        raise ValueError(f"q must be [total_new_tokens, num_heads, head_dim], got {tuple(q.shape)}")
    num_heads, num_kv_heads, head_dim = _check_common(q, k_cache, v_cache)
    if qo_indptr.numel() != kv_indptr.numel():
        raise ValueError("qo_indptr and kv_indptr must both have batch+1 entries")
    out = _prepare_out(q, out)
    batch = qo_indptr.numel() - 1
    if batch <= 0 or q.shape[0] == 0:
        return out
    if max_new_tokens is None:
        max_new_tokens = int((qo_indptr[1:] - qo_indptr[:-1]).max().item())  # device sync
    if max_new_tokens <= 0:
        return out
    block_d = _block_d(head_dim)
    block_m, block_n, extra = _extend_config(block_d, q.dtype, _on_gpu(q))
    grid = (triton.cdiv(max_new_tokens, block_m), num_heads, batch)
    _extend_kernel[grid](
        q, k_cache, v_cache, out, qo_indptr, kv_indptr, kv_indices,
        sm_scale * _LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, PRECISION=_dot_precision(q.dtype),
        **extra,
    )
    return out


def default_num_kv_splits(batch: int, num_heads: int, num_kv_heads: int, max_kv_len: int, device: torch.device) -> int:
    """The split count decode_attention would pick for this shape; CUDA graphs fix it at
    capture (from the longest context they accept) so replays never read lengths on the host."""
    block_h = max(16, min(64, triton.next_power_of_2(num_heads // num_kv_heads)))
    head_blocks = triton.cdiv(num_heads // num_kv_heads, block_h)
    return _default_num_kv_splits(batch, num_kv_heads * head_blocks, max_kv_len, device)
