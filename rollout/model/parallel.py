"""Tensor-parallel layout of the Llama-family model (Megatron's split):

- column-parallel (output rows split, no communication): the fused qkv projection by heads
  (rank r holds q heads r*H/T.., and kv heads r*Hkv/T..; GQA groups stay on one rank) and
  the fused gate_up projection by MLP columns;
- row-parallel (input columns split, outputs summed over the group): o_proj and down_proj;
- vocab-parallel: the embedding (each rank looks up its vocab rows, zeros elsewhere, sum)
  and the lm_head (each rank its vocab rows; the logits are gathered to the whole vocab,
  identical on every rank, so log-probs are over the whole vocabulary and sampling agrees);
- replicated: the norms (and q/k norms, per head_dim).

Which TP sizes a model allows (`check_tp_size`), and how a full HF tensor maps to this
rank's shard (`shard_dim`, `local_rows`, `full_shape`, `take_shard`). Knows shapes and
names; the collectives are rollout/distributed/tp.py's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rollout.distributed.tp import TensorParallel
from rollout.model.config import ModelConfig


def check_tp_size(cfg: ModelConfig, size: int) -> None:
    """Refuse a TP size this model cannot be split by, naming the shape that does not divide."""
    if size == 1:
        return
    splits = {
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,  # KV heads are split, not replicated
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,  # vocab-parallel embedding and lm_head, unpadded
    }
    bad = [f"{name}={value}" for name, value in splits.items() if value % size]
    if bad:
        allowed = [t for t in range(1, cfg.num_kv_heads + 1) if all(v % t == 0 for v in splits.values())]
        raise ValueError(f"EngineConfig.tensor_parallel_size={size}: the model's {', '.join(bad)} not divisible by "
                         f"{size}; this model allows tensor_parallel_size in {allowed}")


class VocabParallelEmbedding(nn.Module):
    """Rows [rank * V/T, (rank + 1) * V/T) of the embedding. Ids outside them give zeros,
    and the sum over the group puts each token's row (exactly: one rank adds it to zeros)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.num_rows = vocab_size // tp.size
        self.start = tp.rank * self.num_rows
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(self.num_rows, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, hidden]
        return self.tp.all_reduce(x.masked_fill(outside[:, None], 0.0))


def make_embedding(cfg: ModelConfig, tp: TensorParallel) -> nn.Module:
    if tp.size == 1:  # the plain lookup: no masking, no collective
        embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        embedding.weight.requires_grad_(False)
        return embedding
    return VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)


# engine parameter name suffix -> the dim split across ranks (others are replicated)
_COLUMN = ("qkv_proj.weight", "qkv_proj.bias", "gate_up_proj.weight", "embed_tokens.weight", "lm_head.weight")
_ROW = ("o_proj.weight", "down_proj.weight")


def shard_dim(param_name: str) -> int | None:
    """The dim of an engine parameter (and of the HF tensors that fill it) split by TP."""
    if param_name.endswith(_COLUMN):
        return 0
    if param_name.endswith(_ROW):
        return 1
    return None


def full_shape(local_shape: torch.Size, dim: int | None, tp: TensorParallel) -> tuple[int, ...]:
    shape = list(local_shape)
    if dim is not None:
        shape[dim] *= tp.size
    return tuple(shape)


def local_rows(rows: slice, tp: TensorParallel) -> slice:
    """Rows of a fused parameter (q/k/v in qkv, gate/up in gate_up) on this rank: every
    part is split by T, so the full layout's offsets divide by T."""
    return slice(rows.start // tp.size, rows.stop // tp.size)


def take_shard(tensor: torch.Tensor, dim: int, tp: TensorParallel) -> torch.Tensor:
    """This rank's contiguous 1/T of `tensor` along `dim` (a view: no copy)."""
    n = tensor.shape[dim] // tp.size
    return tensor.narrow(dim, tp.rank * n, n)
