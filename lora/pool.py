"""LoraPool: the device slots adapters run from, and the per-layer hooks that apply them.

For every engine module an adapter may target, two buffers hold all slots and layers:
    A: [num_slots, num_layers, num_slices * max_rank, in_features]   (lora_A of each slice, rank-padded)
    B: [num_slots, num_layers, out_features, max_rank]               (lora_B * scaling, slice j on its columns)
plus `slot_ranks` [num_slots] int32. A layer's kernels read the view [:, layer] (slots at a
stride); slot-major, so one slot's A (or B) of a module is one contiguous region and one HF
module's lora_A over consecutive layers one strided region: an adapter laid out the same way
(lora/flat.py) moves in or out in a copy per run, not per tensor. Addresses never change
while awake, so a decode CUDA graph captured once replays any mix of adapters: a step only
writes which slot each request uses.

Under tensor parallelism (`tp`) the buffers hold this rank's part: B's output rows of a
column-parallel module (qkv, gate_up) and A's input columns of a row-parallel one (o_proj,
down_proj), whose delta B(A_r x_r) is then summed with the base output by the all-reduce.
Adapters arrive and are kept whole on the host; each rank copies its part in and out.

The pool knows buffers and slot contents; which adapter sits in which slot, and when one
may be replaced, is LoraManager's business (manager.py). The hooks (hook.py) apply them.
"""

from __future__ import annotations

import torch

from lora.flat import Run
from lora.hook import LoraHook
from lora.image import HostImage
from lora.layout import HF_TO_ENGINE, ROW_PARALLEL, ModuleShape, engine_modules_for, module_shapes
from rollout.batch import LoraInputs
from rollout.distributed.tp import SINGLE, TensorParallel
from rollout.kernels.options import DEFAULT_OPTIONS, KernelOptions
from rollout.model.config import ModelConfig
from rollout.model.parallel import take_shard


# Defaults of the pool's KernelOptions fields (lora_defer_max_rows, lora_concurrent_max_rows).
# Deferred deltas up to this many rows: at small batches the side stream's shrink, memset and
# expand hide under the base GEMMs, and the consumer's add replaces an expand launch on the
# critical path; with more rows the side stream's work outlasts the GEMMs it hides
# under and the fp32 delta's traffic costs more than the launch saves (python -m
# benchmarks.kernels.sgmv --only step; BENCHMARKS.md, multi-LoRA, "H200, 2026-12-01: deferred
# deltas, no LoRA kernel on batch 1's critical path").
DEFER_MAX_ROWS = 16
# The side stream itself (concurrent shrinks) up to this many rows. Past about 200 rows the
# GEMMs fill the GPU and the branch only delays them (the same bench; BENCHMARKS.md, multi-LoRA,
# "H200, 2026-12-01: no side stream past 192 rows").
CONCURRENT_MAX_ROWS = 192


