"""The GPU twin of DeterministicAttention's torch path: Triton programs that each take a block
of up to TOKENS consecutive new tokens of one request (row_blocks.py plans them) and one KV
head, and walk that request's KV from position 0 in tiles of TILE slots with an online softmax
in float32. A decode is a block of one token; a prompt chunk of 16 tokens shares every K/V
tile load among its 16 rows (and, with GQA, its query heads fill the MMA's rows instead of
padding), which is what made per-token rows slow for prefill.

Why a row's result does not depend on the block it is in (nor the batch, the chunk split, a
cache hit): every value a row produces is built only from its own query and its own KV, in
an order fixed by the tiles:
- scores: one tl.dot over head_dim per tile; each output element of an MMA is the reduction
  of its own row and column in K steps of 16, in order, whatever the tile's M (checked on
  Hopper for MMAv2 and v3 tile shapes, for the matmul and for this kernel:
  tests/kernels/test_batch_invariant.py, tests/attention/test_deterministic_attention.py);
- the row max: exact in any order;
- exp2, the rescales: elementwise;
- the row sum of p and p @ V: tl.dot again (p in the KV dtype, against ones for the sum).
  Not tl.sum: a reduction's order follows the register layout, and the layout follows the
  tile shape (a 16-row tile spreads a row over 4 warps, a 64-row one keeps it in one);
- tiles are counted from position 0 and a tile adds to a row only if it holds some of that
  row's KV (`live`), so a block that runs on past a row's end (for its later rows) leaves
  the row's state untouched.
Nothing depends on the other programs (no split-KV whose count follows the batch), and the
kernel reads only device tensors: the decode CUDA graphs replay its one-token launch.

Runs on CPU tensors under TRITON_INTERPRET=1 (tests/attention/test_deterministic_attention.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout.attention.row_blocks import RowBlocks, heads_per_kv, plan_row_blocks
from rollout.attention.triton_kernels import _LOG2E

SUM_COLS = tl.constexpr(16)  # jit code reads constexpr globals only. tl.dot's smallest N: the row sum of p comes out SUM_COLS times, equal


# A step's block table is a slice of one packed [4, P] copy (at an offset, with P's stride)
# and the KV index arrays are rebuilt per step: specializing on their alignment or on the
# stride would compile a new variant mid-rollout for a new offset or program count (1-3 s
# each on a fresh machine), for scalar loads that gain nothing from it.
@triton.jit(do_not_specialize=["stride_blocks"], do_not_specialize_on_alignment=["Blocks", "KvIndptr", "KvIndices"])
def _tiled_rows_kernel(
    Q, K, V, Out, KvIndptr, KvIndices, Blocks, stride_blocks, qk_scale,  # qk_scale: sm_scale * log2(e)
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEADS: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    TILE: tl.constexpr, PRECISION: tl.constexpr,
):
    blk = tl.program_id(0)
    kvh = tl.program_id(1)
    req = tl.load(Blocks + blk)
    first_row = tl.load(Blocks + stride_blocks + blk).to(tl.int64)
    count = tl.load(Blocks + 2 * stride_blocks + blk)
    back = tl.load(Blocks + 3 * stride_blocks + blk)
    start = tl.load(KvIndptr + req).to(tl.int64)
    first_len = tl.load(KvIndptr + req + 1).to(tl.int64) - start - back  # KV the block's first token sees
    # MMA rows: token-major, then the GROUP query heads of this KV head padded to HEADS (a
    # power of two); at least 16 rows for tl.dot, the padding masked on load and store
    r = tl.arange(0, ROWS)
    tok = r // HEADS
    head = r % HEADS
    mask_r = (tok < count) & (head < GROUP)
    row_len = first_len + tok  # [ROWS]: a token sees its own position and all before it
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(Q + (first_row + tok)[:, None] * stride_qt + (kvh * GROUP + head)[:, None] * stride_qh + offs_d[None, :],
                mask=mask_r[:, None] & mask_d[None, :], other=0.0)  # [ROWS, BLOCK_D]
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS, SUM_COLS], tl.float32)  # the running row sum, SUM_COLS equal copies
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    ones = tl.full([TILE, SUM_COLS], 1.0, V.dtype.element_ty)
    end = first_len + count - 1  # the block's longest row
    for n0 in range(0, end, TILE):
        offs_n = n0 + tl.arange(0, TILE)
        mask_n = offs_n < end
        slot = tl.load(KvIndices + start + offs_n, mask=mask_n, other=0).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(K + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [ROWS, TILE]
        s = tl.where(offs_n[None, :] < row_len[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # padded rows only: keep exp2 finite
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None]).to(V.dtype.element_ty)  # [ROWS, TILE]: 0 past a row's end
        v = tl.load(V + slot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        live = n0 < row_len  # [ROWS]: this tile holds some of the row's KV
        l_i = tl.where(live[:, None], l_i * alpha[:, None] + tl.dot(p, ones, input_precision=PRECISION), l_i)
        acc = tl.where(live[:, None], acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION), acc)
        m_i = tl.where(live, m_new, m_i)
    out = acc / tl.max(l_i, 1)[:, None]  # max of equal copies: exact
    tl.store(Out + (first_row + tok)[:, None] * stride_ot + (kvh * GROUP + head)[:, None] * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=mask_r[:, None] & mask_d[None, :])


def tiled_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_indptr: torch.Tensor,
                    kv_indices: torch.Tensor, blocks: RowBlocks, scale: float, out: torch.Tensor, tile: int) -> None:
    """q: [T, H, D]; k_buf / v_buf: [slots, Hkv, D]; writes the rows `blocks` covers into
    out [T, H, D]."""
    _, h, d = q.shape
    hkv = k_buf.shape[1]
    if blocks.num_programs == 0:
        return
    if blocks.table.stride(1) != 1:
        raise ValueError("blocks.table must be contiguous along its programs")
    heads = heads_per_kv(h, hkv)
    rows = max(16, blocks.tokens * heads)
    gpu = q.is_cuda
    # one-token blocks keep the launch the decode path was measured with; blocks of a prompt
    # chunk (64 MMA rows by default) stage two K/V tiles; more rows than 64 take 8 warps (the
    # [rows, head_dim] float32 accumulator and [rows, TILE] scores would spill in 4)
    extra = {"num_warps": 8 if rows > 64 else 4, "num_stages": 2 if blocks.tokens > 1 else 3} if gpu else {}
    _tiled_rows_kernel[(blocks.num_programs, hkv)](
        q, k_buf, v_buf, out, kv_indptr, kv_indices, blocks.table, blocks.table.stride(0), scale * _LOG2E,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        out.stride(0), out.stride(1),
        GROUP=h // hkv, HEADS=heads, ROWS=rows, HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
        TILE=tile, PRECISION="ieee" if q.dtype == torch.float32 else "tf32", **extra,
    )


def warm_up(k_buf: torch.Tensor, v_buf: torch.Tensor, num_heads: int, dtype: torch.dtype, max_tokens: int,
            tile: int) -> int:
    """Compile, at engine start, each launch shape a step can use (blocks of 1, 2, 4, ...
    max_tokens tokens: plan_row_blocks rounds a step's longest extend up to a power of two),
    not inside the first prefill of a rollout; returns the number of calls. Eager steps pass
    int64 KV indices (ForwardBatch), the decode graphs int32 ones (their static buffer), and
    each dtype compiles apart. Reads the KV pool's slot 0 only and writes a scratch output."""
    device = k_buf.device
    d = k_buf.shape[2]
    calls, tokens = 0, 1
    while tokens <= max_tokens:
        q = torch.zeros(tokens, num_heads, d, dtype=dtype, device=device)
        out = torch.empty_like(q)
        kv_indptr = torch.tensor([0, tokens], dtype=torch.int32, device=device)
        for index_dtype in (torch.int64, torch.int32) if tokens == 1 else (torch.int64,):
            kv_indices = torch.zeros(tokens, dtype=index_dtype, device=device)
            for table, block_tokens in plan_row_blocks([tokens], max_tokens):
                tiled_attention(q, k_buf, v_buf, kv_indptr, kv_indices, RowBlocks(table.to(device), block_tokens),
                                1.0, out, tile)
                calls += 1
        tokens *= 2
    return calls
