"""Llama-family decoder (Llama 2/3, Qwen2/2.5, Qwen3, SmolLM2) in plain torch.

q/k/v are one fused projection and gate/up another (one matmul each instead of three
and two). Attention is delegated to the step's attention backend, which stores the new
K/V into the paged pool and attends over each request's slots. The model sees a flat
batch of tokens (`[num_tokens, ...]`); it knows nothing about requests. Which kernels its
layers launch is the KernelOptions they were built with (rollout/kernels/options.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from rollout import kernels
from rollout.distributed.tp import SINGLE, TensorParallel
from rollout.kernels.low_rank import OneRow
from rollout.kernels.options import DEFAULT_OPTIONS, KernelOptions
from rollout.model.config import ModelConfig
from rollout.model.parallel import make_embedding

if TYPE_CHECKING:
    from rollout.attention.base import AttentionBackend
    from rollout.batch import LoraInputs
    from rollout.kernels import KVTarget


class LoraProjection(Protocol):
    """Adds adapter deltas to a projection (lora/hook.py): `begin(x, defer)` before the base
    matmul (its shrink may run beside it), `finish(pending, y)` after, updating y in place or,
    when `defer` was granted, returning an fp32 delta the caller adds (else None). For one
    row on the skinny GEMV, `one_row(x)` instead: the term its epilogue adds, or None when
    the halves must run apart."""

    def begin(self, x: torch.Tensor, defer: bool = False) -> Any: ...

    def one_row(self, x: torch.Tensor) -> OneRow | None: ...

    def finish(self, pending: Any, out: torch.Tensor) -> torch.Tensor | None: ...

    @property
    def concurrent(self) -> bool:
        """Does the work begin() launched run beside the base matmul (a graph's side stream)?"""
        ...


class LoraSlots(Protocol):
    """The adapter slots as a model step sees them (lora/pool.py LoraPool, which also puts a
    LoraProjection on each targeted projection): how many slots a step's segments may name,
    and each forward's plan (`inputs`: its segments; inactive: no adapter runs;
    `concurrent`: a CUDA graph capture's shrinks on a side stream)."""

    num_slots: int

    def plan(self, inputs: LoraInputs | None, active: bool, concurrent: bool = False) -> None: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, options: KernelOptions = DEFAULT_OPTIONS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.options = options
        self.rows_per_program: int | None = None  # fused kernel: None picks by the row count

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        options = self.options
        if kernels.use_fused(x, options.fused):  # GPU: one Triton kernel, same op order as below
            return kernels.fused.rms_norm(x, self.weight, self.eps, rows_per_program=self.rows_per_program,
                                          pdl=options.pdl)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op
        # Same op order as transformers: normalize in fp32, cast back, then scale.
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor,
                 delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the residual add fused into the norm on GPU.
        `delta`: the projection's deferred adapter delta, added to x first (Linear.forward_deferred)."""
        options = self.options
        if kernels.use_fused(x, options.fused):
            return kernels.fused.rms_norm(x, self.weight, self.eps, residual=residual,
                                          rows_per_program=self.rows_per_program, delta=delta, pdl=options.pdl)
        r = residual + with_delta(x, delta)
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
    if kind == "yarn":
        return _yarn(cfg, scaling)[0]
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
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3, yarn)")


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What the cos/sin tables are multiplied by: YaRN's attention scale, 1 otherwise."""
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) == "yarn":
        return _yarn(cfg, scaling)[1]
    return 1.0


