"""LoraPool: the device slots adapters run from, and the per-layer hooks that apply them.

For every layer and every engine module an adapter may target, two buffers hold all slots:
    A: [num_slots, num_slices * max_rank, in_features]   (lora_A of each slice, rank-padded)
    B: [num_slots, out_features, max_rank]                (lora_B * scaling, slice j on its columns)
plus `slot_ranks` [num_slots] int32. Their addresses never change, so a decode CUDA graph
captured once replays any mix of adapters: a step only writes which slot each request uses.

Under tensor parallelism (`tp`) the buffers hold this rank's part: B's output rows of a
column-parallel module (qkv, gate_up) and A's input columns of a row-parallel one (o_proj,
down_proj), whose delta B(A_r x_r) is then summed with the base output by the all-reduce.
Adapters arrive and are kept whole on the host; each rank copies its part in and out.

The pool knows buffers and slot contents; which adapter sits in which slot, and when one
may be replaced, is LoraManager's business (manager.py).
"""

from __future__ import annotations

import torch

from lora.layout import HF_TO_ENGINE, ROW_PARALLEL, ModuleShape, engine_modules_for, module_shapes
from lora.ops import sgmv_expand, sgmv_shrink
from rollout.distributed.tp import SINGLE, TensorParallel
from rollout.model.config import ModelConfig
from rollout.model.parallel import take_shard
from rollout.model.forward_batch import LoraInputs

# (layer, HF module name) -> (lora_A [rank, in], lora_B * scaling [out, rank]), model dtype
EngineAdapter = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


