"""ModelRunner: ScheduledBatch (CPU) -> ForwardBatch (device) -> logits.

Builds the step's flat token layout from the request table, plans the attention backend
once for all layers, runs the model and returns float32 logits only for the requests
that sample this step.
"""

from __future__ import annotations

import numpy as np
import torch

from rollout.attention import shared_prefix
from rollout.attention.base import AttentionBackend
from rollout.batch import ForwardBatch, LoraInputs, ScheduledBatch, SharedPrefixes
from rollout.device import to_device, upload
from rollout.kernels.options import DEFAULT_OPTIONS, KernelOptions
from rollout.model.cuda_graph import DecodeGraphs
from rollout.model.llama import LlamaModel, LoraSlots
from rollout.model.lora_segments import plan_segments
from rollout.request import Req

# The default budget of KV tokens that prefill rows may read (ModelRunner.extend_rows_kv): a
# 128-token prompt alone reads 8256, a 362-token one 65703. A short prefill run eager is
# hundreds of host-bound launches, as rows one graph replay; but each row reads its whole
# context, so the rows' lead shrinks as prompts grow, and this budget keeps them to the prompts
# where they won (BENCHMARKS.md, "Batch 1, H200, 2026-12-02 ...: small prefills as decode
# rows").
EXTEND_ROWS_KV = 65536


def _decode(req: Req, n: int) -> bool:
    """Is this request's part of the step a plain decode: one new token, its last known one?"""
    return n == 1 and bool(req.output_ids) and req.num_computed_tokens + 1 == req.seq_len


