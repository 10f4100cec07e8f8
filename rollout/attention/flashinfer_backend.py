"""Attention through FlashInfer: batch decode and batch prefill over the paged KV pool.

Planned once per step for all layers: the step's slot-level KV layout becomes a page
table (`page_table.py`), the decode wrapper is planned for the leading decode rows and
the paged-prefill wrapper (causal, bottom-right aligned: new tokens see the whole cached
prefix) for the extend rows. The pool's per-layer `[num_slots, Hkv, D]` buffers are
viewed as FlashInfer's NHD pages `[num_pages, P, Hkv, D]` without a copy.

CUDA graphs: one decode wrapper per captured batch size (FlashInfer fixes the batch size
of a graph-mode wrapper), all sharing one set of index buffers; `plan_replay` re-plans
the replayed size's wrapper with the real rows plus padding rows (one token of the
reserved page 0) before each replay. FlashInfer's split-KV choice in graph mode depends
only on the batch size, so a plan at replay never changes the captured kernels.

FlashInfer's plan copies its schedule from a page-locked host buffer with an async
memcpy; the next plan of the same wrapper overwrites that buffer, so it first waits for
the previous copy (an event recorded after the plan; with overlap scheduling the host can
otherwise run one plan ahead of the device).

Only imports on CUDA machines with `flashinfer` installed (the `auto` choice there).
"""

from __future__ import annotations

import flashinfer  # an ImportError here makes make_backend fall back (auto) or refuse (flashinfer)
import torch

from rollout.attention.base import AttentionBackend
from rollout.attention.page_table import PageTable, page_table
from rollout.batch import ForwardBatch
from rollout.cache.kv_pool import KVPool
from rollout.device import pinned
from rollout.kernels.options import DEFAULT_OPTIONS, KernelOptions

_WORKSPACE_BYTES = 256 * 1024 * 1024  # split-KV partial outputs; FlashInfer recommends >= 128 MB


class _Planned:
    """A wrapper plus the event after its last plan (see the module note)."""

    def __init__(self, wrapper) -> None:
        self.wrapper = wrapper
        self.event: torch.cuda.Event | None = None

    def plan(self, device: torch.device, *args, **kwargs) -> None:
        if self.event is not None:
            self.event.synchronize()
        self.wrapper.plan(*args, **kwargs)
        if device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record()