class LoraPool:
    def __init__(self, cfg: ModelConfig, num_slots: int, max_rank: int, targets: tuple[str, ...],
                 dtype: torch.dtype, device: torch.device, tp: TensorParallel = SINGLE) -> None:
        if device.type == "cuda" and device.index is None:  # "cuda" -> "cuda:N", so device checks compare equal
            device = torch.device("cuda", torch.cuda.current_device())
        self.num_slots, self.max_rank, self.device, self.tp = num_slots, max_rank, device, tp
        shapes = module_shapes(cfg, tp.size)
        self.shapes: dict[str, ModuleShape] = {m: shapes[m] for m in engine_modules_for(targets)}
        self.targets = frozenset(targets)
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        for layer in range(cfg.num_layers):
            for name, s in self.shapes.items():
                self.a[layer, name] = torch.zeros(num_slots, s.num_slices * max_rank, s.in_features, dtype=dtype, device=device)
                self.b[layer, name] = torch.zeros(num_slots, s.out_features, max_rank, dtype=dtype, device=device)
        self.slot_ranks = torch.zeros(num_slots, dtype=torch.int32, device=device)
        self.batch: LoraInputs | None = None  # the next forward's segments; None: no adapter runs
        # (slot, layer, module, rank) -> views: an update writes hundreds of tensors, and
        # slicing them anew each time costs more host time than the copies themselves
        self._view_cache: dict[tuple[int, int, str, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b.values()))

    # ---- slot contents ----------------------------------------------------------------
    def _local(self, hf_module: str, which: str, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part of an adapter's A [rank, in] or B [out, rank] (a view)."""
        if self.tp.size == 1:
            return whole
        row_parallel = HF_TO_ENGINE[hf_module][0] in ROW_PARALLEL
        if which == "A" and row_parallel:
            return take_shard(whole, 1, self.tp)
        if which == "B" and not row_parallel:
            return take_shard(whole, 0, self.tp)
        return whole

    def _views(self, slot: int, layer: int, hf_module: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The parts of `slot`'s buffers that hold one module's A [rank, in] and B [out, rank]."""
        key = (slot, layer, hf_module, rank)
        views = self._view_cache.get(key)
        if views is None:
            views = self._view_cache[key] = self._slice(slot, layer, hf_module, rank)
        return views

    def _slice(self, slot: int, layer: int, hf_module: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        name, j = HF_TO_ENGINE[hf_module]
        shape, r = self.shapes[name], self.max_rank
        off = shape.slice_offsets
        a = self.a[layer, name][slot, j * r : j * r + rank]
        b = self.b[layer, name][slot, off[j] : off[j + 1], :rank]
        return a, b

    @torch.no_grad()
    def write(self, slot: int, adapter: EngineAdapter, rank: int) -> None:
        """Put an adapter in `slot` (whatever was there is gone): modules it lacks are zero."""
        for key in self.a:
            self.a[key][slot].zero_()
            self.b[key][slot].zero_()
        for (layer, hf_module), (a, b) in adapter.items():
            a_dst, b_dst = self._views(slot, layer, hf_module, rank)
            a_dst.copy_(self._local(hf_module, "A", a), non_blocking=True)
            b_dst.copy_(self._local(hf_module, "B", b), non_blocking=True)
        self.slot_ranks[slot] = rank

    @torch.no_grad()
    def write_modules(self, slot: int, parts: list[tuple[int, str, str, torch.Tensor]], rank: int,
                      b_scale: float) -> None:
        """In-place update of some of a resident adapter's tensors: (layer, module, "A"|"B",
        unscaled value), as multi-tensor ops (a few launches for the hundreds of tensors of an
        adapter). B is scaled in its incoming dtype before the copy rounds it, as at load."""
        a_dst, a_src, b_dst, b_src = [], [], [], []
        for layer, hf_module, which, value in parts:
            views = self._views(slot, layer, hf_module, rank)
            value = self._local(hf_module, which, value)
            if value.device != self.device:
                value = value.to(self.device, non_blocking=True)
            if which == "A":
                a_dst.append(views[0])
                a_src.append(value)
            else:
                b_dst.append(views[1])
                b_src.append(value)
        if b_src:
            b_src = list(torch._foreach_mul(b_src, b_scale))
        for dst, src in ((a_dst, a_src), (b_dst, b_src)):
            if dst:
                torch._foreach_copy_(dst, src, non_blocking=True)

    @torch.no_grad()
    def read(self, slot: int, adapter: EngineAdapter, rank: int) -> None:
        """Copy `slot`'s contents back into the host tensors of `adapter` (in place; under
        TP into this rank's part of them, the only part this rank ever reads)."""
        for (layer, hf_module), (a, b) in adapter.items():
            a_src, b_src = self._views(slot, layer, hf_module, rank)
            self._local(hf_module, "A", a).copy_(a_src)
            self._local(hf_module, "B", b).copy_(b_src)

    def forget_views(self) -> None:
        """Drop cached slot views (they would keep released buffers' storage alive)."""
        self._view_cache.clear()

    def clear(self, slot: int) -> None:
        self.slot_ranks[slot] = 0

    # ---- one step ---------------------------------------------------------------------
    def plan(self, inputs: LoraInputs | None, active: bool) -> None:
        """The next forward's adapters (a CUDA graph capture plans its static buffers here);
        inactive: the projections skip the adapter ops altogether."""
        self.batch = inputs if active else None

    def hook(self, layer: int, module: str) -> LoraHook | None:
        return LoraHook(self, layer, module) if module in self.shapes else None


class LoraHook:
    """Installed on one projection (`Linear.lora`): adds the step's adapter deltas to its
    output in place, two batched kernels per call whatever the mix of adapters."""

    def __init__(self, pool: LoraPool, layer: int, module: str) -> None:
        self.pool = pool
        self.a, self.b = pool.a[layer, module], pool.b[layer, module]
        shape = pool.shapes[module]
        self.num_slices, self.slice_offsets = shape.num_slices, shape.slice_offsets

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        # x: [T, in], out: [T, out] (the base projection's result, updated in place)
        batch = self.pool.batch
        if batch is None:
            return
        pool = self.pool
        h = sgmv_shrink(x, self.a, batch.row_ids, batch.seg_indptr, batch.seg_slots, pool.slot_ranks,
                        num_slices=self.num_slices, max_rank=pool.max_rank)
        sgmv_expand(h, self.b, out, batch.row_ids, batch.seg_indptr, batch.seg_slots, pool.slot_ranks,
                    slice_offsets=self.slice_offsets, max_rank=pool.max_rank)
