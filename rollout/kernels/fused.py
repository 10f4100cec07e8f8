"""Fused Triton kernels for the per-token elementwise work of a Llama-family decoder.

* ``rms_norm``: (optional residual add +) RMSNorm, one pass over each row.
* ``silu_and_mul``: ``silu(gate) * up`` straight from the fused gate/up projection output.
* ``rotary_embedding``: rotate-half RoPE of q and k in one launch, cos/sin gathered by
  position inside the kernel (and, with a deferred adapter delta, v's share of it added);
  given the KV pool's buffers and slots, the same launch also stores the rotated K and V.
* ``store_kv``: the new tokens' K and V into the paged pool by slot, one launch (for a
  caller whose K/V did not come through the rotary).

Each mirrors a torch twin in ``rollout.model.llama`` (the CPU path and the reference) op by
op, including where that twin rounds to the model dtype: every bf16/fp16 elementwise op of
the reference is computed here in fp32 and rounded to the model dtype at the same point,
which is exactly what torch's 16-bit elementwise ops do (fp32 math, one rounding), so
those steps are bit-identical to torch. What can still differ, by one unit in the last
place (ulp) of the model dtype, is a rounding that follows an fp32 reduction (RMSNorm's
mean of squares) or a transcendental (SiLU's exp), whose fp32 value may differ from
torch's in its last bits. tests/kernels/test_fused.py states the tolerances.

All tensors must be contiguous in their last dim; rows may be strided (q/k may be views
of the fused qkv projection output). Outputs are new contiguous tensors unless stated.

``delta`` (rms_norm, silu_and_mul, rotary_embedding): a LoRA adapter's
deferred delta (lora/hook.py), fp32 and contiguous in the shape of the projection output
the kernel reads. It is added on load and rounded once to the input's dtype, which is what
the in-place expand would have left in that input, so the result is bit-equal to the
kernel run on ``with_delta(input, delta)`` (rollout.model.llama) and no launch is spent on it.
Runs on CUDA, and on CPU tensors under ``TRITON_INTERPRET=1`` (tests; the interpreter
truncates fp32 -> bf16 instead of rounding to nearest, so bf16 is only exact on a GPU).
"""

from __future__ import annotations

from typing import overload

import torch
import triton
import triton.language as tl

from rollout.kernels import pdl
from rollout.kernels.pdl_device import launch_next_then_wait

