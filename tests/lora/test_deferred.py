"""Deferred adapter deltas (lora/hook.py): in a small batch the expand runs beside the base
GEMM into an fp32 delta, and the kernel that consumes the projection's output (add-RMSNorm,
SiLU-mul, rotary with v) adds it on load. The model's output must be bit-equal to the
in-place expand's, on the torch path (CPU), through the fused kernels and SGMV kernels
(the interpreter on CPU), and replayed from a CUDA graph whose side stream carries the
deltas (GPU). The peft comparison of the engine with deferral on is in test_engine_lora.py."""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import (the kernel test)

from lora import hook as lora_hook
from lora.pool import LoraPool
from rollout import kernels
from rollout.batch import LoraInputs
from rollout.kernels.options import KernelOptions
from rollout.model.config import ModelConfig
from rollout.model.llama import LlamaModel
from rollout.model.lora_segments import plan_segments

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ON_GPU = torch.cuda.is_available()


class _CausalAttention:
    """A stand-in attention backend: one sequence, causal, GQA by repeating kv heads."""

    def kv_target(self, layer_id: int) -> None:
        return None  # no pool: forward gets k and v

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                stored: bool = False) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
        return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True).transpose(0, 1)


def _model(arch: str, dtype: torch.dtype, device: torch.device,
           options: KernelOptions = KernelOptions()) -> tuple[LlamaModel, LoraPool]:
    """The same model and adapters every time, its layers and pool built with `options`."""
    cfg = ModelConfig.from_dict({
        "architectures": [arch], "vocab_size": 96, "hidden_size": 64, "intermediate_size": 160,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    })
    model = LlamaModel(cfg, max_positions=256, options=options)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.2 * torch.randn(p.shape, generator=g))
    model.to(device)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    pool = LoraPool(cfg, 3, 8, MODULES, dtype, device, options=options)
    for t in (*pool.a_stack.values(), *pool.b_stack.values()):
        t.copy_(torch.randn(t.shape, generator=g) * 0.3)
    pool.slot_ranks.copy_(torch.tensor([8, 4, 0], dtype=torch.int32))
    for layer, name, linear in model.projections():
        linear.lora = pool.hook(layer, name)
    return model, pool


def _inputs(slots: list[int], device: torch.device) -> LoraInputs:
    plan = plan_segments(slots, [1] * len(slots), num_rows=len(slots), num_segments=3)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    return LoraInputs(t(plan.row_ids), t(plan.seg_indptr), t(plan.seg_slots), plan.num_lora_rows)


def _forward(model: LlamaModel, device: torch.device, tokens: int) -> torch.Tensor:
    ids = torch.arange(tokens, device=device) * 7 % model.config.vocab_size
    positions = torch.arange(tokens, device=device) + 3
    with torch.inference_mode():
        return model(ids, positions, _CausalAttention())  # type: ignore[arg-type]


