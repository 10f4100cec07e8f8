"""The draft model's own machinery: its weights, a KV pool of its own (one slot per token,
no prefix sharing), an attention backend over that pool and decode CUDA graphs, the same
pieces the target uses, built by the target's construction code (rollout/core/build.py:
load_model, make_kv_pool, attach_backend) for a second model.

It knows flat batches of tokens and slots; which tokens a request still owes the draft,
and what the drafts are, is draft_model.py's business.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rollout.attention.base import AttentionBackend
from rollout.batch import ForwardBatch
from rollout.cache.kv_pool import KVPool, OutOfSlots
from rollout.device import to_device
from rollout.model.config import ModelConfig
from rollout.model.cuda_graph import DecodeGraphs
from rollout.model.llama import LlamaModel
from rollout.model.loader import WeightWrite, plan_writes
from rollout.model.runner import run_model


@dataclass
class DraftRow:
    """One request's new tokens in a draft forward."""

    tokens: list[int]  # inputs (their positions follow the request's cached ones)
    start: int  # position of tokens[0]
    slots: list[int]  # the request's KV slots for positions [0, start + len(tokens))
    wants_logits: bool  # does this row propose a token (its last input's next token)


class DraftRunner:
    def __init__(self, model: LlamaModel, model_config: ModelConfig, path: str, device: torch.device,
                 rows_max: int | None = None) -> None:
        self.path = path
        self.model_config = model_config
        self.context_len = model_config.max_position_embeddings
        self.device = device
        self.model = model
        self.pool: KVPool | None = None  # build.make_kv_pool, once the target's KV is sized
        self.backend: AttentionBackend | None = None
        self.graphs: DecodeGraphs | None = None
        # token rows up to which a forward runs as decode rows; None: the largest decode graph
        # (0 without graphs: on CPU the extend layout is as fast); tests force it on CPU
        # (KernelOptions.draft_rows_max)
        self.rows_max = rows_max

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def kv_tensors(self) -> list[torch.Tensor]:
        assert self.pool is not None
        return [*self.pool.k_buffers, *self.pool.v_buffers]

    def capture_decode_graphs(self, max_bs: int, max_context: int) -> None:
        """Decode graphs of up to max_bs rows (build.attach_backend, at start-up and on wake)."""
        assert self.backend is not None
        self.graphs = DecodeGraphs(self.model, self.backend, max_bs, max_context, self.device)
        self.graphs.capture()

    def detach(self) -> None:
        self.graphs, self.backend = None, None

    # ---- slots ------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        assert self.pool is not None
        return self.pool.allocator.capacity_slots

    def alloc(self, n: int) -> list[int] | None:
        """n slots, or None when the pool is short (that request drafts nothing this step)."""
        assert self.pool is not None
        try:
            return self.pool.allocator.alloc_pages(n)  # page size 1: a page is a slot
        except OutOfSlots:
            return None

    def free(self, slots: list[int]) -> None:
        if slots and self.pool is not None:
            self.pool.allocator.free_pages(slots)

    # ---- weights ----------------------------------------------------------------------
    def plan_update(self, named_tensors: list[tuple[str, torch.Tensor]], full: bool) -> list[WeightWrite]:
        try:
            return plan_writes(self.model, named_tensors, full=full)
        except ValueError as e:
            raise ValueError(f"draft model: {e}") from e

    # ---- forward ----------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, rows: list[DraftRow], fed: torch.Tensor | None = None) -> torch.Tensor:
        """Run one forward over the rows (decodes, one token each, first) and return the
        greedy next token of each row that wants logits, in row order, on the device: the
        draft loop feeds them back without a host round trip and reads all k at the end.
        `fed`: the rows' input tokens as a device tensor (one-token rows: the previous
        position's drafts), instead of their host `tokens`.

        When every row proposes and their tokens fit the largest decode graph, each token
        becomes a decode row of its own (over its request's KV up to itself, as the target
        verifies: rollout/model/runner.py `_prepare_rows`), so the catch-up after a verify
        (1 to k + 1 tokens per request) replays a graph too instead of an eager extend."""
        limit = self.rows_max if self.rows_max is not None else (self.graphs.max_bs if self.graphs is not None else 0)
        if all(r.wants_logits for r in rows) and sum(len(r.tokens) for r in rows) <= limit:
            flat = [DraftRow([t], row.start + j, row.slots, j == len(row.tokens) - 1)
                    for row in rows for j, t in enumerate(row.tokens)]
            return self._forward(flat, fed, all_rows_logits=True)
        return self._forward(rows, fed, all_rows_logits=False)

    def _forward(self, rows: list[DraftRow], fed: torch.Tensor | None, all_rows_logits: bool) -> torch.Tensor:
        input_ids: list[int] = []
        positions, out_locs, kv_parts, seq_lens, extend_lens, logits_at = [], [], [], [], [], []
        num_decode = 0
        t = 0
        for row in rows:
            n = len(row.tokens)
            if n == 1 and (row.wants_logits or all_rows_logits) and num_decode == len(seq_lens):
                num_decode += 1  # the leading one-token rows are decodes
            end = row.start + n
            input_ids.extend(row.tokens)
            positions.append(np.arange(row.start, end, dtype=np.int64))
            out_locs.extend(row.slots[row.start:end])
            kv_parts.append(np.asarray(row.slots[:end], dtype=np.int64))
            seq_lens.append(end)
            extend_lens.append(n)
            t += n
            if row.wants_logits or all_rows_logits:
                logits_at.append(t - 1)
        qo = np.zeros(len(rows) + 1, dtype=np.int32)
        qo[1:] = np.cumsum(extend_lens)
        kvp = np.zeros(len(rows) + 1, dtype=np.int32)
        kvp[1:] = np.cumsum(seq_lens)
        dev = self.device

        def d(a) -> torch.Tensor:
            return to_device(torch.as_tensor(a), dev)

        fb = ForwardBatch(
            input_ids=fed if fed is not None else d(torch.tensor(input_ids, dtype=torch.int64)), positions=d(np.concatenate(positions)),
            out_cache_loc=d(torch.tensor(out_locs, dtype=torch.int64)), qo_indptr=d(qo), kv_indptr=d(kvp),
            kv_indices=d(np.concatenate(kv_parts)), logits_indices=d(torch.tensor(logits_at, dtype=torch.int64)),
            extend_lens=extend_lens, seq_lens=seq_lens, num_decode=num_decode,
        )
        tokens = run_model(self.model, self.backend, self.graphs, fb).argmax(-1)
        if all_rows_logits and len(logits_at) != sum(r.wants_logits for r in rows):
            # one row per token: keep each proposing row's
            tokens = tokens[d(torch.tensor([i for i, r in enumerate(rows) if r.wants_logits], dtype=torch.int64))]
        return tokens