__all__ = ["rms_norm", "rotary_embedding", "silu_and_mul", "store_kv"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# RMSNorm keeps a whole row in registers up to this width (Llama-70B's 8192 fits);
# wider rows are processed in chunks of _CHUNK_N, read twice (sum of squares, then scale).
_MAX_BLOCK_N = 8192
_CHUNK_N = 4096
# Elements per program for narrow rows: RMSNorm packs several rows into one program (q/k
# norm rows are head_dim wide, T * heads of them) instead of thousands of one-warp programs;
# rows of 2048 and more get one program each. Rotary tiles heads x D/2 to this size.
_TILE = 2048
_SILU_BLOCK = 1024


def _check_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def _last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:  # kernels address rows by stride, columns densely
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def _check_delta(delta: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    """A deferred adapter delta: fp32, contiguous, 2-D `shape` (the projection output's)."""
    if len(shape) != 2 or delta.shape != shape or delta.dtype != torch.float32 or not delta.is_contiguous() \
            or delta.device != device:
        raise ValueError(f"delta must be a contiguous float32 {tuple(shape)} on {device} (for a 2-D input), "
                         f"got {delta.dtype} {tuple(delta.shape)} on {delta.device}")


def _num_warps(elements: int) -> int:
    return min(max(elements // 256, 1), 8)


# RMSNorm and SiLU-mul come right before the projections' matmuls. Where PDL is available
# (rollout/kernels/pdl.py) they launch early and let the next kernel launch at once: the
# skinny matmul (rollout/kernels/skinny.py) then streams its first weights while they run.
# The rotary comes right after qkv's matmul and before attention: it does the same, so at
# batch 1 a layer's kernels from the norm to the next norm each launch beside the one before.
PDL: bool | None = None  # None: where available; False: never (A/B)
ROTARY_PDL: bool | None = None  # the rotary's own switch (A/B); None: as PDL


# ----------------------------------------------------------------------------- RMSNorm


@triton.jit
def _load_sum(x_ptr, res_ptr, res_out_ptr, delta_ptr, x_off, r_off, o_off, mask, HAS_RESIDUAL: tl.constexpr,
              STORE_RESIDUAL: tl.constexpr, HAS_DELTA: tl.constexpr):
    """r = (x + delta) (+ residual), each sum rounded to the input dtype as torch's add is;
    returned in fp32. The delta is laid out as the (contiguous) output."""
    x = tl.load(x_ptr + x_off, mask=mask, other=0.0)
    if HAS_DELTA:
        x = (x.to(tl.float32) + tl.load(delta_ptr + o_off, mask=mask, other=0.0)).to(x_ptr.dtype.element_ty)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + r_off, mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)
        if STORE_RESIDUAL:
            tl.store(res_out_ptr + o_off, x, mask=mask)
    return x.to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, delta_ptr,
    n_rows, n_inner, n_cols,
    stride_x0, stride_x1, stride_r0, stride_r1,
    eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_CHUNKS: tl.constexpr,
    HAS_DELTA: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:
        launch_next_then_wait()
    # A row is (outer, inner) of a [outer, inner, n_cols] view, so that q/k views of the
    # fused qkv output ([T, H, D] with a row stride of the whole qkv width) need no copy.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    row_mask = rows < n_rows
    outer = (rows // n_inner).to(tl.int64)  # int64: T * width can pass 2^31 in long prefills
    inner = (rows % n_inner).to(tl.int64)
    x_row = (outer * stride_x0 + inner * stride_x1)[:, None]  # [BLOCK_M, 1]
    r_row = (outer * stride_r0 + inner * stride_r1)[:, None]
    o_row = (rows.to(tl.int64) * n_cols)[:, None]  # outputs are contiguous
    x_dtype = x_ptr.dtype.element_ty
    out_dtype = out_ptr.dtype.element_ty
    if NUM_CHUNKS == 1:
        # The whole row stays in registers: one read of x (and residual), one write each.
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        h = _load_sum(x_ptr, res_ptr, res_out_ptr, delta_ptr, x_row + cols[None, :], r_row + cols[None, :],
                      o_row + cols[None, :], mask, HAS_RESIDUAL, True, HAS_DELTA)  # [BLOCK_M, BLOCK_N] fp32
        rstd = tl.math.rsqrt(tl.sum(h * h, axis=1) / n_cols + eps)  # [BLOCK_M]
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        # transformers' order: cast the normalized fp32 row to the input dtype, THEN scale.
        # The fp32 product of two 16-bit floats is exact, so rounding it once to the output
        # dtype is torch's 16-bit multiply bit for bit.
        hn = (h * rstd[:, None]).to(x_dtype).to(tl.float32)
        tl.store(out_ptr + o_row + cols[None, :], (hn * w[None, :]).to(out_dtype), mask=mask)
    else:
        # Wide rows (BLOCK_M == 1): sum of squares chunk by chunk, then a second read to
        # scale. The second pass recomputes x + residual from the inputs (not from what
        # pass one stored) so it never reads back its own writes.
        acc = tl.zeros([BLOCK_M], dtype=tl.float32)
        for c in range(NUM_CHUNKS):
            cols = c * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols < n_cols)[None, :]
            h = _load_sum(x_ptr, res_ptr, res_out_ptr, delta_ptr, x_row + cols[None, :], r_row + cols[None, :],
                          o_row + cols[None, :], mask, HAS_RESIDUAL, True, HAS_DELTA)
            acc += tl.sum(h * h, axis=1)
        rstd = tl.math.rsqrt(acc / n_cols + eps)
        for c in range(NUM_CHUNKS):
            cols = c * BLOCK_N + tl.arange(0, BLOCK_N)
            col_mask = cols < n_cols
            mask = row_mask[:, None] & col_mask[None, :]
            h = _load_sum(x_ptr, res_ptr, res_out_ptr, delta_ptr, x_row + cols[None, :], r_row + cols[None, :],
                          o_row + cols[None, :], mask, HAS_RESIDUAL, False, HAS_DELTA)
            w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            hn = (h * rstd[:, None]).to(x_dtype).to(tl.float32)
            tl.store(out_ptr + o_row + cols[None, :], (hn * w[None, :]).to(out_dtype), mask=mask)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    # [..., N] -> [outer, inner, N] as a view where possible: 2-D [T, N] becomes [T, 1, N],
    # 3-D is kept (any T/H strides), more dims are folded into the outer one.
    n = t.shape[-1]
    return t.reshape(-1, 1, n) if t.dim() <= 2 else t.reshape(-1, t.shape[-2], n)


@overload
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: None = None,
             rows_per_program: int | None = None, delta: torch.Tensor | None = None) -> torch.Tensor: ...
@overload
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor,
             rows_per_program: int | None = None,
             delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             rows_per_program: int | None = None,
             delta: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim of x [..., N], in transformers' LlamaRMSNorm op order:
    ``h = r.float(); h = h * rsqrt(mean(h^2) + eps); out = weight * h.to(x.dtype)``.

    With ``residual`` (same shape and dtype as x): ``r = x + residual`` rounded to x's
    dtype, returned as a NEW tensor ``new_residual`` next to ``out`` (x and residual are
    left untouched: no aliasing surprises for callers that keep them, and the same memory
    traffic as an in-place update). Without it, ``r = x`` and only ``out`` is returned.
    ``out`` has dtype ``promote(x.dtype, weight.dtype)`` like the torch expression.
    ``delta`` (2-D x only): an fp32 [T, N] added to x first (see the module docstring).
    """
    _check_dtype("x", x)
    _check_dtype("weight", weight)
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight must be [{n}], got {tuple(weight.shape)}")
    _last_dim_contiguous("x", x)
    weight = weight.contiguous()
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res_out = None
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual must match x {tuple(x.shape)} {x.dtype}, got "
                             f"{tuple(residual.shape)} {residual.dtype}")
        _last_dim_contiguous("residual", residual)
        res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if delta is not None:
        _check_delta(delta, tuple(x.shape), x.device)
    if x.numel() == 0:
        return out if res_out is None else (out, res_out)

    x3 = _as_rows(x)
    r3 = _as_rows(residual) if residual is not None else x3  # unused when HAS_RESIDUAL is False
    n_rows = x3.shape[0] * x3.shape[1]
    if n <= _MAX_BLOCK_N:
        block_n, chunks = triton.next_power_of_2(n), 1
        block_m = min(max(1, _TILE // block_n), triton.next_power_of_2(n_rows))
        if rows_per_program is not None:  # batch-invariant: the reduction layout must not follow n_rows
            block_m = rows_per_program
    else:
        block_n, chunks, block_m = _CHUNK_N, triton.cdiv(n, _CHUNK_N), 1
    grid = (triton.cdiv(n_rows, block_m),)
    _rms_norm_kernel[grid](
        x3, r3, weight, out, res_out if res_out is not None else out, delta if delta is not None else out,
        n_rows, x3.shape[1], n,
        x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1),
        eps,
        HAS_RESIDUAL=residual is not None, BLOCK_M=block_m, BLOCK_N=block_n, NUM_CHUNKS=chunks,
        HAS_DELTA=delta is not None, num_warps=_num_warps(block_m * block_n), **pdl.launch(x.device, env=PDL),
    )
    return out if res_out is None else (out, res_out)


# ------------------------------------------------------------------------- SiLU * up


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, delta_ptr, n_cols, stride_x, BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr,
                         USE_PDL: tl.constexpr):
    if USE_PDL:
        launch_next_then_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:  # the adapter's delta, rounded into gate_up's dtype as the in-place expand would
        d = delta_ptr + row * 2 * n_cols + cols
        gate = (gate + tl.load(d, mask=mask, other=0.0)).to(dtype).to(tl.float32)
        up = (up + tl.load(d + n_cols, mask=mask, other=0.0)).to(dtype).to(tl.float32)
    # torch's F.silu on a 16-bit tensor computes x / (1 + exp(-x)) in fp32 and rounds to
    # the tensor dtype; the product with `up` is then a 16-bit multiply (exact in fp32,
    # rounded once). Round at the same two points so the result is torch's, not a more
    # accurate single-rounding value that would drift from the reference.
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (silu * up).to(dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [..., 2I] (gate first, up second) -> silu(gate) * up [..., I], in gate_up's
    dtype with fp32 math inside, rounded where ``F.silu(gate) * up`` rounds. ``delta`` (2-D
    gate_up only): an fp32 [T, 2I] added to gate_up first (see the module docstring)."""
    _check_dtype("gate_up", gate_up)
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dim must be even (gate | up), got {gate_up.shape[-1]}")
    _last_dim_contiguous("gate_up", gate_up)
    inter = gate_up.shape[-1] // 2
    if delta is not None:
        _check_delta(delta, tuple(gate_up.shape), gate_up.device)
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    if out.numel() == 0:
        return out
    x2 = gate_up.reshape(-1, 2 * inter)  # [T, 2I], a view for the usual [T, 2I] input
    block = min(triton.next_power_of_2(inter), _SILU_BLOCK)
    grid = (x2.shape[0], triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](x2, out, delta if delta is not None else out, inter, x2.stride(0), BLOCK=block,
                               HAS_DELTA=delta is not None, num_warps=4, **pdl.launch(gate_up.device, env=PDL))
    return out


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
                     v_cache: torch.Tensor | None = None,
                     slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
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
        enable_fp_fusion=False, **pdl.launch(q.device, env=PDL if ROTARY_PDL is None else ROTARY_PDL),
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
