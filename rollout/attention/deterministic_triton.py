"""The GPU twin of DeterministicAttention's torch path: one Triton program per (token row,
KV head) walks the row's own KV from position 0 in tiles of KV_TILE slots, with an online
softmax in float32 (the extend kernel's inner loop). Nothing in a program depends on the other rows (no split-KV whose split
count follows the batch, one tile config), so a row's output is the same in any batch, and
the kernel reads only device tensors (CUDA graphs replay it).

Row r belongs to request RowReq[r] and sees that request's KV slots
kv_indices[kv_indptr[b] : kv_indptr[b + 1] - RowBack[r]] (RowBack: how many of the
request's new tokens come after this one). A decode batch is RowReq = arange, RowBack = 0.
Runs on CPU tensors under TRITON_INTERPRET=1 (tests/attention/test_deterministic_attention.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout.attention.triton_kernels import _LOG2E, _extend_inner


@triton.jit
def _rows_attention_kernel(
    Q, K, V, Out, KvIndptr, KvIndices, RowReq, RowBack, qk_scale,  # sm_scale * log2(e)
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    TILE: tl.constexpr, PRECISION: tl.constexpr,
):
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    req = tl.load(RowReq + row)
    start = tl.load(KvIndptr + req).to(tl.int64)
    length = tl.load(KvIndptr + req + 1).to(tl.int64) - start - tl.load(RowBack + row)
    local_h = tl.arange(0, BLOCK_H)
    mask_h = local_h < GROUP  # the GROUP query heads of this KV head, padded to BLOCK_H (>= 16) for tl.dot
    offs_h = kvh * GROUP + local_h
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(Q + row * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    # the extend kernel's online-softmax loop, non-causal over [0, length): tiles of TILE from
    # position 0 in order, whatever the batch
    acc, l_i, m_i = _extend_inner(
        acc, l_i, m_i, q, K, V, KvIndices, start, kvh, local_h, 0, 0, length, qk_scale,
        stride_ks, stride_kh, stride_vs, stride_vh, offs_d, mask_d, BLOCK_N=TILE, CAUSAL=False, PRECISION=PRECISION,
    )
    out = acc / l_i[:, None]
    tl.store(Out + row * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=mask_h[:, None] & mask_d[None, :])


def rows_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_indptr: torch.Tensor,
                   kv_indices: torch.Tensor, row_req: torch.Tensor, row_back: torch.Tensor, scale: float,
                   out: torch.Tensor, tile: int) -> None:
    """q: [T, H, D]; k_buf / v_buf: [slots, Hkv, D]; writes out [T, H, D]."""
    t, h, d = q.shape
    hkv = k_buf.shape[1]
    if t == 0:
        return
    group = h // hkv
    _rows_attention_kernel[(t, hkv)](
        q, k_buf, v_buf, out, kv_indptr, kv_indices, row_req, row_back, scale * _LOG2E,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=d, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_D=triton.next_power_of_2(d),
        TILE=tile, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
