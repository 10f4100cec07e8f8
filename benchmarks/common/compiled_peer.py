"""Issue #16's plain peer: a Llama decode step in plain torch (a static KV cache per layer,
SDPA), which the benchmark runs through `torch.compile` (default mode) and captures in one
CUDA graph. It is the bar the issue sets ("an engine must clearly beat a compiled script"),
so `benchmarks.rollout --peer` times it in the same run as the engine, on the same shapes.

No paging, no prefix cache, no batching of unequal lengths: every row sits at the same
position, and each step reads the whole static cache under a mask (one graph for every
step). That is what makes it a floor-level script rather than an engine; its greedy logits
match transformers' (tests/bench/test_compiled_peer.py), so the two run the same model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rollout.model.config import ModelConfig
from rollout.model.llama import rope_attention_factor, rope_inv_freq


@dataclass
class PeerLayer:
    ln1: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(Hq + 2 Hkv) D, H]: q, k, v stacked
    o: torch.Tensor  # [H, Hq D]
    ln2: torch.Tensor
    gate_up: torch.Tensor  # [2 I, H]: gate, then up
    down: torch.Tensor  # [H, I]


@dataclass
class PeerWeights:
    embed: torch.Tensor  # [V, H]
    layers: list[PeerLayer]
    norm: torch.Tensor
    lm_head: torch.Tensor  # [V, H]


def random_weights(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0) -> PeerWeights:
    """Random weights of the shape, scaled so activations stay finite over many layers."""
    g = torch.Generator(device=device).manual_seed(seed)
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim

    def mat(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, device=device, dtype=dtype, generator=g) * cols ** -0.5)

    ones = torch.ones(h, device=device, dtype=dtype)
    layers = [PeerLayer(ones, mat((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h), mat(h, cfg.num_heads * d), ones,
                        mat(2 * i, h), mat(h, i)) for _ in range(cfg.num_layers)]
    return PeerWeights(mat(cfg.vocab_size, h), layers, ones, mat(cfg.vocab_size, h))


def weights_from_hf(model) -> PeerWeights:
    """The weights of a transformers LlamaForCausalLM (shared, not copied, where they can be)."""
    layers = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        layers.append(PeerLayer(layer.input_layernorm.weight.data,
                                torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).data, a.o_proj.weight.data,
                                layer.post_attention_layernorm.weight.data,
                                torch.cat([m.gate_proj.weight, m.up_proj.weight]).data, m.down_proj.weight.data))
    return PeerWeights(model.model.embed_tokens.weight.data, layers, model.model.norm.weight.data,
                       model.lm_head.weight.data)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class PeerDecoder:
    """`batch` rows decoding in lockstep into a static cache of `max_len` positions."""

    def __init__(self, cfg: ModelConfig, weights: PeerWeights, batch: int, max_len: int) -> None:
        self.cfg, self.w = cfg, weights
        dev, dtype = weights.embed.device, weights.embed.dtype
        # one tensor a layer, written in place at the step's position (as gpt-fast does): a
        # slice of one [L, ...] tensor made Inductor copy the whole cache every step
        shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k_cache = [torch.zeros(shape, device=dev, dtype=dtype) for _ in range(cfg.num_layers)]
        self.v_cache = [torch.zeros(shape, device=dev, dtype=dtype) for _ in range(cfg.num_layers)]
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), rope_inv_freq(cfg)).to(dev)
        scale = rope_attention_factor(cfg)  # YaRN's; 1 for the other scalings
        self.cos, self.sin = (freqs.cos() * scale).to(dtype), (freqs.sin() * scale).to(dtype)
        self.positions = torch.arange(max_len, device=dev)

    def step(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """tokens [B] at position pos ([1], on the device) -> float32 logits [B, V]."""
        c, w = self.cfg, self.w
        b, hq, hkv, d = tokens.shape[0], c.num_heads, c.num_kv_heads, c.head_dim
        cos, sin = self.cos[pos], self.sin[pos]  # [1, D/2]
        mask = (self.positions <= pos)[None]  # [1, S]: the static cache's filled part
        x = w.embed[tokens]
        for i, layer in enumerate(w.layers):
            q, k, v = (_rms(x, layer.ln1, c.rms_norm_eps) @ layer.qkv.T).split([hq * d, hkv * d, hkv * d], dim=-1)
            # a KV head's query heads as its query rows: one mask for all, no K/V repeated
            q = _rope(q.view(b, hkv, hq // hkv, d), cos, sin)
            self.k_cache[i][:, :, pos] = _rope(k.view(b, hkv, 1, d), cos, sin)
            self.v_cache[i][:, :, pos] = v.view(b, hkv, 1, d)
            o = F.scaled_dot_product_attention(q, self.k_cache[i], self.v_cache[i], attn_mask=mask)
            x = x + o.reshape(b, hq * d) @ layer.o.T
            gate, up = (_rms(x, layer.ln2, c.rms_norm_eps) @ layer.gate_up.T).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer.down.T
        return (_rms(x, w.norm, c.rms_norm_eps) @ w.lm_head.T).float()


@dataclass(frozen=True)
class PeerTiming:
    batch: int
    start: int  # the context each row has before the first timed step
    steps: int
    seconds: float
    compile_seconds: float

    @property
    def step_ms(self) -> float:
        return 1e3 * self.seconds / self.steps

    @property
    def tok_s(self) -> float:
        return self.batch * self.steps / self.seconds


def time_decode(cfg_dict: dict, batch: int, start: int, steps: int, device: torch.device,
                dtype: torch.dtype = torch.bfloat16, compile: bool = True) -> PeerTiming:
    """Greedy decode of `steps` tokens per row from a random context of `start` tokens:
    compiled, captured in one CUDA graph (on a GPU), replayed once per step, each replay
    feeding its argmax back as the next token. CPU: eager, for smoke runs."""
    cfg = ModelConfig.from_dict(cfg_dict)
    peer = PeerDecoder(cfg, random_weights(cfg, device, dtype), batch, start + steps)
    for cache in peer.k_cache + peer.v_cache:  # the context's KV: only its reads matter here
        cache[:, :, :start].normal_()
    cuda = device.type == "cuda"
    fn = torch.compile(peer.step) if compile else peer.step
    tokens = torch.randint(0, cfg.vocab_size, (batch,), device=device)
    pos = torch.full((1,), start, device=device, dtype=torch.int64)

    def once() -> None:
        tokens.copy_(fn(tokens, pos).argmax(-1))
        pos.add_(1)

    t0 = time.perf_counter()
    with torch.inference_mode():
        if cuda:
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(3):  # compiles, autotunes, allocates outside the graph
                    once()
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                once()
            run = graph.replay
        else:
            once()
            run = once
        pos.fill_(start)
        if cuda:
            torch.cuda.synchronize(device)
        compiled = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(steps):
            run()
        if cuda:
            torch.cuda.synchronize(device)
    return PeerTiming(batch, start, steps, time.perf_counter() - t0, compiled)