class LoraPool:
    def __init__(self, cfg: ModelConfig, num_slots: int, max_rank: int, targets: tuple[str, ...],
                 dtype: torch.dtype, device: torch.device, tp: TensorParallel = SINGLE,
                 options: KernelOptions = DEFAULT_OPTIONS) -> None:
        if device.type == "cuda" and device.index is None:  # "cuda" -> "cuda:N", so device checks compare equal
            device = torch.device("cuda", torch.cuda.current_device())
        self.num_slots, self.max_rank, self.device, self.tp = num_slots, max_rank, device, tp
        self.num_layers, self.dtype = cfg.num_layers, dtype
        shapes = module_shapes(cfg, tp.size)
        self.shapes: dict[str, ModuleShape] = {m: shapes[m] for m in engine_modules_for(targets)}
        self.targets = frozenset(targets)
        L = cfg.num_layers
        self.a_stack: dict[str, torch.Tensor] = {
            name: torch.zeros(num_slots, L, s.num_slices * max_rank, s.in_features, dtype=dtype, device=device)
            for name, s in self.shapes.items()}
        self.b_stack: dict[str, torch.Tensor] = {
            name: torch.zeros(num_slots, L, s.out_features, max_rank, dtype=dtype, device=device)
            for name, s in self.shapes.items()}
        self.slot_ranks = torch.zeros(num_slots, dtype=torch.int32, device=device)
        # (layer, module) -> that layer's [num_slots, ...] views, what the kernels read
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        # (slot, layer, module, rank) / (slot, run, rank) -> views: an update writes hundreds
        # of tensors, and slicing them anew each time costs more host time than the copies
        self._view_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._run_cache: dict[tuple[int, Run, int], torch.Tensor] = {}
        self._named_cache: dict[tuple[int, int], tuple] = {}  # (slot, rank) -> write_named's plan
        self.bind_views()
        self.batch: LoraInputs | None = None  # the next forward's segments; None: no adapter runs
        self.concurrent = False  # the next forward's shrinks run beside the base matmuls (hook.py)
        # The kernels' options (the hooks pass them to lora.ops) and the pool's policy from them:
        self.options = options
        # deferred deltas (hook.py): batches of up to this many rows leave the expand's delta
        # to the consumer kernel; 0 turns deferral off
        self.defer_max_rows = DEFER_MAX_ROWS if options.lora_defer_max_rows is None else options.lora_defer_max_rows
        # side-stream shrinks up to this many rows (plan)
        self.concurrent_max_rows = CONCURRENT_MAX_ROWS if options.lora_concurrent_max_rows is None \
            else options.lora_concurrent_max_rows
        self.defer_eager = options.lora_defer_eager  # defer outside graphs too (one stream): the path on CPU
        # a one-row step's adapter term goes into the base GEMV's epilogue (hook.py `one_row`);
        # False: the two halves apart, as at more rows
        self.one_row_epilogue = options.lora_one_row_epilogue
        self._side_stream: torch.cuda.Stream | None = None

    def bind_views(self) -> None:
        """(Re)make the per-layer views of the stacks: at start-up and after the stacks'
        storage is re-made on wake (views would keep the released storage alive)."""
        self.forget_views()
        self.a = {(layer, m): t[:, layer] for m, t in self.a_stack.items() for layer in range(self.num_layers)}
        self.b = {(layer, m): t[:, layer] for m, t in self.b_stack.items() for layer in range(self.num_layers)}

    def release_views(self) -> None:
        """Drop every view of the stacks (the engine is going to sleep and frees them)."""
        self.forget_views()
        self.a, self.b = {}, {}

    def device_tensors(self) -> list[torch.Tensor]:
        """The buffers that own device memory (released while the engine sleeps)."""
        return [*self.a_stack.values(), *self.b_stack.values(), self.slot_ranks]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a_stack.values(), *self.b_stack.values()))

    def side_stream(self) -> torch.cuda.Stream:
        """The stream the shrinks run on beside the base matmuls (CUDA only). High priority:
        its few programs are dispatched ahead of a GEMM's waiting blocks."""
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(self.device, priority=-1)
        return self._side_stream

    # ---- slot contents ----------------------------------------------------------------
    def _local(self, hf_module: str, which: str, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part of A [..., rank, in] or B [..., out, rank] (a view)."""
        if self.tp.size == 1:
            return whole
        row_parallel = HF_TO_ENGINE[hf_module][0] in ROW_PARALLEL
        if which == "A" and row_parallel:
            return take_shard(whole, whole.dim() - 1, self.tp)
        if which == "B" and not row_parallel:
            return take_shard(whole, whole.dim() - 2, self.tp)
        return whole

    def _views(self, slot: int, layer: int, hf_module: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The parts of `slot`'s buffers that hold one module's A [rank, in] and B [out, rank]."""
        key = (slot, layer, hf_module, rank)
        views = self._view_cache.get(key)
        if views is None:
            name, j = HF_TO_ENGINE[hf_module]
            r, off = self.max_rank, self.shapes[name].slice_offsets
            views = self._view_cache[key] = (self.a_stack[name][slot, layer, j * r : j * r + rank],
                                             self.b_stack[name][slot, layer, off[j] : off[j + 1], :rank])
        return views

    def run_view(self, slot: int, run: Run, rank: int) -> torch.Tensor:
        """Where `run` lands in `slot`: [num_layers, rank, in] (A) or [num_layers, out, rank] (B),
        this rank's part under TP."""
        key = (slot, run, rank)
        view = self._run_cache.get(key)
        if view is None:
            name, j = HF_TO_ENGINE[run.module]
            r, off = self.max_rank, self.shapes[name].slice_offsets
            layers = slice(run.first_layer, run.first_layer + run.num_layers)
            view = (self.a_stack[name][slot, layers, j * r : j * r + rank] if run.which == "A"
                    else self.b_stack[name][slot, layers, off[j] : off[j + 1], :rank])
            self._run_cache[key] = view
        return view

    @torch.no_grad()
    def write(self, slot: int, image: HostImage) -> None:
        """Put an adapter in `slot` (whatever was there is gone): modules it lacks are zero.
        One host-to-device copy per run of the image."""
        for t in (*self.a_stack.values(), *self.b_stack.values()):
            t[slot].zero_()
        for run in image.runs:
            src = self._local(run.module, run.which, run.view(image.buffer))
            self.run_view(slot, run, image.rank).copy_(src, non_blocking=True)
        self.slot_ranks[slot] = image.rank

    @torch.no_grad()
    def read(self, slot: int, image: HostImage) -> None:
        """Copy `slot`'s contents back into `image` (in place; under TP into this rank's part
        of it, the only part this rank ever reads)."""
        for run in image.runs:
            self._local(run.module, run.which, run.view(image.buffer)).copy_(self.run_view(slot, run, image.rank))

    @torch.no_grad()
    def write_runs(self, slot: int, runs: list[Run], buffer: torch.Tensor, rank: int, b_scale: float) -> None:
        """In-place update of a resident adapter from a flat buffer (lora/flat.py), one copy
        per run; B is scaled on the way (rounded once, into the slot's dtype)."""
        for run in runs:
            src = self._local(run.module, run.which, run.view(buffer))
            dst = self.run_view(slot, run, rank)
            if run.which == "A":
                dst.copy_(src, non_blocking=True)
            else:
                torch.mul(src.to(dst.device, non_blocking=True), b_scale, out=dst)

    @torch.no_grad()
    def write_named(self, slot: int, keys: list[tuple[int, str, str]], tensors: list[torch.Tensor], rank: int,
                    b_scale: float) -> None:
        """In-place update of some of a resident adapter's tensors, one per key (layer, HF
        module, "A"|"B"; unscaled values), as multi-tensor ops: a few launches for the
        hundreds of tensors of an adapter. B is scaled in its incoming dtype before the copy
        rounds it, as at load. Where each key goes is cached per `keys` object: a trainer's
        repeated updates (lora.adapter.plan_update_keys) reuse it."""
        cached = self._named_cache.get((slot, rank))
        if cached is None or cached[0] is not keys:
            a_at = [i for i, key in enumerate(keys) if key[2] == "A"]
            b_at = [i for i, key in enumerate(keys) if key[2] == "B"]
            a_dst = [self._views(slot, keys[i][0], keys[i][1], rank)[0] for i in a_at]
            b_dst = [self._views(slot, keys[i][0], keys[i][1], rank)[1] for i in b_at]
            cached = self._named_cache[slot, rank] = (keys, a_at, a_dst, b_at, b_dst)
        _, a_at, a_dst, b_at, b_dst = cached
        a_src, b_src = [tensors[i] for i in a_at], [tensors[i] for i in b_at]
        if self.tp.size > 1:
            a_src = [self._local(keys[i][1], "A", t) for i, t in zip(a_at, a_src)]
            b_src = [self._local(keys[i][1], "B", t) for i, t in zip(b_at, b_src)]
        device = self.device
        a_src = [t if t.device == device else t.to(device, non_blocking=True) for t in a_src]
        b_src = [t if t.device == device else t.to(device, non_blocking=True) for t in b_src]
        if b_src:
            b_src = list(torch._foreach_mul(b_src, b_scale))
        for dst, src in ((a_dst, a_src), (b_dst, b_src)):
            if dst:
                torch._foreach_copy_(dst, src, non_blocking=True)

    def write_modules(self, slot: int, parts: list[tuple[int, str, str, torch.Tensor]], rank: int,
                      b_scale: float) -> None:
        """write_named for (layer, module, "A"|"B", value) tuples."""
        self.write_named(slot, [p[:3] for p in parts], [p[3] for p in parts], rank, b_scale)

    def forget_views(self) -> None:
        """Drop cached slot views (they would keep released buffers' storage alive)."""
        self._view_cache.clear()
        self._run_cache.clear()
        self._named_cache.clear()

    def clear(self, slot: int) -> None:
        self.slot_ranks[slot] = 0

    # ---- one step ---------------------------------------------------------------------
    def plan(self, inputs: LoraInputs | None, active: bool, concurrent: bool = False) -> None:
        """The next forward's adapters (a CUDA graph capture plans its static buffers here);
        inactive: the projections skip the adapter ops altogether. `concurrent` (CUDA graph
        captures): each shrink runs on a side stream beside its base matmul, for batches of
        up to `concurrent_max_rows` rows (larger ones run in order: CONCURRENT_MAX_ROWS)."""
        self.batch = inputs if active else None
        rows = 0 if inputs is None else inputs.row_ids.shape[0]
        self.concurrent = concurrent and self.device.type == "cuda" and rows <= self.concurrent_max_rows

    def defers(self, num_rows: int) -> bool:
        """Does a projection of `num_rows` rows that can take a delta get one (hook.py)?"""
        return (self.concurrent or self.defer_eager) and num_rows <= self.defer_max_rows

    def hook(self, layer: int, module: str) -> LoraHook | None:
        return LoraHook(self, layer, module) if module in self.shapes else None
