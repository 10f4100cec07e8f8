"""One backend for every step, another for the decode graphs of the smallest batches.

`auto` on CUDA is FlashInfer, with its tensor-core decode for GQA >= 4 (the FA2 prefill
kernel, one query row per request, and a merge kernel for the split KV): the better choice
at batch 256. At batch 1 that is two latency-bound kernels a layer for ~2 MB of KV, and our
Triton split-KV decode kernel (rollout/attention/triton_kernels.py) runs the same step
faster (BENCHMARKS.md, "Batch 1, H200, 2026-12-01 (issue #16 (b)): a one-row GEMV, PDL,
Triton decode in the 1-row graphs"); and FlashInfer re-plans on the host before every
replay, which a verify step (no overlap) waits for. So decode graphs of at most `max_rows`
rows (rollout.attention.SMALL_DECODE_ROWS) are captured with the second backend; every other
step (eager decode, prefill, larger graphs) runs the first. Both read the same paged pool
and the same ForwardBatch, so nothing is converted between them.

Which backend a graph was captured with is fixed by its size (`plan_capture`), and a
replay re-plans that backend only (`plan_replay`).
"""

from __future__ import annotations

import torch

from rollout.attention.base import AttentionBackend
from rollout.batch import ForwardBatch
from rollout.kernels import KVTarget


class SmallDecode(AttentionBackend):
    graphable = True

    def __init__(self, main: AttentionBackend, small: AttentionBackend, max_rows: int) -> None:
        if not (main.graphable and small.graphable):
            raise ValueError(f"SmallDecode needs two graphable backends, got {main.name!r} and {small.name!r}")
        if main.pool is not small.pool:
            raise ValueError("SmallDecode: both backends must read the same KV pool")
        super().__init__(main.pool, main.num_heads, main.num_kv_heads, main.head_dim, main.options)
        self.main, self.small, self.max_rows = main, small, max_rows
        self.name = f"{main.name}+{small.name}"  # e.g. "flashinfer+triton"
        self.active = main
        # draft tree rows attend with small: eagerly always (plan), in graphs of at most
        # max_rows rows (the runner's tree_rows_max keeps them there)
        self.slot_lists = small.slot_lists

    def _for(self, batch: ForwardBatch, bs: int) -> AttentionBackend:
        # steps with shared-prefix groups attend with the backend that reads a prefix once
        if batch.shared is not None and self.small.shared_prefix_rows():
            return self.small
        return self.small if bs <= self.max_rows else self.main

    def shared_prefix_rows(self) -> int:
        return self.small.shared_prefix_rows()

    def warm_up(self) -> int:
        return self.main.warm_up() + self.small.warm_up()

    # self.batch stays unset: forward() is the active backend's, which holds its own plan
    def plan(self, batch: ForwardBatch) -> None:
        # eager steps: the main backend whatever their size, but for shared-prefix groups
        shared = batch.shared is not None and self.small.shared_prefix_rows()
        self.active = self.small if shared or batch.slot_rows else self.main
        self.active.plan(batch)

    def plan_capture(self, batch: ForwardBatch, max_context: int) -> None:
        self.active = self._for(batch, batch.batch_size)
        self.active.plan_capture(batch, max_context)

    def plan_replay(self, batch: ForwardBatch, bs: int) -> None:
        self._for(batch, bs).plan_replay(batch, bs)

    def kv_target(self, layer_id: int) -> KVTarget | None:
        return self.active.kv_target(layer_id)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                stored: bool = False) -> torch.Tensor:
        return self.active.forward(q, k, v, layer_id, stored)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
               batch: ForwardBatch, out: torch.Tensor) -> None:
        self.active.attend(q, k, v, k_buf, v_buf, batch, out)
