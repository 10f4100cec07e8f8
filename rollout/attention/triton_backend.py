"""Attention through our own Triton kernels (split-KV paged decode, causal paged extend).

Runs on CUDA; on CPU only under TRITON_INTERPRET=1 (how CI checks it). Planning slices the
step's ragged index arrays once into a decode part and an extend part; the kernels read
K/V straight from the paged pool by slot, so nothing is gathered.
"""

from __future__ import annotations

import torch

from rollout.attention.base import AttentionBackend
from rollout.attention.prefix_kernel import members_max
from rollout.attention.triton_kernels import decode_attention, default_num_kv_splits, extend_attention
from rollout.batch import ForwardBatch
from rollout.cache.kv_pool import KVPool
from rollout.kernels.options import DEFAULT_OPTIONS, KernelOptions


class TritonAttention(AttentionBackend):
    name = "triton"
    graphable = True  # kernels read only device tensors once the split count is fixed
    slot_lists = True  # the kernels read K/V by slot

    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int,
                 options: KernelOptions = DEFAULT_OPTIONS) -> None:
        super().__init__(pool, num_heads, num_kv_heads, head_dim, options)
        self.pdl = options.pdl and options.pdl_rotary_attention  # decode's launches

    def shared_prefix_rows(self) -> int:
        k = self.pool.k_buffers[0]
        return members_max(self.num_heads, self.num_kv_heads, k.dtype, k.device.type == "cuda")

    def plan(self, batch: ForwardBatch) -> None:
        super().plan(batch)
        self.decode_num_splits: int | None = None
        self.shared = batch.shared  # decode rows grouped by a shared prefix (the runner plans them)
        nd = batch.num_decode
        kv_split = sum(batch.seq_lens[:nd])  # CPU: no device sync
        self.decode_kv_indptr = batch.kv_indptr[: nd + 1]
        self.decode_kv_indices = batch.kv_indices[:kv_split]
        self.decode_max_len = max(batch.seq_lens[:nd], default=0)
        self.extend_qo_indptr = batch.qo_indptr[nd:] - nd
        self.extend_kv_indptr = batch.kv_indptr[nd:] - kv_split
        self.extend_kv_indices = batch.kv_indices[kv_split:]
        self.extend_max_new = max(batch.extend_lens[nd:], default=0)

    def plan_capture(self, batch: ForwardBatch, max_context: int) -> None:
        """Plan a decode-only batch for CUDA-graph capture: the split count is fixed from the
        longest context the graph accepts, not from this batch's lengths."""
        self.plan(batch)
        self.decode_num_splits = default_num_kv_splits(
            batch.batch_size, self.num_heads, self.num_kv_heads, max_context, batch.kv_indices.device
        )

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
               batch: ForwardBatch, out: torch.Tensor) -> None:
        nd = batch.num_decode
        if nd:
            decode_attention(
                q[:nd], k_buf, v_buf, self.decode_kv_indptr, self.decode_kv_indices, self.scale,
                out=out[:nd], num_kv_splits=self.decode_num_splits, max_kv_len=self.decode_max_len,
                shared=self.shared, pdl=self.pdl,
            )
        if nd < batch.batch_size:
            extend_attention(
                q[nd:], k_buf, v_buf, self.extend_qo_indptr, self.extend_kv_indptr, self.extend_kv_indices, self.scale,
                out=out[nd:], max_new_tokens=self.extend_max_new,
            )
