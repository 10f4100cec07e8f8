"""Batch-invariant attention for deterministic mode (EngineConfig.deterministic).

Every new token is one row that attends over its own request's KV up to and including its
position, whatever kind of step it arrived in (a decode, a prefill chunk, a prompt resumed
after retraction, a verified draft). Its result is a function of that KV alone: not of the
batch, the chunk it was prefilled in, whether its prefix came from the radix cache, or
whether it was decoded or recomputed. That is what makes the engine's log-probs repeatable
bit for bit, and equal to a full-sequence recompute with the same kernels (the trainer's
scoring path, rollout/rl/onpolicy.py).

The KV is read in tiles of KV_TILE slots from position 0, and every reduction runs over a
tile-shaped tensor in a fixed order: scores per tile, the row max over all tiles (exact),
then exp, the sum and probs @ V tile by tile, accumulated in tile order. A tile past a row's
end contributes exact zeros, so rows of different lengths in one call do not perturb each
other. Transcendental ops (exp) only ever see tensors whose last dim is the tile (a multiple
of the vector width), so no element falls into a scalar tail loop in one batch and a vector
loop in another (the two round differently on CPU).

On CUDA the same contract is kept by a Triton kernel (deterministic_triton.py: one program
per block of a request's new tokens and KV head, fixed tiles, online softmax; row_blocks.py
plans the blocks), whose one-token launch CUDA graphs replay. A prompt chunk's rows share
their KV tile loads there; on CPU each row still reads its request's KV, and a step's scores
are held in memory at once.
"""

from __future__ import annotations

import torch

from rollout.attention.base import AttentionBackend
from rollout.attention.row_blocks import RowBlocks, decode_table, heads_per_kv, plan_row_blocks
from rollout.batch import ForwardBatch
from rollout.device import to_device

KV_TILE = 64
# MMA rows of a prompt chunk's program on the GPU (tokens x padded query heads per KV head):
# 64 is the smallest Hopper wgmma tile, and keeps the accumulator in 4 warps' registers.
BLOCK_ROWS = 64

class DeterministicAttention(AttentionBackend):
    name = "deterministic"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # KernelOptions.deterministic_triton; None: the Triton kernel on CUDA, the torch tiles on
        # CPU (True: the kernel on CPU tensors under TRITON_INTERPRET=1, tests)
        triton = self.options.deterministic_triton
        self.triton = triton if triton is not None else self.pool.k_buffers[0].is_cuda
        # decode graphs replay the kernel: it reads only device tensors (the torch path plans on the host)
        self.graphable = self.triton
        self._static_table: torch.Tensor | None = None
        self.launches: list[RowBlocks] = []

    def max_block_tokens(self) -> int:
        return max(1, BLOCK_ROWS // heads_per_kv(self.num_heads, self.num_kv_heads))

    def warm_up(self) -> int:
        if not (self.triton and self.pool.k_buffers[0].is_cuda):
            return 0  # the torch tiles (CPU) compile nothing; the interpreter is for tests
        from rollout.attention.deterministic_triton import warm_up

        k, v = self.pool.k_buffers[0], self.pool.v_buffers[0]
        return warm_up(k, v, self.num_heads, k.dtype, self.max_block_tokens(), KV_TILE)

    def plan(self, batch: ForwardBatch) -> None:
        super().plan(batch)
        device = batch.kv_indices.device
        if self.triton:
            tables = plan_row_blocks(batch.extend_lens, self.max_block_tokens())
            packed = to_device(torch.cat([t for t, _ in tables], 1), device) if tables else None  # one copy
            self.launches, at = [], 0
            for table, tokens in tables:
                self.launches.append(RowBlocks(packed[:, at : at + table.shape[1]], tokens))
                at += table.shape[1]
            return
        # Per token row, from the per-request lists (host tensors, no loop over tokens): its
        # request, and how many of that request's new tokens follow it.
        extend = torch.tensor(batch.extend_lens, dtype=torch.int64)  # [B]
        seq_lens = torch.tensor(batch.seq_lens, dtype=torch.int64)  # [B]
        reqs = torch.repeat_interleave(torch.arange(len(extend)), extend)  # [T]
        first_row = torch.cumsum(extend, 0) - extend  # [B]
        backs = extend[reqs] - 1 - (torch.arange(len(reqs)) - first_row[reqs])  # [T]
        lengths = seq_lens[reqs] - backs  # the KV a row sees: its own position + 1
        self.row_lengths = lengths.to(device)
        self.row_starts = (torch.cumsum(seq_lens, 0) - seq_lens)[reqs].to(device)  # its request's KV in kv_indices
        self.num_tiles = -(-int(lengths.max()) // KV_TILE) if len(lengths) else 0

    def plan_capture(self, batch: ForwardBatch, max_context: int) -> None:
        """A decode graph's programs are its requests, one token each, read from a table that
        outlives every capture (the largest graph is captured first)."""
        super().plan(batch)
        if self._static_table is None:
            self._static_table = decode_table(batch.batch_size, batch.kv_indices.device)
        self.launches = [RowBlocks(self._static_table[:, : batch.batch_size], 1)]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
               batch: ForwardBatch, out: torch.Tensor) -> None:
        if self.triton:
            from rollout.attention.deterministic_triton import tiled_attention

            q = q.contiguous()
            for blocks in self.launches:
                tiled_attention(q, k_buf, v_buf, batch.kv_indptr, batch.kv_indices, blocks, self.scale, out, KV_TILE)
            return
        t = q.shape[0]
        if t == 0:
            return
        hkv, d = self.num_kv_heads, self.head_dim
        group = self.num_heads // hkv
        qg = q.float().view(t, hkv, group, d)  # the G query heads of a KV head as G rows
        last = batch.kv_indices.numel() - 1
        tiles = []
        for i in range(self.num_tiles):
            offsets = torch.arange(i * KV_TILE, (i + 1) * KV_TILE, device=q.device)
            valid = offsets[None, :] < self.row_lengths[:, None]  # [T, TILE]
            gather = (self.row_starts[:, None] + offsets[None, :]).clamp(max=last)
            # invalid positions read slot 0 (the reserved padding page: zeros) and are masked
            slots = torch.where(valid, batch.kv_indices[gather], 0).reshape(-1)
            # Every operand a contiguous [rows, cols] matrix per (row, KV head), the same for any T:
            # MKL's batched GEMM took another path for a permuted B once T > 1 (measured: a decode
            # row alone and next to one other differed in the last bit, 4 heads / 2 KV heads / d 16).
            keys = k_buf.index_select(0, slots).view(t, KV_TILE, hkv, d).float().transpose(1, 2).contiguous()
            scores = torch.matmul(qg, keys.transpose(-1, -2)) * self.scale  # [T, Hkv, G, TILE]
            scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
            tiles.append((scores, slots))
        row_max = tiles[0][0].amax(-1)
        for scores, _ in tiles[1:]:
            row_max = torch.maximum(row_max, scores.amax(-1))  # [T, Hkv, G]: exact in any order
        total = torch.zeros_like(row_max)
        acc = torch.zeros(t, hkv, group, d, dtype=torch.float32, device=q.device)
        for scores, slots in tiles:
            probs = torch.exp(scores - row_max[..., None])  # [T, Hkv, G, TILE]: 0 where masked
            values = v_buf.index_select(0, slots).view(t, KV_TILE, hkv, d).float().transpose(1, 2).contiguous()  # [T, Hkv, TILE, D]
            total = total + probs.sum(-1)
            acc = acc + torch.matmul(probs, values)
        out.copy_((acc / total[..., None]).view(t, self.num_heads, d))