@pytest.fixture
def deferrals(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the projections whose delta was deferred."""
    seen: list[int] = []
    real = lora_hook.LoraHook._deferred

    def counted(self, x, args):  # type: ignore[no-untyped-def]
        seen.append(x.shape[0])
        return real(self, x, args)

    monkeypatch.setattr(lora_hook.LoraHook, "_deferred", counted)
    return seen


SLOTS = [0, -1, 1, 2, 0, 1, -1]  # two adapters, base rows and an empty slot (rank 0)


def _both(arch: str, dtype: torch.dtype, device: torch.device, slots: list[int],
          options: KernelOptions = KernelOptions()) -> tuple[LlamaModel, LoraPool, torch.Tensor, torch.Tensor]:
    """The model's output with the in-place expand and with deferred deltas (two builds of the
    same model, defer_eager off and on), and the deferring build."""
    outs = []
    for eager in (False, True):
        model, pool = _model(arch, dtype, device, replace(options, lora_defer_eager=eager))
        pool.plan(_inputs(slots, device), active=True)
        outs.append(_forward(model, device, len(slots)))
    return model, pool, outs[0], outs[1]


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_torch_path_deferred_is_bit_equal_to_in_place(arch: str, deferrals: list[int]) -> None:
    # Qwen2: qkv bias; Qwen3: q/k norms before the rotary, so its qkv delta is not deferred
    device = torch.device("cpu")
    model, pool, in_place, deferred = _both(arch, torch.float32, device, SLOTS)
    per_layer = 3 if model.config.qk_norm else 4
    assert len(deferrals) == per_layer * model.config.num_layers
    assert torch.equal(in_place, deferred)
    pool.plan(None, active=False)
    assert not torch.equal(_forward(model, device, len(SLOTS)), in_place), "the adapters changed nothing"


@pytest.mark.skipif(ON_GPU, reason="the interpreter run; the GPU runs the graph test below")
def test_fused_and_sgmv_kernels_deferred_is_bit_equal_to_in_place(monkeypatch: pytest.MonkeyPatch,
                                                                 deferrals: list[int]) -> None:
    pytest.importorskip("triton", reason="triton is not installed")
    # the fused kernels and the SGMV kernels on CPU tensors (interpreter)
    options = KernelOptions(fused=True, lora_triton=True)
    device = torch.device("cpu")
    calls: dict[str, int] = {}
    for module, name in ((kernels.fused, "rms_norm"), (kernels.fused, "silu_and_mul"),
                         (kernels.rotary, "rotary_embedding")):
        real = getattr(module, name)

        def with_delta_counted(*args, _real=real, _name=name, **kw):  # type: ignore[no-untyped-def]
            calls[_name] = calls.get(_name, 0) + (kw.get("delta") is not None)
            return _real(*args, **kw)

        monkeypatch.setattr(module, name, with_delta_counted)
    # fp16: the interpreter has no bf16 dot
    model, _, in_place, deferred = _both("LlamaForCausalLM", torch.float16, device, SLOTS, options)
    layers = model.config.num_layers
    assert len(deferrals) == 4 * layers
    # each layer's two norms, the final norm (down's delta of the last layer), SiLU-mul, rotary
    assert calls == {"rms_norm": 2 * layers, "silu_and_mul": layers, "rotary_embedding": layers}
    assert torch.equal(in_place, deferred)


def test_only_small_batches_defer_and_only_where_a_delta_is_taken(deferrals: list[int]) -> None:
    device = torch.device("cpu")
    model, pool = _model("LlamaForCausalLM", torch.float32, device)
    pool.plan(_inputs(SLOTS, device), active=True)
    assert not pool.defers(1), "outside a graph's side stream nothing defers by default"
    model, pool = _model("LlamaForCausalLM", torch.float32, device,
                         KernelOptions(lora_defer_eager=True, lora_defer_max_rows=len(SLOTS) - 1))
    pool.plan(_inputs(SLOTS, device), active=True)
    _forward(model, device, len(SLOTS))
    assert deferrals == []  # past defer_max_rows: the in-place expand
    model, pool = _model("LlamaForCausalLM", torch.float32, device,
                         KernelOptions(lora_defer_eager=True, lora_defer_max_rows=len(SLOTS)))
    pool.plan(_inputs(SLOTS, device), active=True)
    _forward(model, device, len(SLOTS))
    assert deferrals == [len(SLOTS)] * (4 * model.config.num_layers)
    deferrals.clear()
    model.layers[0].self_attn.qkv_proj(torch.zeros(len(SLOTS), 64))  # plain forward(): never deferred
    assert deferrals == []


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs and a side stream need a GPU")
def test_gpu_graph_with_deferred_deltas_equals_eager_in_place(deferrals: list[int]) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    model, pool = _model("LlamaForCausalLM", torch.bfloat16, device)
    tokens = 9
    static = _inputs([0] * tokens, device)
    with torch.inference_mode():
        pool.plan(static, active=True, concurrent=True)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            _forward(model, device, tokens)  # compile outside the capture
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = _forward(model, device, tokens)
    assert len(deferrals) >= 4 * model.config.num_layers, "the graph's projections did not defer"
    for slots in ([1, -1, 0, 2, 0, 0, 1, -1, 1], [0] * tokens, [-1] * (tokens - 1) + [1]):
        fresh = _inputs(slots, device)
        for dst, src in zip((static.row_ids, static.seg_indptr, static.seg_slots),
                            (fresh.row_ids, fresh.seg_indptr, fresh.seg_slots)):
            dst.copy_(src)
        graph.replay()
        pool.plan(fresh, active=True, concurrent=False)  # eager, one stream: the in-place expand
        want = _forward(model, device, tokens)
        pool.plan(static, active=True, concurrent=True)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
