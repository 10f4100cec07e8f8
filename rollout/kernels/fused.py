"""Fused Triton kernels for the per-token elementwise work of a Llama-family decoder.

* ``rms_norm``: (optional residual add +) RMSNorm, one pass over each row.
* ``silu_and_mul``: ``silu(gate) * up`` straight from the fused gate/up projection output.

The rotary embedding and the KV store, the same kind of kernels for what a layer does to
its new K/V between qkv and attention, are in ``rollout.kernels.rotary`` (the rules below
hold for them too).

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

``delta`` (rms_norm, silu_and_mul, and the rotary's): a LoRA adapter's
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

from rollout.kernels.pdl import launch as pdl_launch
from rollout.kernels.pdl_device import launch_next_then_wait

__all__ = ["rms_norm", "silu_and_mul"]

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
# (rollout/kernels/pdl.py; `pdl`: KernelOptions.pdl) they launch early and let the next kernel
# launch at once: the skinny matmul (rollout/kernels/skinny.py) then streams its first weights
# while they run.


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
             rows_per_program: int | None = None, delta: torch.Tensor | None = None,
             pdl: bool = True) -> torch.Tensor: ...
@overload
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor,
             rows_per_program: int | None = None, delta: torch.Tensor | None = None,
             pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor]: ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             rows_per_program: int | None = None, delta: torch.Tensor | None = None,
             pdl: bool = True) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
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
        HAS_DELTA=delta is not None, num_warps=_num_warps(block_m * block_n), **pdl_launch(x.device, pdl),
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


def silu_and_mul(gate_up: torch.Tensor, delta: torch.Tensor | None = None, pdl: bool = True) -> torch.Tensor:
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
                               HAS_DELTA=delta is not None, num_warps=4, **pdl_launch(gate_up.device, pdl))
    return out