class ModelRunner:
    def __init__(self, model: LlamaModel, backend: AttentionBackend | None, table: torch.Tensor, device: torch.device,
                 lora: LoraSlots | None = None, options: KernelOptions = DEFAULT_OPTIONS) -> None:
        self.model = model
        self.backend = backend  # None until build.attach_backend (re-made on wake from sleep)
        self.lora = lora  # the adapter slots the model's projections read (None: LoRA off)
        self.table = table  # [max_requests, max_context] int64, CPU
        self.table_np = table.numpy()  # the same memory, for cheap row slicing
        self.device = device
        self.graphs: DecodeGraphs | None = None
        # Verify steps as decode rows (see _prepare_rows) up to this many rows; None: up to
        # the largest decode graph (any number without graphs); 0: never
        # (KernelOptions.verify_rows_max, for benchmarks and tests)
        self.verify_rows_max: int | None = options.verify_rows_max
        # Prefill chunks as decode rows too (see _prepare_rows), so a small prefill replays a
        # decode graph instead of ~20 eager launches a layer from the host, when the rows fit
        # the largest graph and their KV reads (each row re-reads its request's KV up to
        # itself) sum to at most this many tokens. None: EXTEND_ROWS_KV when decode graphs are
        # captured, else 0 (without a graph to replay, rows only add attention reads); 0: never.
        # (KernelOptions.extend_rows_kv, for benchmarks and tests)
        self.extend_rows_kv: int | None = options.extend_rows_kv
        # Decode steps group rows that share a tree-owned KV prefix (n samples of a prompt) so
        # attention reads each prefix once per group, where the backend can (shared_prefix.py);
        # EngineConfig.shared_prefix_attention sets it before the graphs are captured (on, they
        # get a variant with it); False: never.
        self.share_prefixes = True
        # the last token sampled for each request row, on the device (overlap scheduling
        # feeds in-flight tokens from here without a host round trip)
        self.last_tokens = torch.zeros(table.shape[0], dtype=torch.int64, device=device)

    def capture_decode_graphs(self, max_bs: int, max_context: int) -> None:
        self.graphs = DecodeGraphs(self.model, self.backend, max_bs, max_context, self.device, self.lora,
                                   share_prefixes=self.share_prefixes)
        self.graphs.capture()

    def prepare(self, batch: ScheduledBatch) -> ForwardBatch:
        if batch.num_decode == len(batch.reqs) and all(r.output_ids or r.num_inflight for r in batch.reqs):
            return self._prepare_decode(batch)
        if self._as_rows(batch):
            return self._prepare_rows(batch)
        if any(r.draft_parents is not None for r in batch.reqs):  # the drafter checks tree_rows_max
            raise RuntimeError("a step with draft trees must run as decode rows (ModelRunner.tree_rows_max)")
        input_ids: list[int] = []
        positions: list[np.ndarray] = []
        out_locs: list[np.ndarray] = []
        kv_parts: list[np.ndarray] = []
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        num_tokens = 0
        inflight: list[tuple[int, int]] = []  # (token index, request row) fed from the device
        for i, (req, n) in enumerate(zip(batch.reqs, batch.extend_lens)):
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            if req.num_inflight:
                inflight.append((num_tokens, req.req_pool_idx))
                input_ids.append(0)
            elif _decode(req, n):
                input_ids.append(req.output_ids[-1])  # decode: skip building all_ids
            elif req.draft_tokens:  # verify: the last token, then the drafts
                input_ids.extend(req.all_ids[start:] + req.draft_tokens)
            else:
                input_ids.extend(req.all_ids[start:end])
            row = self.table_np[req.req_pool_idx]
            positions.append(np.arange(start, end, dtype=np.int64))
            out_locs.append(row[start:end])
            kv_parts.append(row[:end])
            seq_lens.append(end)
            num_tokens += n
            if batch.produces_token(i):  # one row per draft position, plus the last
                logits_indices.extend(range(num_tokens - 1 - len(req.draft_tokens), num_tokens))
        return self._finish(
            torch.tensor(input_ids, dtype=torch.int64), torch.from_numpy(np.concatenate(positions)),
            torch.from_numpy(np.concatenate(out_locs)), torch.from_numpy(np.concatenate(kv_parts)),
            torch.tensor(logits_indices, dtype=torch.int64), batch, seq_lens, inflight,
        )

    def _prepare_decode(self, batch: ScheduledBatch) -> ForwardBatch:
        """Decode-only step (the common case): the KV slot lists are row slices of the
        request table joined by numpy (a torch boolean-mask gather of the padded [B, L]
        block measured ~7x slower at batch 256), so host time stays small as batches grow."""
        reqs = batch.reqs
        rows = [r.req_pool_idx for r in reqs]
        seq_lens = [r.seq_len for r in reqs]
        positions = np.asarray(seq_lens, dtype=np.int64) - 1
        table = self.table_np
        kv_indices = np.concatenate([table[row, :n] for row, n in zip(rows, seq_lens)])
        inflight = [(i, r.req_pool_idx) for i, r in enumerate(reqs) if r.num_inflight]
        shared = None
        if self.share_prefixes and len(reqs) > 1 and self.backend is not None:
            members = self.backend.shared_prefix_rows()
            if members > 1:
                shared = shared_prefix.plan(reqs, table, members, self.device)
        return self._finish(
            torch.tensor([0 if r.num_inflight else r.output_ids[-1] for r in reqs], dtype=torch.int64),
            torch.from_numpy(positions), torch.from_numpy(table[rows, positions]), torch.from_numpy(kv_indices),
            torch.arange(len(reqs), dtype=torch.int64), batch, seq_lens, inflight, shared=shared,
        )

    def _as_rows(self, batch: ScheduledBatch) -> bool:
        """Does this step run as decode rows: decodes and verifies within verify_rows_max, or
        with prefill chunks among them, rows that fit the largest decode graph and KV reads
        within extend_rows_kv?"""
        rows = extend_kv = 0
        for req, n in zip(batch.reqs, batch.extend_lens):
            if req.draft_tokens:  # a verify: its last known token, then its drafts
                if n != 1 + len(req.draft_tokens) or req.num_inflight or req.num_computed_tokens + 1 != req.seq_len:
                    return False
            elif req.num_inflight:
                if n != 1:
                    return False  # only a decode has a token in flight
            elif not _decode(req, n):
                extend_kv += n * req.num_computed_tokens + n * (n + 1) // 2  # a prefill chunk: its rows' KV
            rows += n
        graph_rows = self.graphs.max_bs if self.graphs is not None else 1 << 30
        if extend_kv:
            budget = self.extend_rows_kv
            if budget is None:
                budget = EXTEND_ROWS_KV if self.graphs is not None else 0
            return extend_kv <= budget and rows <= graph_rows
        if not any(r.draft_tokens for r in batch.reqs):
            return False  # plain decodes: _prepare_decode's layout
        return rows <= (self.verify_rows_max if self.verify_rows_max is not None else graph_rows)

    def tree_rows_max(self) -> int:
        """The most rows a verify step with draft trees may have. A tree node's row attends
        to the context, its ancestors and itself: a list of slots out of position order, which
        only a backend with `slot_lists` reads (not FlashInfer's pages), and only as decode
        rows (a graph, or eager rows where no graph is captured)."""
        backend = self.backend
        if backend is None or not backend.slot_lists:
            return 0
        limit = 1 << 30
        if self.graphs is not None:
            limit = self.graphs.max_bs
            small = getattr(backend, "max_rows", None)  # SmallDecode: graphs past it attend by page
            if small is not None:
                limit = min(limit, small)
        if self.verify_rows_max is not None:
            limit = min(limit, self.verify_rows_max)
        return limit

    def _prepare_rows(self, batch: ScheduledBatch) -> ForwardBatch:
        """A step laid out as decode rows: new token j of a request (a prefill chunk's token,
        or position j of a request verifying k drafts) is a row of its own whose KV is the
        request's slots up to and including j. Every layer stores all rows' K/V before
        attending, so row j sees the tokens before it, as causal attention over the request
        would; the step is then decode-shaped and replays a decode CUDA graph (of rows =
        the step's new tokens) instead of running eagerly. Each row re-reads its request's
        KV: cheap next to the weights at the sizes graphs cover and the budget allows.

        A draft tree (req.draft_parents) lays its nodes out the same way: node i's K/V goes to
        the slot of position start + 1 + i, its rotary position is start + its depth, and its
        row's KV is the context, its ancestors' slots and its own (step.py moves the accepted
        path's KV into position order afterwards).

        A request's rows all start with its slots before the step, so in a step of enough rows
        and where the backend can, they are grouped to read them once (shared_prefix.plan_spans)."""
        table = self.table_np
        input_ids: list[int] = []
        positions: list[int] = []
        seq_lens: list[int] = []
        out_locs: list[np.ndarray] = []
        kv_parts: list[np.ndarray] = []
        logits_indices: list[int] = []
        inflight: list[tuple[int, int]] = []
        slot_rows = False
        spans: list[tuple[int, int, int]] = []  # (slots shared, first row, rows) of each request
        for i, (req, n) in enumerate(zip(batch.reqs, batch.extend_lens)):
            row, start = table[req.req_pool_idx], req.num_computed_tokens
            if n > 1:
                spans.append((start, len(input_ids), n))
            if req.draft_parents is not None:
                slot_rows = True
                input_ids.append(req.output_ids[-1])
                input_ids.extend(req.draft_tokens)
                out_locs.append(row[start : start + n])
                positions.append(start)
                positions.extend(start + d for d in req.draft_depths())
                context = row[: start + 1]
                kv_parts.append(context)
                seq_lens.append(start + 1)
                paths: list[list[int]] = []  # each node's slots below the context: its ancestors', its own
                for j, parent in enumerate(req.draft_parents):
                    paths.append((paths[parent] if parent >= 0 else []) + [start + 1 + j])
                    kv_parts.append(np.concatenate([context, row[paths[j]]]))
                    seq_lens.append(start + 1 + len(paths[j]))
                logits_indices.extend(range(len(input_ids) - n, len(input_ids)))  # a verify always samples
                continue
            if req.num_inflight:  # a decode whose token the host has not seen yet
                inflight.append((len(input_ids), req.req_pool_idx))
                input_ids.append(0)
            elif req.draft_tokens or _decode(req, n):
                input_ids.append(req.output_ids[-1])  # a decode or a verify: skip building all_ids
                input_ids.extend(req.draft_tokens)
            else:
                input_ids.extend(req.all_ids[start : start + n])
            out_locs.append(row[start : start + n])
            positions.extend(range(start, start + n))
            seq_lens.extend(range(start + 1, start + n + 1))
            kv_parts.extend(row[:end] for end in range(start + 1, start + n + 1))
            if batch.produces_token(i):  # one row per draft position, plus the last
                logits_indices.extend(range(len(input_ids) - 1 - len(req.draft_tokens), len(input_ids)))
        rows = len(input_ids)
        shared = None
        if spans and self.share_prefixes and self.backend is not None:
            members = self.backend.shared_prefix_rows()
            if members > 1:
                shared = shared_prefix.plan_spans(spans, rows, members, self.device)
        return self._finish(  # LoRA segments per request: its rows are contiguous, as in the extend layout
            torch.tensor(input_ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64),
            torch.from_numpy(np.concatenate(out_locs)), torch.from_numpy(np.concatenate(kv_parts)),
            torch.tensor(logits_indices, dtype=torch.int64), batch, seq_lens, inflight, row_lens=[1] * rows,
            shared=shared, slot_rows=slot_rows,
        )

    def _finish(self, input_ids: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor,
                kv_indices: torch.Tensor, logits_indices: torch.Tensor, batch: ScheduledBatch,
                seq_lens: list[int], inflight: list[tuple[int, int]], row_lens: list[int] | None = None,
                shared: SharedPrefixes | None = None, slot_rows: bool = False) -> ForwardBatch:
        """`row_lens`: new tokens per attention row when rows are not the batch's requests
        (a verify step as decode rows: all decodes)."""
        extend_lens = list(batch.extend_lens) if row_lens is None else row_lens
        qo_indptr = np.zeros(len(seq_lens) + 1, dtype=np.int32)
        np.cumsum(extend_lens, dtype=np.int32, out=qo_indptr[1:])
        kv_indptr = np.zeros(len(seq_lens) + 1, dtype=np.int32)
        np.cumsum(seq_lens, dtype=np.int32, out=kv_indptr[1:])
        parts = [t.numpy() for t in (input_ids, positions, out_cache_loc, kv_indices, logits_indices)]
        plan = None
        if self.lora is not None:  # LoRA segments: the step's rows grouped by adapter slot
            plan = plan_segments([r.lora_slot for r in batch.reqs], batch.extend_lens, num_rows=len(input_ids),
                                 num_segments=self.lora.num_slots)
            parts += [plan.row_ids, plan.seg_indptr, plan.seg_slots]
        if inflight:  # tokens sampled last step, not yet seen by the host: where they go, whose they are
            parts += list(np.asarray(inflight, dtype=np.int64).T)
        # the step's metadata in one host-to-device copy (a step without overlap waits for it)
        input_ids, positions, out_cache_loc, kv_indices, logits_indices, qo, kv, *rest = upload(
            parts[:5] + [qo_indptr, kv_indptr] + parts[5:], self.device)
        lora = None
        if plan is not None:
            lora, rest = LoraInputs(*rest[:3], plan.num_lora_rows), rest[3:]
        if rest:  # the in-flight tokens: fed from the device's last sampled token of each request row
            input_ids[rest[0]] = self.last_tokens[rest[1]]
        return ForwardBatch(
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=out_cache_loc,
            qo_indptr=qo,
            kv_indptr=kv,
            kv_indices=kv_indices,
            logits_indices=logits_indices,
            extend_lens=extend_lens,
            seq_lens=seq_lens,
            num_decode=batch.num_decode if row_lens is None else len(row_lens),
            lora=lora,
            shared=shared,
            slot_rows=slot_rows,
        )

    def record_tokens(self, rows: list[int], tokens: torch.Tensor) -> None:
        """Remember each row's newest sampled token on the device."""
        self.last_tokens[to_device(torch.tensor(rows, dtype=torch.int64), self.device)] = tokens

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        return run_model(self.model, self.backend, self.graphs, fb, self.lora)


def run_model(model: LlamaModel, backend: AttentionBackend | None, graphs: DecodeGraphs | None, fb: ForwardBatch,
              lora: LoraSlots | None = None) -> torch.Tensor:
    """Logits [R, vocab] float32 of a step: a decode graph's replay when one covers it (a
    decode-shaped step), else an eager forward (the target's runner and the draft model's)."""
    if graphs is not None and graphs.can_run(fb):
        logits = graphs.replay(fb)  # every row's: a prefill chunk as rows samples its last row only
        return logits if fb.logits_indices.numel() == fb.batch_size else logits[fb.logits_indices]
    assert backend is not None, "no attention backend (the engine is asleep)"
    backend.plan(fb)
    if lora is not None:
        lora.plan(fb.lora, fb.lora_active)
    hidden = model(fb.input_ids, fb.positions, backend)
    return model.logits(hidden[fb.logits_indices])
