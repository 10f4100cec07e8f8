"""The attention backend interface.

A backend is planned once per step (`plan`) from the ForwardBatch, then called once per
layer (`forward`): it stores the new tokens' K/V into the paged pool at `out_cache_loc`
and attends each request's new queries over all of its KV (cached prefix + new tokens,
causal among the new ones). A new kernel family is a new file, not a new `if`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from rollout.batch import ForwardBatch
from rollout.cache.kv_pool import KVPool
from rollout.kernels import KVTarget
from rollout.kernels.options import DEFAULT_OPTIONS, KernelOptions


class AttentionBackend(ABC):
    name = "base"
    # Can its kernels run inside a CUDA graph: do they read only device tensors (at
    # addresses fixed by plan_capture) once captured, with no host-side decisions per step?
    graphable = False
    # Does it attend each decode row over its own list of KV slots, in any order (a draft tree
    # node's: the context, its ancestors, itself), rather than by pages in position order?
    slot_lists = False

    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int,
                 options: KernelOptions = DEFAULT_OPTIONS) -> None:
        self.pool = pool
        self.options = options  # the engine's kernel choices (its PDL, the rotary's K/V store)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.batch: ForwardBatch | None = None

    def warm_up(self) -> int:
        """Compile, at engine start, the kernels a step may launch (returns the launches
        made); backends whose kernels compile per shape on first use override it."""
        return 0

    def shared_prefix_rows(self) -> int:
        """How many decode rows one shared-prefix group may hold in this backend's decode
        (ForwardBatch.shared, rollout/attention/prefix_kernel.py); 0: it reads every row's KV
        whole, and the runner plans no groups."""
        return 0

    def plan(self, batch: ForwardBatch) -> None:
        """Per-step metadata shared by all layers."""
        self.batch = batch

    def plan_capture(self, batch: ForwardBatch, max_context: int) -> None:
        """Plan a decode-only batch for CUDA-graph capture (graphable backends): whatever
        the kernels read at replay must live in buffers this plan fixes."""
        self.plan(batch)

    def plan_replay(self, batch: ForwardBatch, bs: int) -> None:
        """Before replaying the captured graph of batch size bs for this decode-only batch
        (after its static inputs are written): refresh any metadata the graph reads."""

    def kv_target(self, layer_id: int) -> KVTarget | None:
        """Where this step's new K/V of layer_id go, for the caller to store them in a kernel
        it runs anyway (the rotary) and then call forward(..., stored=True); None: the caller
        leaves the store to forward (KernelOptions.rotary_kv_store off: a launch of its own)."""
        batch = self.batch
        assert batch is not None, "plan() before kv_target()"
        return self.pool.target(layer_id, batch.out_cache_loc) if self.options.rotary_kv_store else None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                stored: bool = False) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hkv, D] for the batch's new tokens -> [T, H, D]. `stored`:
        k and v are already in the pool, at kv_target(layer_id)."""
        batch = self.batch
        assert batch is not None, "plan() before forward()"
        if not stored:
            self.pool.store(layer_id, batch.out_cache_loc, k, v)
        out = torch.empty_like(q)
        self.attend(q, k, v, self.pool.k_buffers[layer_id], self.pool.v_buffers[layer_id], batch, out)
        return out

    @abstractmethod
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
               batch: ForwardBatch, out: torch.Tensor) -> None:
        """Write attention of the new queries over each request's KV into `out` [T, H, D].
        The new tokens' K/V are already stored in k_buf / v_buf ([num_slots, Hkv, D])."""
