"""True on-policy scoring: the trainer recomputes a rollout's log-probs bit for bit equal to
what a deterministic engine (EngineConfig(deterministic=True)) returned, from its own weights.

Why this works: in deterministic mode every token's computation is a function of its own
sequence only (batch-invariant matmuls, per-token attention over its own KV in fixed tiles,
row-wise norms and log-softmax). A full-sequence forward over prompt + response therefore
reproduces, position by position, the numbers the engine computed one decode step at a time,
and the log-probs are taken with the sampler's own ops (log_softmax of the float32 logits,
and of logits / temperature for "processed"). The importance ratio of a PPO/GRPO step's first
epoch is then exactly 1 (slime/Miles call this "true on-policy").

The scorer holds the engine's model class (not the trainer's HF module) with the trainer's
weights copied in through the engine's loader: HF names in, fused qkv / gate_up out. It is a
no-grad recompute (old log-probs, or a check of the engine); the differentiable loss still
runs through the trainer's model (rollout/rl/scoring.py), which agrees to float rounding.
Covers temperature sampling (what GRPO uses); top-k / top-p / min-p filters are not replayed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from rollout.attention.deterministic_backend import DeterministicAttention
from rollout.batch import ForwardBatch
from rollout.cache.kv_pool import KVPool
from rollout.model.build import build_model
from rollout.model.config import ModelConfig
from rollout.model.loader import load_weights


@dataclass
class ScoredRollout:
    raw: list[float]  # log_softmax(logits)[token] at each response position
    processed: list[float]  # under the tempered distribution the engine sampled from


class OnPolicyScorer:
    def __init__(self, model_dir: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 max_tokens: int = 8192) -> None:
        self.config = ModelConfig.from_dir(str(model_dir))
        self.device = torch.device(device)
        self.model = build_model(self.config, self.config.max_position_embeddings, dtype, self.device)
        self.model.make_batch_invariant()
        cfg = self.config
        self.pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_tokens, 1, dtype, self.device)
        self.backend = DeterministicAttention(self.pool, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.max_tokens = max_tokens

    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The trainer's weights under HF names (weightsync.trainer.iter_hf_weights(model)), all of them."""
        load_weights(self.model, named_tensors, full=True)

    @torch.no_grad()
    def score(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
              temperature: float = 1.0) -> list[ScoredRollout]:
        """Log-probs of each response given its prompt, as the engine reported them for a
        rollout sampled at `temperature` (0: greedy, which reports raw for both)."""
        if len(prompts) != len(responses):
            raise ValueError(f"responses: {len(responses)} for {len(prompts)} prompts")
        if not temperature >= 0:
            raise ValueError(f"temperature={temperature}: must be >= 0")
        seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
        if any(not p or not r for p, r in zip(prompts, responses)):
            raise ValueError("every prompt and every response needs at least one token")
        total = sum(len(s) for s in seqs)
        if total > self.max_tokens:
            raise ValueError(f"{total} tokens to score: more than max_tokens={self.max_tokens}; score fewer at once")
        logits = self.model.logits(self._forward(seqs, [len(p) for p in prompts]))  # [R, V] float32
        raw = torch.log_softmax(logits, dim=-1)
        processed = raw if temperature == 0 else torch.log_softmax(logits / temperature, dim=-1)
        targets = torch.tensor([t for r in responses for t in r], device=self.device)[:, None]
        raw, processed = raw.gather(-1, targets)[:, 0].tolist(), processed.gather(-1, targets)[:, 0].tolist()
        out, at = [], 0
        for r in responses:
            out.append(ScoredRollout(raw[at : at + len(r)], processed[at : at + len(r)]))
            at += len(r)
        return out

    def _forward(self, seqs: list[list[int]], prompt_lens: list[int]) -> torch.Tensor:
        """One extend step over whole sequences -> hidden states of the rows that predict a
        response token ([R, hidden])."""
        lens = [len(s) for s in seqs]
        slots = torch.arange(1, sum(lens) + 1, dtype=torch.int64)  # slot 0: the padding slot
        indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        positions = torch.cat([torch.arange(n) for n in lens])
        predict = torch.cat([start + torch.arange(p - 1, n - 1) for start, p, n in zip(indptr[:-1].tolist(), prompt_lens, lens)])
        dev = self.device
        batch = ForwardBatch(
            input_ids=torch.tensor([t for s in seqs for t in s], device=dev), positions=positions.to(dev),
            out_cache_loc=slots.to(dev), qo_indptr=indptr.to(dev), kv_indptr=indptr.to(dev), kv_indices=slots.to(dev),
            logits_indices=predict.to(dev), extend_lens=lens, seq_lens=lens, num_decode=0,
        )
        self.backend.plan(batch)
        hidden = self.model(batch.input_ids, batch.positions, self.backend)
        return hidden[batch.logits_indices]
