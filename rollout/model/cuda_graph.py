"""CUDA graphs for decode steps: one graph per batch size on a ladder, captured at start-up.

A decode-only step of batch b replays the graph of the smallest captured size >= b. The
graph reads static buffers (token ids, positions, KV slots, ragged KV indices) that each
replay overwrites; padded rows decode a dummy token at slot 0 (the reserved padding page)
over a KV of length 1 at slot 0, so they never touch a live request's KV. Logits come out
for every row; the caller keeps the first b (a step of prefill tokens laid out as decode
rows then keeps the rows that sample: rollout/model/runner.py).

Needs an attention backend whose kernels read only device tensors at replay (`graphable`):
Triton (KV split count fixed at capture, reads the static index buffers here) or
FlashInfer (one wrapper per size, re-planned by `plan_replay` before each replay).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace

import torch

from rollout.attention.base import AttentionBackend
from rollout.batch import ForwardBatch, LoraInputs, SharedPrefixes
from rollout.model.llama import LlamaModel, LoraSlots


_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream every capture on `device` warms up and records on, one for the process.

    Why not a new stream per capture: cuBLAS keeps a workspace per (handle, stream),
    allocated through torch's caching allocator on the stream's first matmul, and neither
    dropping the graphs nor torch.cuda.empty_cache() frees it (torch's CUDA notes say so).
    Graphs are re-captured at every wake, so a fresh stream each time left one more
    workspace behind per sleep/wake cycle: torch's reserved memory grew by one cuBLAS
    workspace a cycle (BENCHMARKS.md, "Sleep / wake"). Clearing the workspaces instead
    (torch._C._cuda_clearCublasWorkspaces) would also free ones a colocated trainer's own
    graphs may still replay into."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    stream = _CAPTURE_STREAMS.get(device)
    if stream is None:
        stream = _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


def batch_size_ladder(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 1025, 32))
    return [s for s in sizes if s < max_bs] + [max_bs]


@dataclass(frozen=True)
class Variant:
    """Which optional kernels a graph has captured: the adapter ops (LoRA on, replayed only for
    batches that use an adapter, so base-only batches pay nothing) and shared-prefix
    attention (replayed only for steps whose rows share a prefix)."""

    lora: bool = False
    shared: bool = False


PLAIN = Variant()


class DecodeGraphs:
    def __init__(self, model: LlamaModel, backend: AttentionBackend, max_bs: int, max_context: int,
                 device: torch.device, lora: LoraSlots | None = None, share_prefixes: bool = True) -> None:
        if not backend.graphable:
            raise ValueError(f"attention backend {backend.name!r} cannot run inside a CUDA graph")
        self.model, self.backend, self.device = model, backend, device
        self.sizes = batch_size_ladder(max_bs)
        self.max_bs, self.max_context = max_bs, max_context
        kw = dict(device=device)
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, **kw)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, **kw)
        self.out_cache_loc = torch.zeros(max_bs, dtype=torch.int64, **kw)  # padding rows write slot 0
        self.kv_indptr = torch.arange(max_bs + 1, dtype=torch.int32, **kw)
        self.kv_indices = torch.zeros(max_bs * max_context, dtype=torch.int32, **kw)
        self._pad_indptr = torch.arange(1, max_bs + 1, dtype=torch.int32, **kw)
        # LoRA: the rows of each adapter slot (rollout/model/lora_segments.py), in static buffers
        # sized for max_bs rows and one segment per slot, so a replay serves any mix of adapters.
        self.lora = lora
        if lora is not None:
            s = lora.num_slots
            self.lora_row_ids = torch.zeros(max_bs, dtype=torch.int32, **kw)
            self.lora_seg_indptr = torch.zeros(s + 1, dtype=torch.int32, **kw)  # all segments empty until planned
            self.lora_seg_slots = torch.full((s,), -1, dtype=torch.int32, **kw)
        self._qo_indptr = torch.arange(max_bs + 1, dtype=torch.int32, **kw)  # one token per row
        # Shared-prefix groups (rollout/attention/shared_prefix.py), where the backend reads a
        # prefix once per group: static buffers for max_bs rows and max_bs // 2 groups, groups
        # past a step's of length 0. `share_prefixes` False (the runner never plans groups): no
        # such variants, half the captures.
        self.shared = share_prefixes and backend.shared_prefix_rows() > 1
        if self.shared:
            g = SharedPrefixes.max_groups(max_bs)
            self.row_skip = torch.zeros(max_bs, dtype=torch.int32, **kw)
            self.grp_len = torch.zeros(g, dtype=torch.int32, **kw)
            self.grp_indptr = torch.zeros(g + 1, dtype=torch.int32, **kw)
            self.grp_rows = torch.zeros(max_bs, dtype=torch.int32, **kw)
        self.graphs: dict[tuple[int, Variant], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, Variant], torch.Tensor] = {}
        self.num_replays = 0
        self.num_lora_replays = 0  # of those, replays of a graph with the LoRA ops
        self.num_shared_replays = 0  # of those, replays with shared-prefix attention

    def _static_batch(self, bs: int, variant: Variant = PLAIN) -> ForwardBatch:
        shared = None
        if variant.shared:
            g = SharedPrefixes.max_groups(bs)
            shared = SharedPrefixes(self.row_skip[:bs], self.grp_len[:g], self.grp_indptr[: g + 1], self.grp_rows[:bs],
                                    num_groups=g, shared_tokens=0)
        return ForwardBatch(
            input_ids=self.input_ids[:bs], positions=self.positions[:bs], out_cache_loc=self.out_cache_loc[:bs],
            qo_indptr=self._qo_indptr[: bs + 1],
            kv_indptr=self.kv_indptr[: bs + 1], kv_indices=self.kv_indices,
            logits_indices=torch.arange(bs, device=self.device),
            extend_lens=[1] * bs, seq_lens=[self.max_context] * bs, num_decode=bs, shared=shared,
        )

    def variants(self, bs: int) -> list[Variant]:
        """Which graphs size bs gets: plain, with LoRA ops when LoRA is on, and each of those
        with shared-prefix attention where the backend has it (2 rows and up: a group's least)."""
        loras = (False, True) if self.lora is not None else (False,)
        shares = (False, True) if self.shared and bs > 1 else (False,)
        return [Variant(lora, shared) for lora in loras for shared in shares]

    def plan_capture(self, fb: ForwardBatch, with_lora: bool) -> None:
        """Fix what the captured kernels read: the backend's metadata and the LoRA inputs."""
        self.backend.plan_capture(fb, self.max_context)
        if self.lora is not None:
            static = LoraInputs(self.lora_row_ids[: fb.batch_size], self.lora_seg_indptr, self.lora_seg_slots,
                                fb.batch_size)
            # shrinks on a side stream beside the base matmuls: captured as graph branches
            self.lora.plan(static, with_lora, concurrent=True)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = capture_stream(self.device)
        for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its memory
            for variant in self.variants(bs):
                fb = self._static_batch(bs, variant)
                self.plan_capture(fb, variant.lora)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    for _ in range(2):  # warm-up: autotuning and lazy allocations stay out of the graph
                        self.model.logits(self.model(fb.input_ids, fb.positions, self.backend))
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits = self.model.logits(self.model(fb.input_ids, fb.positions, self.backend))
                self.graphs[bs, variant] = graph
                self.logits[bs, variant] = logits
        torch.cuda.synchronize(self.device)

    def can_run(self, fb: ForwardBatch) -> bool:
        return (
            bool(self.graphs) and fb.num_decode == fb.batch_size <= self.max_bs
            and max(fb.seq_lens) <= self.max_context
        )

    @torch.inference_mode()
    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits [b, vocab] of a decode-only batch of b requests."""
        b = fb.batch_size
        bs = self.sizes[bisect.bisect_left(self.sizes, b)]
        nnz = fb.kv_indices.numel()
        self.input_ids[:b].copy_(fb.input_ids)
        self.positions[:b].copy_(fb.positions)
        self.out_cache_loc[:b].copy_(fb.out_cache_loc)
        self.kv_indptr[: b + 1].copy_(fb.kv_indptr)
        self.kv_indices[:nnz].copy_(fb.kv_indices)
        if fb.lora_active:  # rows past b in the static row_ids are padding no segment reads
            lora = fb.lora
            self.lora_row_ids[:b].copy_(lora.row_ids[:b])  # type: ignore[union-attr]
            self.lora_seg_indptr.copy_(lora.seg_indptr)  # type: ignore[union-attr]
            self.lora_seg_slots.copy_(lora.seg_slots)  # type: ignore[union-attr]
        if bs > b:  # padding rows: token 0 at position 0, one KV entry at slot 0
            pad = bs - b
            self.input_ids[b:bs].zero_()
            self.positions[b:bs].zero_()
            self.out_cache_loc[b:bs].zero_()
            self.kv_indptr[b + 1 : bs + 1].copy_(self._pad_indptr[:pad] + nnz)
            self.kv_indices[nnz : nnz + pad].zero_()
        variant = Variant(fb.lora_active, fb.shared is not None and (bs, Variant(fb.lora_active, True)) in self.graphs)
        if variant.shared:
            self._write_shared(fb.shared, b, bs)  # type: ignore[arg-type]
        elif fb.shared is not None:
            fb = replace(fb, shared=None)  # no such graph: the plan's backend must be the plain graph's
        self.backend.plan_replay(fb, bs)
        self.graphs[bs, variant].replay()
        self.num_replays += 1
        self.num_lora_replays += variant.lora
        self.num_shared_replays += variant.shared
        return self.logits[bs, variant][:b]

    def _write_shared(self, shared: SharedPrefixes, b: int, bs: int) -> None:
        """The step's groups into the static buffers of the bs-row graph: padding rows share
        nothing, and the graph's groups past the step's are empty."""
        g, g_bs = shared.grp_len.numel(), SharedPrefixes.max_groups(bs)
        self.row_skip[:b].copy_(shared.row_skip)
        self.grp_len[:g].copy_(shared.grp_len)
        self.grp_indptr[: g + 1].copy_(shared.grp_indptr)
        self.grp_rows[:b].copy_(shared.grp_rows)
        if bs > b:
            self.row_skip[b:bs].zero_()
        if g_bs > g:
            self.grp_len[g:g_bs].zero_()
