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
from typing import TYPE_CHECKING

import torch

from rollout.attention.base import AttentionBackend
from rollout.model.forward_batch import ForwardBatch, LoraInputs
from rollout.model.llama import LlamaModel

if TYPE_CHECKING:
    from lora.pool import LoraPool


_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream every capture on `device` warms up and records on, one for the process.

    Why not a new stream per capture: cuBLAS keeps a workspace per (handle, stream), allocated
    through torch's caching allocator on the stream's first matmul, and neither dropping the
    graphs nor torch.cuda.empty_cache() frees it (torch's CUDA notes say so). Graphs are
    re-captured at every wake, so a fresh stream each time left one more workspace behind per
    sleep/wake cycle: torch's reserved memory grew 32 MiB a cycle on the H200 (BENCHMARKS.md,
    sleep/wake), the size of one cuBLAS workspace on Hopper. Clearing the workspaces instead
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


class DecodeGraphs:
    def __init__(self, model: LlamaModel, backend: AttentionBackend, max_bs: int, max_context: int,
                 device: torch.device, lora: LoraPool | None = None) -> None:
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
        # LoRA: the rows of each adapter slot (lora/segments.py), in static buffers sized for
        # max_bs rows and one segment per slot, so a replay serves any mix of adapters.
        self.lora = lora
        if lora is not None:
            s = lora.num_slots
            self.lora_row_ids = torch.zeros(max_bs, dtype=torch.int32, **kw)
            self.lora_seg_indptr = torch.zeros(s + 1, dtype=torch.int32, **kw)  # all segments empty until planned
            self.lora_seg_slots = torch.full((s,), -1, dtype=torch.int32, **kw)
        self._qo_indptr = torch.arange(max_bs + 1, dtype=torch.int32, **kw)  # one token per row
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        # With LoRA: a second graph per size with the adapter ops captured, replayed only for
        # batches that use an adapter; base-only batches replay the plain graph and pay nothing.
        self.lora_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.lora_logits: dict[int, torch.Tensor] = {}
        self.num_replays = 0
        self.num_lora_replays = 0  # of those, replays of a graph with the LoRA ops

    def _static_batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:bs], positions=self.positions[:bs], out_cache_loc=self.out_cache_loc[:bs],
            qo_indptr=self._qo_indptr[: bs + 1],
            kv_indptr=self.kv_indptr[: bs + 1], kv_indices=self.kv_indices,
            logits_indices=torch.arange(bs, device=self.device),
            extend_lens=[1] * bs, seq_lens=[self.max_context] * bs, num_decode=bs,
        )

    def variants(self) -> tuple[bool, ...]:
        """Which graphs each size gets: without LoRA ops, and with them when LoRA is on."""
        return (False, True) if self.lora is not None else (False,)

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
            for with_lora in self.variants():
                fb = self._static_batch(bs)
                self.plan_capture(fb, with_lora)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    for _ in range(2):  # warm-up: autotuning and lazy allocations stay out of the graph
                        self.model.logits(self.model(fb.input_ids, fb.positions, self.backend))
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits = self.model.logits(self.model(fb.input_ids, fb.positions, self.backend))
                (self.lora_graphs if with_lora else self.graphs)[bs] = graph
                (self.lora_logits if with_lora else self.logits)[bs] = logits
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
        self.backend.plan_replay(fb, bs)
        graphs, logits = (self.lora_graphs, self.lora_logits) if fb.lora_active else (self.graphs, self.logits)
        graphs[bs].replay()
        self.num_replays += 1
        self.num_lora_replays += fb.lora_active
        return logits[bs][:b]
