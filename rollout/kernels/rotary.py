"""The rotary embedding and the KV store: what a decoder layer does to its new tokens' q, k
and v between the qkv projection and attention, as Triton kernels.

* ``rotary_embedding``: rotate-half RoPE of q and k in one launch, cos/sin gathered by
  position inside the kernel (and, with a deferred adapter delta, v's share of it added);
  given the KV pool's buffers and slots, the same launch also stores the rotated K and V
  (rollout.kernels.KVTarget: the store kernel's launch is saved).
* ``store_kv``: the new tokens' K and V into the paged pool by slot, one launch (for a
  caller whose K/V did not come through the rotary).

They follow rollout.kernels.fused's rules: each rounds where its torch twin in
rollout.model.llama rounds (the rotary is bit-identical to it in every dtype), a ``delta``
is added on load and rounded once, tensors are contiguous in their last dim (rows may be
strided views of the qkv output), and they run on CUDA or under TRITON_INTERPRET=1.
tests/kernels/test_rotary.py checks them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout.kernels.pdl import launch as pdl_launch
from rollout.kernels.fused import _TILE, _check_delta, _check_dtype, _last_dim_contiguous, _num_warps
from rollout.kernels.pdl_device import launch_next_then_wait

__all__ = ["rotary_embedding", "store_kv"]

# The rotary comes right after qkv's matmul and before attention. Where PDL is available
# (rollout/kernels/pdl.py; `pdl`: KernelOptions.pdl and pdl_rotary_attention) it launches early
# and lets the next kernel launch at once, as the norms do: at batch 1 a layer's kernels each
# launch beside the one before.


# ---------------------------------------------------------------------------- rotary


@triton.jit
def _rope_heads(x_ptr, o_ptr, d_ptr, c_ptr, c_row, stride_ch, t, heads, n_heads, stride_xt, stride_xh, stride_ot,
                stride_oh, stride_dt, cos, sin, cols, col_mask, half, HAS_DELTA: tl.constexpr, STORE: tl.constexpr):
    """Rotate heads[:] of token t: out1 = x1*c - x2*s, out2 = x2*c + x1*s (rotate-half),
    after adding the deferred delta (this tensor's columns of it, at d_ptr); with STORE also
    into the KV cache row at c_ptr + c_row (the token's slot)."""
    mask = (heads < n_heads)[:, None] & col_mask[None, :]  # [BLOCK_H, BLOCK_HALF]
    heads = heads.to(tl.int64)
    x_off = t * stride_xt + heads[:, None] * stride_xh + cols[None, :]
    o_off = t * stride_ot + heads[:, None] * stride_oh + cols[None, :]
    x1 = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_off + half, mask=mask, other=0.0).to(tl.float32)
    dtype = o_ptr.dtype.element_ty
    if HAS_DELTA:
        d_off = t * stride_dt + heads[:, None] * (2 * half) + cols[None, :]
        x1 = (x1 + tl.load(d_ptr + d_off, mask=mask, other=0.0)).to(dtype).to(tl.float32)
        x2 = (x2 + tl.load(d_ptr + d_off + half, mask=mask, other=0.0)).to(dtype).to(tl.float32)
    # llama._rotate runs in the model dtype: each product and each sum is rounded to it.
    # (For fp32 the casts are no-ops; the launch disables FMA contraction so mul-then-sub
    # stays two roundings, like torch's separate kernels.)
    o1 = ((x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)).to(dtype)
    o2 = ((x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)).to(dtype)
    tl.store(o_ptr + o_off, o1, mask=mask)
    tl.store(o_ptr + o_off + half, o2, mask=mask)
    if STORE:
        c_off = c_row + heads[:, None] * stride_ch + cols[None, :]
        c_dtype = c_ptr.dtype.element_ty
        tl.store(c_ptr + c_off, o1.to(c_dtype), mask=mask)
        tl.store(c_ptr + c_off + half, o2.to(c_dtype), mask=mask)


@triton.jit
def _v_heads(v_ptr, d_ptr, c_ptr, c_row, stride_ch, t, heads, n_heads, stride_vt, stride_vh, stride_dt, cols, col_mask,
             half, HAS_DELTA: tl.constexpr, STORE: tl.constexpr):
    """v[t, heads] += its delta, in place, rounded once to v's dtype (no rotation); with
    STORE, v (after the delta) also into the KV cache row at c_ptr + c_row."""
    mask = (heads < n_heads)[:, None] & col_mask[None, :]
    heads = heads.to(tl.int64)
    dtype = v_ptr.dtype.element_ty
    for h0 in tl.static_range(0, 2):  # the two halves of head_dim, with the rotary tile's columns
        v_off = t * stride_vt + heads[:, None] * stride_vh + cols[None, :] + h0 * half
        v = tl.load(v_ptr + v_off, mask=mask, other=0.0)
        if HAS_DELTA:
            d_off = t * stride_dt + heads[:, None] * (2 * half) + cols[None, :] + h0 * half
            v = (v.to(tl.float32) + tl.load(d_ptr + d_off, mask=mask, other=0.0)).to(dtype)
            tl.store(v_ptr + v_off, v, mask=mask)
        if STORE:
            c_off = c_row + heads[:, None] * stride_ch + cols[None, :] + h0 * half
            tl.store(c_ptr + c_off, v.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, pos_ptr, v_ptr, delta_ptr, kc_ptr, vc_ptr, slot_ptr,
    n_q_heads, n_k_heads, half,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    stride_cs, stride_vt, stride_vh, stride_dt, stride_kc0, stride_kc1, stride_vc0, stride_vc1,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, HAS_DELTA: tl.constexpr, STORE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # grid: (T, q head blocks + k head blocks [+ v head blocks with a delta or a store]); q
    # and k share one launch and one cos/sin gather per token. The delta's columns are q's,
    # k's, v's. With STORE the rotated k and v go to the KV cache at the token's slot too.
    if USE_PDL:
        launch_next_then_wait()
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    n_q_blocks = tl.cdiv(n_q_heads, BLOCK_H)
    n_k_blocks = tl.cdiv(n_k_heads, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < half
    dq_ptr = delta_ptr
    dk_ptr = delta_ptr + n_q_heads * 2 * half
    dv_ptr = dk_ptr + n_k_heads * 2 * half
    slot = 0
    if STORE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
    if HAS_DELTA or STORE:
        if hb >= n_q_blocks + n_k_blocks:  # v: its delta in place, and its store
            heads = (hb - n_q_blocks - n_k_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
            _v_heads(v_ptr, dv_ptr, vc_ptr, slot * stride_vc0, stride_vc1, t, heads, n_k_heads, stride_vt, stride_vh,
                     stride_dt, cols, col_mask, half, HAS_DELTA, STORE)
            return
    pos = tl.load(pos_ptr + t).to(tl.int64)
    dtype = qo_ptr.dtype.element_ty
    # Rotary.forward casts the fp32 tables to the model dtype before use.
    cos = tl.load(cos_ptr + pos * stride_cs + cols, mask=col_mask, other=0.0).to(dtype).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cs + cols, mask=col_mask, other=0.0).to(dtype).to(tl.float32)[None, :]
    if hb < n_q_blocks:
        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        _rope_heads(q_ptr, qo_ptr, dq_ptr, qo_ptr, 0, 0, t, heads, n_q_heads, stride_qt, stride_qh, stride_qot,
                    stride_qoh, stride_dt, cos, sin, cols, col_mask, half, HAS_DELTA, False)
    else:
        heads = (hb - n_q_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        _rope_heads(k_ptr, ko_ptr, dk_ptr, kc_ptr, slot * stride_kc0, stride_kc1, t, heads, n_k_heads, stride_kt,
                    stride_kh, stride_kot, stride_koh, stride_dt, cos, sin, cols, col_mask, half, HAS_DELTA, STORE)


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     positions: torch.Tensor, *, inplace: bool = False, v: torch.Tensor | None = None,
                     delta: torch.Tensor | None = None, k_cache: torch.Tensor | None = None,
                     v_cache: torch.Tensor | None = None, slots: torch.Tensor | None = None,
                     pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half (HF, non-interleaved) RoPE of q [T, H, D] and k [T, Hkv, D] at
    ``positions`` [T] (int), with cos/sin tables [max_pos, D/2] (fp32, cast to q's dtype
    before use, as ``Rotary.forward`` does). q/k may be strided views (e.g. slices of the
    fused qkv output) as long as D is contiguous.

    Returns new contiguous (q_rot, k_rot), or with ``inplace=True`` writes into q and k and
    returns them. Positions are not bounds-checked (that would cost a device sync): callers
    keep them below max_pos.

    ``delta``: the qkv projection's deferred adapter delta, fp32 [T, (H + 2 Hkv) D] (q's, k's,
    then v's columns), added to q and k before they rotate and to ``v`` [T, Hkv, D] (then
    required) in place, in the same launch (see the module docstring).

    ``k_cache``, ``v_cache`` [num_slots, Hkv, D] and ``slots`` [T] (all three or none; v then
    required): also ``k_cache[slots] = k_rot`` and ``v_cache[slots] = v`` (after its delta),
    what ``store_kv`` does, in the same launch. Slots are not bounds-checked either.
    """
    _check_dtype("q", q)
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q and k must be [T, heads, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    t, n_q, d = q.shape
    if k.shape[0] != t or k.shape[2] != d or k.dtype != q.dtype or positions.shape != (t,):
        raise ValueError(f"mismatched q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}, "
                         f"positions {tuple(positions.shape)}")
    if d % 2:
        raise ValueError(f"head_dim must be even, got {d}")
    half = d // 2
    if cos.dim() != 2 or cos.shape[1] != half or sin.shape != cos.shape:
        raise ValueError(f"cos/sin must be [max_pos, {half}], got {tuple(cos.shape)} and {tuple(sin.shape)}")
    for name, tensor in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        _last_dim_contiguous(name, tensor)
    n_k = k.shape[1]
    if delta is not None:
        if v is None or v.shape != k.shape or v.dtype != q.dtype:
            raise ValueError(f"a delta needs v shaped like k {tuple(k.shape)} {q.dtype}, got "
                             f"{None if v is None else (tuple(v.shape), v.dtype)}")
        _last_dim_contiguous("v", v)
        _check_delta(delta, (t, (n_q + 2 * n_k) * d), q.device)
    store = k_cache is not None or v_cache is not None or slots is not None
    if store:
        _check_kv_target(k_cache, v_cache, slots, v, k)
    if cos.stride(0) != sin.stride(0):
        cos, sin = cos.contiguous(), sin.contiguous()
    q_out = q if inplace else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = k if inplace else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if t == 0:
        return q_out, k_out
    block_half = triton.next_power_of_2(half)
    # Head blocks sized by the (smaller) kv head count so k is not mostly masked lanes.
    block_h = max(1, min(triton.next_power_of_2(max(n_k, 4)), _TILE // block_half))
    v_blocks = delta is not None or store  # head blocks for v: its delta, its store
    head_blocks = triton.cdiv(n_q, block_h) + triton.cdiv(n_k, block_h) * (2 if v_blocks else 1)
    vv = v if v_blocks else q  # unread without a delta or a store
    kc, vc, sl = (k_cache, v_cache, slots) if store else (k_out, k_out, positions)  # unread without a store
    _rotary_kernel[(t, head_blocks)](
        q, k, q_out, k_out, cos, sin, positions, vv, delta if delta is not None else cos, kc, vc, sl,
        n_q, n_k, half,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos.stride(0), vv.stride(0), vv.stride(1), delta.stride(0) if delta is not None else 0,
        kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1),
        BLOCK_H=block_h, BLOCK_HALF=block_half, HAS_DELTA=delta is not None, STORE=store,
        num_warps=_num_warps(block_h * block_half),
        enable_fp_fusion=False, **pdl_launch(q.device, pdl),
    )
    return q_out, k_out


# ---------------------------------------------------------------------------- KV store


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, n_cols, stride_kt, stride_vt, stride_kc, stride_vc,
                     BLOCK: tl.constexpr):
    # grid: (T, column blocks); one launch writes both K and V of a token
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    slot = tl.load(slot_ptr + t).to(tl.int64)
    k = tl.load(k_ptr + t * stride_kt + cols, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + cols, mask=mask)
    tl.store(kc_ptr + slot * stride_kc + cols, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + slot * stride_vc + cols, v.to(vc_ptr.dtype.element_ty), mask=mask)


def _check_kv_target(k_cache: torch.Tensor | None, v_cache: torch.Tensor | None, slots: torch.Tensor | None,
                     v: torch.Tensor | None, k: torch.Tensor) -> None:
    """The pool buffers [num_slots, Hkv, D] and slots [T] that k and v [T, Hkv, D] go to."""
    if k_cache is None or v_cache is None or slots is None or v is None:
        raise ValueError("a KV store needs k_cache, v_cache, slots and v, all four")
    if k.shape != v.shape or k.dim() != 3 or k_cache.shape[1:] != k.shape[1:] or v_cache.shape != k_cache.shape:
        raise ValueError(f"mismatched k {tuple(k.shape)}, v {tuple(v.shape)}, cache {tuple(k_cache.shape)}")
    t = k.shape[0]
    if slots.shape != (t,) or slots.dtype not in (torch.int32, torch.int64) or slots.device != k.device:
        raise ValueError(f"slots must be int [{t}] on {k.device}, got {slots.dtype} {tuple(slots.shape)} on "
                         f"{slots.device}")
    for name, x in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.shape[1] > 1 and x.stride(1) != x.shape[2] or x.stride(2) != 1:
            raise ValueError(f"{name} must be contiguous within a token (heads x head_dim), got strides {x.stride()}")


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """k_cache[slots] = k and v_cache[slots] = v in one launch (instead of two index_copy_).
    Caches are [num_slots, Hkv, D] (contiguous per slot); k/v [T, Hkv, D] may have strided
    rows (v is a view of the fused qkv output). Slots are not bounds-checked (a device sync)."""
    _check_kv_target(k_cache, v_cache, slots, v, k)
    t = k.shape[0]
    if t == 0:
        return
    n_cols = k.shape[1] * k.shape[2]
    block = min(triton.next_power_of_2(n_cols), _TILE)
    grid = (t, triton.cdiv(n_cols, block))
    _store_kv_kernel[grid](k, v, k_cache, v_cache, slots, n_cols, k.stride(0), v.stride(0),
                           k_cache.stride(0), v_cache.stride(0), BLOCK=block, num_warps=_num_warps(block))
