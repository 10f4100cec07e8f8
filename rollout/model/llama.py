"""Llama-family decoder (Llama 2/3, Qwen2/2.5, Qwen3, SmolLM2) in plain torch.

q/k/v are one fused projection and gate/up another (one matmul each instead of three
and two). Attention is delegated to the step's attention backend, which stores the new
K/V into the paged pool and attends over each request's slots. The model sees a flat
batch of tokens (`[num_tokens, ...]`); it knows nothing about requests.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from rollout import kernels
from rollout.distributed.tp import SINGLE, TensorParallel
from rollout.model.config import ModelConfig
from rollout.model.parallel import make_embedding

if TYPE_CHECKING:
    from rollout.attention.base import AttentionBackend


class LoraProjection(Protocol):
    """Adds adapter deltas to a projection (lora/hook.py): `begin(x)` before the base matmul
    (its shrink may run beside it), `finish(pending, y)` after, updating y in place."""

    def begin(self, x: torch.Tensor) -> torch.Tensor | None: ...

    def finish(self, pending: torch.Tensor | None, out: torch.Tensor) -> None: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.rows_per_program: int | None = None  # fused kernel: None picks by the row count

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.use_fused(x):  # GPU: one Triton kernel, same op order as below
            return kernels.fused.rms_norm(x, self.weight, self.eps, rows_per_program=self.rows_per_program)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op
        # Same op order as transformers: normalize in fp32, cast back, then scale.
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the residual add fused into the norm on GPU."""
        if kernels.use_fused(x):
            return kernels.fused.rms_norm(x, self.weight, self.eps, residual=residual,
                                          rows_per_program=self.rows_per_program)
        r = residual + x
        return self(r), r


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


class Rotary(nn.Module):
    """cos/sin tables for every position, computed once (rotate-half layout, as HF)."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(cfg)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_positions, head_dim / 2]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, H, D], k: [T, Hkv, D] (may be strided views of the qkv projection output)
        if kernels.use_fused(q):  # GPU: one launch for q and k, cos/sin gathered in-kernel
            return kernels.fused.rotary_embedding(q, k, self.cos, self.sin, positions)
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # HF's x * cos + rotate_half(x) * sin on half-width tables: the same float ops, half the work.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        # Multi-LoRA: set by the adapter pool (lora/hook.py LoraHook); adds each request's
        # adapter delta to this projection's output in place. None: no adapters here.
        self.lora: LoraProjection | None = None
        # Deterministic mode swaps in a batch-invariant matmul (LlamaModel.make_batch_invariant).
        self.matmul: Callable[..., torch.Tensor] = F.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lora = self.lora
        if lora is None:
            return self.matmul(x, self.weight, self.bias)
        pending = lora.begin(x)  # launched before the matmul, so it can overlap it
        y = self.matmul(x, self.weight, self.bias)
        lora.finish(pending, y)
        return y


class Attention(nn.Module):
    """This rank's heads (all of them without TP): qkv column-parallel, o_proj row-parallel."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TensorParallel) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads // tp.size, cfg.num_kv_heads // tp.size, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary, backend: AttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        o = backend.forward(q, k, v, self.layer_id)  # [T, H, D]
        return self.tp.all_reduce(self.o_proj(o.reshape(t, self.q_size)))  # partial sums over heads


class MLP(nn.Module):
    """This rank's MLP columns: gate_up column-parallel, down_proj row-parallel."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.intermediate_size = cfg.intermediate_size // tp.size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = Linear(self.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2I/tp]
        if kernels.use_fused(gate_up):  # GPU: one kernel instead of silu, then mul
            return self.tp.all_reduce(self.down_proj(kernels.fused.silu_and_mul(gate_up)))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.tp.all_reduce(self.down_proj(F.silu(gate) * up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TensorParallel) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, rotary: Rotary,
                backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp output, residual stream before it): the next layer (or the final norm) adds
        the two inside its own norm, one kernel instead of an add and a norm."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_norm(x, residual=residual)  # residual <- residual + x
        a = self.self_attn(h, positions, rotary, backend)
        h, residual = self.post_attention_layernorm.add_norm(a, residual=residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    """`config` is the whole model's shape; with `tp` (rollout/model/parallel.py) this
    process holds one rank's shard of it."""

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.embed_tokens = make_embedding(cfg, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        vocab = cfg.vocab_size // tp.size
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, vocab, bias=False)
        self.rotary = Rotary(cfg, max_positions)
        self.matmul: Callable[..., torch.Tensor] = F.linear  # the lm_head's

    def make_batch_invariant(self) -> None:
        """Deterministic mode: every projection and the lm_head through the batch-invariant
        matmul, and the fused RMSNorm kernel at one row per program (its reduction layout
        otherwise follows the number of rows). The rest is elementwise or a gather."""
        from rollout.kernels import batch_invariant

        self.matmul = batch_invariant.linear
        for module in self.modules():
            if isinstance(module, Linear):
                module.matmul = batch_invariant.linear
            elif isinstance(module, RMSNorm):
                module.rows_per_program = 1

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden] (normed)."""
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, self.rotary, backend)
        return self.norm.add_norm(x, residual=residual)[0]

    def projections(self) -> Iterator[tuple[int, str, Linear]]:
        """(layer, name, module) of every projection an adapter can target."""
        for i, layer in enumerate(self.layers):
            yield i, "qkv_proj", layer.self_attn.qkv_proj
            yield i, "o_proj", layer.self_attn.o_proj
            yield i, "gate_up_proj", layer.mlp.gate_up_proj
            yield i, "down_proj", layer.mlp.down_proj

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        # [R, vocab / tp] per rank -> [R, vocab], gathered in the model's dtype (half the bytes of fp32)
        return self.tp.gather_last(self.matmul(hidden, weight)).float()
