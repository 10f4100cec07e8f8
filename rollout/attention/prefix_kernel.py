"""Shared-prefix (cascade) decode attention: a prefix's KV read once for all rows that share it.

GRPO samples n responses per prompt. The n requests' KV starts with the same slots (the
prompt's pages, shared through the radix tree by a fork or a cache match), and a decode
step's attention reads those slots once per request: eight rows a prompt read its prefix
eight times, so the distinct bytes come in at a fraction of the copy rate (BENCHMARKS.md,
"Decode attention at large batches, kernel against kernel (H200, 2026-12-02, ...)", its
"n samples of a prompt sharing its pages").

Here one program takes a (group, kv head, prefix split): the queries of every member's GQA
heads (members x GROUP rows, padded to BLOCK_M) against one chunk of the shared prefix, so
each prefix K/V tile is loaded once and multiplied on tensor cores with a tall query block.
It writes each row's partial output and log2-LSE into the decode's split workspace after
the row's own splits; decode stage 1 attends each row's own tokens past the prefix
(`kv_skip`), and stage 2 merges both by their log-sum-exp (triton_kernels.py). Groups past
the step's (`grp_len` 0) return at once, so a CUDA graph captured with bs // 2 groups
replays any grouping of up to bs rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout.kernels.pdl_device import launch_next_then_wait

__all__ = ["PRE_SPLITS", "launch_prefix", "members_max", "prefix_config", "prefix_kernel"]

# Splits of a shared prefix (a graph fixes the grid) and the tile; read at each launch
# (benchmarks.kernels.decode_attention --share sweeps them). At GRPO's shape (8B heads, 8 rows a
# 1024-token prefix) 4 splits of 32 query rows (8 members at GQA 4), 64 keys and 3 stages beat
# 64-row tiles, 8 splits and 8 warps (BENCHMARKS.md, "GRPO's decode step: shared-prefix
# attention and the sampler's race (H100, 2026-12-06)" has the pass against plain decode).
PRE_SPLITS = 4
BLOCK_M = 32  # query rows a program: members x GQA group
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 3
INTERPRETER_PRE_SPLITS = 2  # tiny CPU tests: several splits over short prefixes


def prefix_config(dtype: torch.dtype, gpu: bool) -> tuple[int, int, int, dict[str, int]]:
    """(BLOCK_M query rows, BLOCK_N keys, splits, launch kwargs)."""
    if not gpu:
        return 16, 16, INTERPRETER_PRE_SPLITS, {}
    if dtype == torch.float32:  # 4-byte tiles: half as many keys staged
        return BLOCK_M, 32, PRE_SPLITS, {"num_warps": NUM_WARPS, "num_stages": 2}
    return BLOCK_M, BLOCK_N, PRE_SPLITS, {"num_warps": NUM_WARPS, "num_stages": NUM_STAGES}


def members_max(num_heads: int, num_kv_heads: int, dtype: torch.dtype, gpu: bool) -> int:
    """Rows one group may hold: BLOCK_M over the GQA group (0: a group's heads alone fill more)."""
    block_m = prefix_config(dtype, gpu)[0]
    return block_m // (num_heads // num_kv_heads)


@triton.jit
def prefix_kernel(
    Q, K, V, kv_indptr, kv_indices, grp_len, grp_indptr, grp_rows, MidO, MidLse,
    qk_scale,  # sm_scale * log2(e)
    stride_qb, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
    split_base,  # the row's own splits come first in the workspace
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PRE_SPLITS: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:
        launch_next_then_wait()
    g = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    prefix = tl.load(grp_len + g)
    # the same bounds decode stage 2 recomputes to know which prefix splits were written
    per_split = tl.cdiv(tl.cdiv(prefix, PRE_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, prefix)
    if hi > lo:
        m0 = tl.load(grp_indptr + g)
        num_members = tl.load(grp_indptr + g + 1) - m0
        offs_m = tl.arange(0, BLOCK_M)
        member = offs_m // GROUP
        mask_m = member < num_members
        rows = tl.load(grp_rows + m0 + member, mask=mask_m, other=0).to(tl.int64)
        heads = kvh * GROUP + offs_m % GROUP
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        q = tl.load(Q + rows[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
        # every member's KV starts with the same slots: read them from the first member's
        kv_start = tl.load(kv_indptr + tl.load(grp_rows + m0))
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < hi
            slot = tl.load(kv_indices + kv_start + offs_n, mask=mask_n, other=0).to(tl.int64)
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(K + slot[:, None] * stride_kn + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
            s = tl.where(mask_n[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every block has a valid column
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + slot[:, None] * stride_vn + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        at = split_base + split
        o_ptrs = MidO + rows[:, None] * stride_mob + heads[:, None] * stride_moh + at * stride_mos + offs_d[None, :]
        tl.store(o_ptrs, acc / l_i[:, None], mask=mask_m[:, None] & mask_d[None, :])
        tl.store(MidLse + rows * stride_mlb + heads * stride_mlh + at, m_i + tl.log2(l_i), mask=mask_m)


def launch_prefix(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_indptr: torch.Tensor,
                  kv_indices: torch.Tensor, grp_len: torch.Tensor, grp_indptr: torch.Tensor, grp_rows: torch.Tensor,
                  mid_o: torch.Tensor, mid_lse: torch.Tensor, qk_scale: float, split_base: int, *,
                  head_dim: int, block_d: int, precision: str, pdl_kw: dict) -> None:
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    block_m, block_n, splits, extra = prefix_config(q.dtype, q.device.type == "cuda")
    _prefix = prefix_kernel[(grp_len.numel(), num_kv_heads, splits)]
    _prefix(q, k_cache, v_cache, kv_indptr, kv_indices, grp_len, grp_indptr, grp_rows, mid_o, mid_lse,
            qk_scale, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
            v_cache.stride(1), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0),
            mid_lse.stride(1), split_base,
            GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_D=block_d,
            BLOCK_N=block_n, PRE_SPLITS=splits, PRECISION=precision, **extra, **pdl_kw)