class FlashInferAttention(AttentionBackend):
    name = "flashinfer"
    graphable = True

    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int,
                 options: KernelOptions = DEFAULT_OPTIONS) -> None:
        super().__init__(pool, num_heads, num_kv_heads, head_dim, options)
        self.device = pool.k_buffers[0].device
        self.dtype = pool.k_buffers[0].dtype
        if self.device.type == "cuda" and self.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"attention backend 'flashinfer' needs a bf16/fp16 KV cache, got {self.dtype}")
        self.page_size = pool.page_size
        self.workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        # Decode on tensor cores (FlashInfer's prefill kernel with one query row per request)
        # when a KV head serves >= 4 query heads, as SGLang does: at large batches the CUDA-core
        # kernel reads the KV well below the rate tensor-core kernels reach (BENCHMARKS.md,
        # "Decode attention at large batches, kernel against kernel (H200, 2026-12-02, ...)").
        self.decode_tensor_cores = num_heads // num_kv_heads >= 4
        self.decode = _Planned(flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.decode_tensor_cores))
        self.prefill = _Planned(flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD"))
        self.graph_decode: dict[int, _Planned] = {}
        self._graph_bufs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.active_decode: _Planned | None = None

    def _kw(self) -> dict:
        return dict(q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale)

    def _plan_decode(self, planned: _Planned, pt: PageTable) -> None:
        # plan() copies its CPU index arrays with non_blocking=True: pinned, that copy is async
        planned.plan(self.device, pinned(pt.indptr, self.device), pt.indices, pinned(pt.last_page_len, self.device),
                     self.num_heads, self.num_kv_heads, self.head_dim, self.page_size, **self._kw())

    def plan(self, batch: ForwardBatch) -> None:
        super().plan(batch)
        nd, bsz = batch.num_decode, batch.batch_size
        pt = page_table(batch.seq_lens, batch.kv_indices, self.page_size)
        self.active_decode = None
        if nd:
            self._plan_decode(self.decode, pt.rows(0, nd))
            self.active_decode = self.decode
        if nd < bsz:
            ext = pt.rows(nd, bsz)
            qo = torch.zeros(bsz - nd + 1, dtype=torch.int32)
            qo[1:] = torch.tensor(batch.extend_lens[nd:], dtype=torch.int32).cumsum(0)
            self.prefill.plan(
                self.device, pinned(qo, self.device), pinned(ext.indptr, self.device), ext.indices,
                pinned(ext.last_page_len, self.device), self.num_heads, self.num_kv_heads, self.head_dim,
                self.page_size, causal=True, **self._kw(),
            )

    # ---- CUDA graphs ------------------------------------------------------------------

    def _graph_wrapper(self, bs: int, max_context: int) -> _Planned:
        if bs not in self.graph_decode:
            if self._graph_bufs is None:  # sized by the first (largest) captured batch
                max_pages = bs * -(-max_context // self.page_size) + bs
                self._graph_bufs = (
                    torch.zeros(bs + 1, dtype=torch.int32, device=self.device),
                    torch.zeros(max_pages, dtype=torch.int32, device=self.device),
                    torch.ones(bs, dtype=torch.int32, device=self.device),
                )
            indptr, indices, last = self._graph_bufs
            if bs + 1 > indptr.numel():
                raise ValueError("capture CUDA graphs largest batch first (shared index buffers are sized by it)")
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.decode_tensor_cores,
                paged_kv_indptr_buffer=indptr[: bs + 1],
                paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last[:bs],
            )
            self.graph_decode[bs] = _Planned(wrapper)
        return self.graph_decode[bs]

    def plan_capture(self, batch: ForwardBatch, max_context: int) -> None:
        """Plan the graph wrapper of this batch size with one token of page 0 per row: the
        warm-up runs read only the padding page, the graph keeps the wrapper's buffers."""
        super().plan(batch)
        bs = batch.batch_size
        if bs not in self.graph_decode:
            planned = self._graph_wrapper(bs, max_context)
            self._plan_decode(planned, self._padded(None, bs))
        self.active_decode = self.graph_decode[bs]

    def plan_replay(self, batch: ForwardBatch, bs: int) -> None:
        """Before replaying the graph of size bs for this decode-only batch."""
        planned = self.graph_decode[bs]
        self._plan_decode(planned, self._padded(page_table(batch.seq_lens, batch.kv_indices, self.page_size), bs))

    def _padded(self, pt: PageTable | None, bs: int) -> PageTable:
        """`pt`'s rows, then padding rows of one token in page 0, up to bs rows."""
        b = 0 if pt is None else pt.last_page_len.numel()
        pad = bs - b
        base = 0 if pt is None else int(pt.indptr[-1])
        indptr = torch.arange(base, base + pad + 1, dtype=torch.int32)
        zeros = torch.zeros(pad, dtype=torch.int32, device=self.device)
        if pt is None:
            return PageTable(indptr, zeros, torch.ones(pad, dtype=torch.int32))
        return PageTable(
            torch.cat([pt.indptr, indptr[1:]]), torch.cat([pt.indices, zeros]),
            torch.cat([pt.last_page_len, torch.ones(pad, dtype=torch.int32)]),
        )

    # ---- the per-layer call -----------------------------------------------------------

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
               batch: ForwardBatch, out: torch.Tensor) -> None:
        ps, hkv, d = self.page_size, self.num_kv_heads, self.head_dim
        kv = (k_buf.view(-1, ps, hkv, d), v_buf.view(-1, ps, hkv, d))  # NHD pages, no copy
        q = q.contiguous()
        nd = batch.num_decode
        if self.active_decode is not None and nd:
            self.active_decode.wrapper.run(q[:nd], kv, out=out[:nd])
        if nd < batch.batch_size:
            self.prefill.wrapper.run(q[nd:], kv, out=out[nd:])
