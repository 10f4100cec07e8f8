"""The draft model's own machinery: its weights, a KV pool of its own (one slot per token,
no prefix sharing), an attention backend over that pool and decode CUDA graphs, the same
pieces the target uses (rollout/model, rollout/attention), built again for a second model.

It knows flat batches of tokens and slots; which tokens a request still owes the draft,
and what the drafts are, is draft_model.py's business.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from rollout.attention import make_backend
from rollout.cache.kv_pool import KVPool, OutOfSlots
from rollout.config import EngineConfig
from rollout.device import to_device
from rollout.model.build import build_model, init_random_weights
from rollout.model.config import ModelConfig
from rollout.model.cuda_graph import DecodeGraphs
from rollout.model.forward_batch import ForwardBatch
from rollout.model.loader import WeightWrite, iter_checkpoint, load_weights, plan_writes
from rollout.model.runner import run_model

log = logging.getLogger("rollout")


@dataclass
class DraftRow:
    """One request's new tokens in a draft forward."""

    tokens: list[int]  # inputs (their positions follow the request's cached ones)
    start: int  # position of tokens[0]
    slots: list[int]  # the request's KV slots for positions [0, start + len(tokens))
    wants_logits: bool  # does this row propose a token (its last input's next token)


class DraftRunner:
    def __init__(self, config: EngineConfig, target: ModelConfig, device: torch.device) -> None:
        assert config.draft_model is not None
        self.config = config
        self.path = config.draft_model
        self.model_config = cfg = ModelConfig.from_dir(self.path)
        if cfg.vocab_size != target.vocab_size:
            raise ValueError(f"EngineConfig.draft_model={self.path!r}: vocabulary of {cfg.vocab_size} tokens, the "
                             f"target's has {target.vocab_size}: a draft model must share the target's tokenizer")
        check_same_tokenizer(self.path, config.model)
        self.context_len = cfg.max_position_embeddings
        self.device = device
        self.model = build_model(cfg, self.context_len, config.torch_dtype, device, options=config.kernel_options)
        if config.load_format == "dummy":
            init_random_weights(self.model, config.seed + 1)
        else:
            load_weights(self.model, iter_checkpoint(self.path), full=True)
        self.pool: KVPool | None = None
        self.backend = None
        self.graphs: DecodeGraphs | None = None
        # token rows up to which a forward runs as decode rows; None: the largest decode graph
        # (0 without graphs: on CPU the extend layout is as fast); tests force it on CPU
        # (KernelOptions.draft_rows_max)
        self.rows_max: int | None = config.kernel_options.draft_rows_max

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def kv_bytes_per_token(self) -> int:
        c = self.model_config
        return KVPool.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, self.config.torch_dtype)

    def make_pool(self, max_tokens: int) -> None:
        c = self.model_config
        self.pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, max_tokens, 1, self.config.torch_dtype, self.device,
                           self.config.kernel_options)
        log.info("draft model %s: %.2f GiB of weights, KV for %d tokens (%.2f GiB)", self.path,
                 self.weight_bytes() / 2**30, max_tokens, max_tokens * self.kv_bytes_per_token() / 2**30)

    def kv_tensors(self) -> list[torch.Tensor]:
        assert self.pool is not None
        return [*self.pool.k_buffers, *self.pool.v_buffers]

    def attach(self) -> None:
        """Attention backend and decode graphs over the pool (at start-up and on wake)."""
        assert self.pool is not None
        c, config = self.model_config, self.config
        self.graphs = None
        self.backend = make_backend(config.attention, self.pool, c.num_heads, c.num_kv_heads, c.head_dim, config.device,
                                    config.kernel_options)
        if self.device.type == "cuda" and config.cuda_graph and self.backend.graphable:
            start = time.perf_counter()
            # rows = requests x (1 + k): the catch-up after a verify runs as decode rows
            max_bs = min(config.max_running_requests, config.cuda_graph_max_bs) * (1 + config.num_speculative_tokens)
            self.graphs = DecodeGraphs(self.model, self.backend, max_bs, min(self.context_len, self.capacity),
                                       self.device)
            self.graphs.capture()
            log.info("draft model: decode CUDA graphs up to batch %d in %.1f s", max_bs, time.perf_counter() - start)

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


def check_same_tokenizer(draft_dir: str, target_dir: str) -> None:
    """When both checkpoints carry a tokenizer, their vocabularies must map the same strings
    to the same ids (equal sizes alone do not make a shared tokenizer)."""
    from rollout.core.build import load_tokenizer

    a, b = load_tokenizer(draft_dir), load_tokenizer(target_dir)
    if a is None or b is None:
        return
    va, vb = a.get_vocab(), b.get_vocab()
    if va != vb:
        diff = next((t for t in va if vb.get(t) != va[t]), None)
        raise ValueError(f"EngineConfig.draft_model={draft_dir!r}: its tokenizer differs from the target's "
                         f"(token {diff!r} is {va.get(diff)} there and {vb.get(diff)} in the target)")