def _yarn(cfg: ModelConfig, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071), as transformers computes it (Qwen3's long context): the
    frequencies that turn fewer than beta_slow times over the original context are
    interpolated by `factor`, those that turn more than beta_fast times kept, a linear ramp
    between; and cos/sin scaled by 0.1 ln(factor) + 1 (or the checkpoint's attention_factor,
    or its mscale / mscale_all_dim ratio)."""
    if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"rope_scaling yarn with partial_rotary_factor={scaling['partial_rotary_factor']}: "
                         "only whole-head rotary is supported")
    dim, base = cfg.head_dim, cfg.rope_theta
    old_len = float(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else cfg.max_position_embeddings / old_len

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over old_len
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    keep = 1 - ramp  # 1: extrapolate (the frequency as trained), 0: interpolate (divided by factor)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(attention)


class Rotary(nn.Module):
    """cos/sin tables for every position, computed once (rotate-half layout, as HF)."""

    def __init__(self, cfg: ModelConfig, max_positions: int, options: KernelOptions = DEFAULT_OPTIONS) -> None:
        super().__init__()
        self.fused = options.fused
        self.pdl = options.pdl and options.pdl_rotary_attention
        inv_freq = rope_inv_freq(cfg)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_positions, head_dim / 2]
        scale = rope_attention_factor(cfg)  # in the tables, so every rotary path (torch, kernels, epilogues) has it
        self.register_buffer("cos", freqs.cos() * scale, persistent=False)
        self.register_buffer("sin", freqs.sin() * scale, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None,
                delta: torch.Tensor | None = None, kv: KVTarget | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated (q, k). q: [T, H, D], k and v: [T, Hkv, D] (may be strided views of the qkv
        projection output). `delta`: that projection's deferred adapter delta [T, (H + 2 Hkv) D],
        added to q and k before they rotate and to v in place. `kv`: also store the rotated k
        and v in the KV pool there (on GPU in the same launch: one kernel less a layer)."""
        if kv is not None and v is None:
            raise ValueError("storing K/V needs v")
        if kernels.use_fused(q, self.fused):  # GPU: one launch for q and k (and v's delta, the KV store), cos/sin gathered in-kernel
            store = {} if kv is None else dict(k_cache=kv.k_cache, v_cache=kv.v_cache, slots=kv.slots)
            return kernels.rotary.rotary_embedding(q, k, self.cos, self.sin, positions, v=v, delta=delta, pdl=self.pdl,
                                                   **store)
        if delta is not None:
            assert v is not None, "a qkv delta needs v"
            dq, dk, dv = delta.split([q[0].numel(), k[0].numel(), v[0].numel()], dim=-1)
            q, k = with_delta(q, dq.view(q.shape)), with_delta(k, dk.view(k.shape))
            v.copy_(with_delta(v, dv.view(v.shape)))
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if kv is not None:
            kv.write(k, v)
        return q, k


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # HF's x * cos + rotate_half(x) * sin on half-width tables: the same float ops, half the work.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, options: KernelOptions = DEFAULT_OPTIONS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        # Multi-LoRA: set by the adapter pool (lora/hook.py LoraHook); adds each request's
        # adapter delta to this projection's output in place. None: no adapters here.
        self.lora: LoraProjection | None = None
        # F.linear, or for a batch-1 decode's one row on GPU the skinny kernel (kernels.linear).
        # Deterministic mode swaps in a batch-invariant matmul (LlamaModel.make_batch_invariant).
        # Called as matmul(x, weight, bias, options).
        self.matmul: Callable[..., torch.Tensor] = kernels.linear
        self.options = options

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_deferred(x, defer=False)[0]  # the adapter's delta added to y in place

    def one_row(self, x: torch.Tensor) -> OneRow | None:
        """OneRow when x's matmul runs as the skinny GEMV with everything this projection adds
        (an adapter's term, launching its shrink now) in its launch, so the kernel after it may
        fold in too (kernels.linear_silu_mul / linear_rope_kv take the term); the caller then
        runs it, once. None: the matmul and the adapter's kernels run apart (forward_deferred)."""
        if self.matmul is not kernels.linear or not kernels.one_row(x, self.weight, self.options):
            return None
        return OneRow() if self.lora is None else self.lora.one_row(x)

    def forward_deferred(self, x: torch.Tensor, defer: bool = True,
                         row: OneRow | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(y, delta): like forward, but an adapter delta may be left out of y, as fp32
        [T, out] for the caller's next kernel to add (`with_delta`; lora/hook.py says when).
        `defer=False` (e.g. the delta must precede a TP all-reduce) always adds it here.
        `row`: what one_row(x) gave the caller, if it asked (its term is added here)."""
        lora = self.lora
        if lora is None and row is None:
            return self.matmul(x, self.weight, self.bias, self.options), None
        if row is None:
            row = self.one_row(x)
        if row is not None:  # one launch with the adapter's term (lora/hook.py one_row)
            return kernels.linear(x, self.weight, self.bias, self.options, low_rank=row.term), None
        assert lora is not None
        pending = lora.begin(x, defer)  # launched before the matmul, so it can overlap it
        if pending is not None and self.matmul is kernels.linear and lora.concurrent:
            # cuBLAS, not the skinny GEMV: launched early under PDL its thousands of programs took
            # every SM, so the adapter's kernels on the side stream waited for it (BENCHMARKS.md,
            # multi-LoRA, "H200, 2026-12-02: (a) without compiles ..."). One row normally takes
            # one_row above; this is its A/B (KernelOptions.lora_one_row_epilogue = False).
            y = F.linear(x, self.weight, self.bias)
        else:
            y = self.matmul(x, self.weight, self.bias, self.options)
        return y, lora.finish(pending, y)


def with_delta(y: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
    """y with a deferred adapter delta added, rounded once to y's dtype: what the in-place
    expand would have left in y (the torch path; the fused kernels do this on load)."""
    return y if delta is None else (y.float() + delta).to(y.dtype)


class Attention(nn.Module):
    """This rank's heads (all of them without TP): qkv column-parallel, o_proj row-parallel."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TensorParallel,
                 options: KernelOptions = DEFAULT_OPTIONS) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.tp = tp
        self.options = options
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads // tp.size, cfg.num_kv_heads // tp.size, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias, options=options)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False, options=options)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, options)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, options)
        else:
            self.q_norm = self.k_norm = None

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.reshape(t, self.num_heads, self.head_dim), k.reshape(t, self.num_kv_heads, self.head_dim),
                v.reshape(t, self.num_kv_heads, self.head_dim))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary,
                backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(output, o_proj's deferred adapter delta or None): the caller's norm adds the delta."""
        t = x.shape[0]
        kv = backend.kv_target(self.layer_id)  # the rotary stores K/V, in its own launch on GPU
        proj = self.qkv_proj
        # batch 1 on GPU: the rotary and the K/V store as the qkv GEMV's epilogue (q/k norms
        # come between the two)
        row = proj.one_row(x) if self.q_norm is None and kernels.rope_folds(kv, self.options) else None
        qkv = kernels.linear_rope_kv(x, proj.weight, proj.bias, rotary.cos, rotary.sin, positions, kv, self.num_heads,
                                     self.num_kv_heads, self.options, low_rank=row.term) if row is not None else None
        if qkv is not None:
            q, k, v = self._heads(qkv)
        else:
            # q/k norms come before the rotary: a delta there is added by the projection itself
            qkv, delta = proj.forward_deferred(x, defer=self.q_norm is None)
            q, k, v = self._heads(qkv)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = rotary(positions, q, k, v=v, delta=delta, kv=kv)
        o = backend.forward(q, k, v, self.layer_id, stored=kv is not None)  # [T, H, D]
        # row-parallel: each rank's delta is a partial sum the all-reduce must carry
        out, delta = self.o_proj.forward_deferred(o.reshape(t, self.q_size), defer=self.tp.size == 1)
        return self.tp.all_reduce(out), delta  # partial sums over heads


class MLP(nn.Module):
    """This rank's MLP columns: gate_up column-parallel, down_proj row-parallel."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, options: KernelOptions = DEFAULT_OPTIONS) -> None:
        super().__init__()
        self.tp = tp
        self.options = options
        self.intermediate_size = cfg.intermediate_size // tp.size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.intermediate_size, bias=False, options=options)
        self.down_proj = Linear(self.intermediate_size, cfg.hidden_size, bias=False, options=options)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(output, down_proj's deferred adapter delta or None): the next norm adds the delta."""
        up_proj, options = self.gate_up_proj, self.options
        # batch 1 on GPU: SiLU-mul as the gate_up GEMV's epilogue (this rank's gate rows, then up's)
        row = up_proj.one_row(x) if kernels.silu_folds(up_proj.weight, options) else None
        act = kernels.linear_silu_mul(x, up_proj.weight, up_proj.bias, options,
                                      low_rank=row.term) if row is not None else None
        if act is None:
            gate_up, delta = up_proj.forward_deferred(x)  # [T, 2I/tp]
            if kernels.use_fused(gate_up, options.fused):  # GPU: one kernel instead of silu, then mul
                act = kernels.fused.silu_and_mul(gate_up, delta=delta, pdl=options.pdl)
            else:
                gate, up = with_delta(gate_up, delta).split(self.intermediate_size, dim=-1)
                act = F.silu(gate) * up
        out, delta = self.down_proj.forward_deferred(act, defer=self.tp.size == 1)  # row-parallel, as o_proj
        return self.tp.all_reduce(out), delta


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TensorParallel,
                 options: KernelOptions = DEFAULT_OPTIONS) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, options)
        self.self_attn = Attention(cfg, layer_id, tp, options)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, options)
        self.mlp = MLP(cfg, tp, options)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, delta: torch.Tensor | None,
                positions: torch.Tensor, rotary: Rotary,
                backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(mlp output, residual stream before it, the mlp's deferred adapter delta or None):
        the next layer (or the final norm) adds the three inside its own norm, one kernel
        instead of an add, an adapter expand and a norm. `delta` is the previous layer's."""
        if residual is None:
            assert delta is None, "the embedding has no adapter delta"
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_norm(x, residual=residual, delta=delta)  # residual <- residual + x
        a, delta = self.self_attn(h, positions, rotary, backend)
        h, residual = self.post_attention_layernorm.add_norm(a, residual=residual, delta=delta)
        x, delta = self.mlp(h)
        return x, residual, delta


class LlamaModel(nn.Module):
    """`config` is the whole model's shape; with `tp` (rollout/model/parallel.py) this
    process holds one rank's shard of it; `options`: the kernels its layers launch."""

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TensorParallel = SINGLE,
                 options: KernelOptions = DEFAULT_OPTIONS) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.options = options
        self.embed_tokens = make_embedding(cfg, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp, options) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, options)
        vocab = cfg.vocab_size // tp.size
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, vocab, bias=False, options=options)
        self.rotary = Rotary(cfg, max_positions, options)
        self.matmul: Callable[..., torch.Tensor] = kernels.linear  # the lm_head's

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
        x, residual, delta = self.embed_tokens(input_ids), None, None
        for layer in self.layers:
            x, residual, delta = layer(x, residual, delta, positions, self.rotary, backend)
        return self.norm.add_norm(x, residual=residual, delta=delta)[0]

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
        return self.tp.gather_last(self.matmul(hidden, weight, None, self.options)).float()
