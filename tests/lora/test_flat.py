"""The flat LoRA format (lora/flat.py), host copies laid out as slots (lora/image.py) and the
slots' run copies (lora/pool.py), on CPU without an engine: canonical order, exact round
trips, runs merged only where the buffer and the layers are both back to back, and a slot
filled, updated and read back by runs holding exactly what the per-tensor path writes,
also for one rank's part under tensor parallelism."""

from __future__ import annotations

import pytest
import torch

from lora.adapter import LoraAdapterConfig, adapter_tensor_name, parse_adapter
from lora.flat import FlatLayout, FlatLoraAdapter, Run, parse_peft_name, plan_runs
from lora.image import HostImage
from lora.pool import LoraPool
from lora.update import plan_flat_update
from rollout.distributed.tp import TensorParallel
from rollout.model.config import ModelConfig
from rollout.model.shapes import SHAPES

MODEL = ModelConfig.from_dict(SHAPES["tiny"])  # 2 layers, hidden 64, inter 128, 4 heads / 2 KV of 16
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _adapter(rank: int = 4, targets: tuple[str, ...] = ALL, seed: int = 0, layers: list[int] | None = None,
             dtype: torch.dtype = torch.float32) -> tuple[LoraAdapterConfig, dict[str, torch.Tensor]]:
    from lora.adapter import module_shape

    config = LoraAdapterConfig.from_dict(dict(r=rank, lora_alpha=2 * rank, target_modules=list(targets),
                                              layers_to_transform=layers), max_rank=16)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer, module in sorted(config.targets(MODEL.num_layers)):
        fan_in, fan_out = module_shape(MODEL, module)
        tensors[adapter_tensor_name(layer, module, "A")] = torch.randn(rank, fan_in, generator=g).to(dtype)
        tensors[adapter_tensor_name(layer, module, "B")] = torch.randn(fan_out, rank, generator=g).to(dtype)
    return config, tensors


def test_canonical_order_and_exact_round_trip() -> None:
    _, tensors = _adapter()
    shuffled = list(tensors.items())[::-1]
    flat = FlatLoraAdapter.pack(shuffled)
    keys = [parse_peft_name(n) for n in flat.layout.names]
    # q, k, v, o, gate, up, down; A before B; layers ascending
    assert keys[:4] == [(0, "q_proj", "A"), (1, "q_proj", "A"), (0, "q_proj", "B"), (1, "q_proj", "B")]
    assert [k[1] for k in keys[::4]] == list(ALL)
    assert flat.buffer.shape == (sum(t.numel() for t in tensors.values()),)
    assert all(torch.equal(view, tensors[name]) for name, view in flat.named_tensors())
    assert torch.equal(flat.view(adapter_tensor_name(1, "down_proj", "B")), tensors[adapter_tensor_name(1, "down_proj", "B")])
    with pytest.raises(ValueError, match="2-D"):
        FlatLayout.canonical([("x", (2, 3, 4))])
    with pytest.raises(ValueError, match="not a floating-point tensor"):
        FlatLoraAdapter.pack([("x", torch.zeros(2, 2, dtype=torch.int64))])


def test_runs_merge_only_back_to_back_layers() -> None:
    _, tensors = _adapter()
    flat = FlatLoraAdapter.pack(tensors)
    entries = [(*parse_peft_name(n), off, *shape) for n, shape, off in
               zip(flat.layout.names, flat.layout.shapes, flat.layout.offsets)]
    runs = plan_runs(entries)
    assert len(runs) == 14 and all(r.num_layers == 2 for r in runs)  # 7 modules x A/B, both layers each
    assert sum(r.numel for r in runs) == flat.buffer.numel()
    # a missing layer, or a gap in the buffer, starts a new run
    assert [r.num_layers for r in plan_runs([(0, "q_proj", "A", 0, 4, 64), (2, "q_proj", "A", 256, 4, 64)])] == [1, 1]
    assert [r.num_layers for r in plan_runs([(0, "q_proj", "A", 0, 4, 64), (1, "q_proj", "A", 300, 4, 64)])] == [1, 1]
    assert plan_runs([(0, "q_proj", "A", 0, 4, 64), (1, "q_proj", "A", 256, 4, 64)]) == [Run("q_proj", "A", 0, 2, 4, 64, 0)]


def _pool(tp: TensorParallel, max_rank: int = 8) -> LoraPool:
    return LoraPool(MODEL, 3, max_rank, ALL, torch.float32, torch.device("cpu"), tp)


def _expected_slot(pool: LoraPool, slot: int, tensors: dict[str, torch.Tensor], rank: int, scaling: float):
    """What the per-tensor path (write_modules) leaves in a zeroed slot."""
    ref = _pool(pool.tp, pool.max_rank)
    parts = [(*parse_peft_name(n)[:2], parse_peft_name(n)[2], t) for n, t in tensors.items()]
    ref.write_modules(slot, parts, rank, scaling)
    return ref


@pytest.mark.parametrize("tp_rank", [None, 0, 1], ids=["single", "tp2-rank0", "tp2-rank1"])
def test_slot_by_runs_equals_slot_by_tensor(tp_rank: int | None) -> None:
    tp = TensorParallel(0, 1) if tp_rank is None else TensorParallel(tp_rank, 2)
    config, tensors = _adapter(rank=4, targets=("q_proj", "v_proj", "o_proj", "up_proj", "down_proj"), layers=[1])
    weights = parse_adapter(config, tensors, MODEL)
    pool = _pool(tp)
    image = HostImage(weights, torch.float32, pin=False)
    assert len(image.runs) == 10  # five modules x A/B, one layer each
    pool.b_stack["qkv_proj"][1].fill_(7.0)  # stale contents of a slot's former adapter are cleared
    pool.write(1, image)
    ref = _expected_slot(pool, 1, tensors, 4, config.scaling)
    for name in pool.a_stack:
        assert torch.equal(pool.a_stack[name], ref.a_stack[name]) and torch.equal(pool.b_stack[name], ref.b_stack[name])
    assert pool.slot_ranks.tolist() == [0, 4, 0]

    # an in-place flat update of the resident adapter, then read back into the host copy
    new = {n: torch.randn_like(t) for n, t in tensors.items()}
    update = plan_flat_update(weights, FlatLoraAdapter.pack(new), MODEL)
    pool.write_runs(1, list(update.runs), update.flat.buffer, 4, config.scaling)
    ref = _expected_slot(pool, 1, new, 4, config.scaling)
    for name in pool.a_stack:
        assert torch.equal(pool.a_stack[name], ref.a_stack[name]) and torch.equal(pool.b_stack[name], ref.b_stack[name])
    image.buffer.zero_()
    pool.read(1, image)
    for (layer, module), (a, b) in image.modules.items():
        a_ref = new[adapter_tensor_name(layer, module, "A")]
        b_ref = new[adapter_tensor_name(layer, module, "B")] * config.scaling
        assert torch.equal(pool._local(module, "A", a), pool._local(module, "A", a_ref))  # this rank's part
        assert torch.equal(pool._local(module, "B", b), pool._local(module, "B", b_ref))


def test_host_image_holds_the_adapter_scaled_in_the_model_dtype() -> None:
    config, tensors = _adapter(rank=4, dtype=torch.float32)
    weights = parse_adapter(config, tensors, MODEL)
    image = HostImage(weights, torch.bfloat16, pin=False)
    assert image.buffer.dtype == torch.bfloat16 and image.buffer.numel() == sum(t.numel() for t in tensors.values())
    a, b = image.modules[1, "gate_proj"]
    assert torch.equal(a, tensors[adapter_tensor_name(1, "gate_proj", "A")].bfloat16())
    assert torch.equal(b, (tensors[adapter_tensor_name(1, "gate_proj", "B")] * config.scaling).bfloat16())
    run = next(r for r in image.runs if r.module == "up_proj" and r.which == "B")
    assert torch.equal(image.run_view(run)[1], image.modules[1, "up_proj"][1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device-side copies and NaN check of a CUDA engine")
def test_gpu_engine_flat_update_writes_what_the_update_by_name_writes(llama) -> None:
    """No peft needed (the GPU image has none): two CUDA engines, one adapter updated by name
    in one and flat in the other, hold the same slot bits and decode the same tokens."""
    from rollout import Engine, EngineConfig, SamplingParams

    hf_model = ModelConfig.from_dir(llama.path)
    rank, targets = 4, ("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj")
    config = dict(r=rank, lora_alpha=8, target_modules=list(targets))
    engines = [Engine(EngineConfig(model=llama.path, device="cuda", enable_lora=True, max_lora_rank=8,
                                   max_total_tokens=2048, cuda_graph=False, attention="triton")) for _ in range(2)]
    greedy = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    prompt = [5, 17, 3, 42, 8, 11]

    def tensors(seed: int) -> dict[str, torch.Tensor]:
        from lora.adapter import module_shape

        g, out = torch.Generator().manual_seed(seed), {}
        for layer in range(hf_model.num_layers):
            for module in targets:
                fan_in, fan_out = module_shape(hf_model, module)
                out[adapter_tensor_name(layer, module, "A")] = torch.randn(rank, fan_in, generator=g) * 0.3
                out[adapter_tensor_name(layer, module, "B")] = torch.randn(fan_out, rank, generator=g) * 0.3
        return out

    for engine in engines:
        engine.load_lora_adapter("x", tensors=tensors(0), config=config)
        engine.generate(input_ids=[prompt], sampling_params=greedy, lora_name="x")  # resident in a slot
    new = {n: t.cuda() for n, t in tensors(1).items()}
    flat = FlatLoraAdapter.pack(new)
    bad = FlatLoraAdapter(flat.buffer.clone(), flat.layout)
    bad.buffer[0] = float("inf")
    with pytest.raises(ValueError, match=r"adapter 'x': adapter tensor '.*layers\.0\.self_attn\.q_proj\.lora_A.*' has non-finite"):
        engines[1].update_lora_adapter("x", bad)
    assert engines[0].update_lora_adapter("x", list(new.items())) == engines[1].update_lora_adapter("x", flat) == 1
    pools = [e.lora.pool for e in engines]
    for m in pools[0].a_stack:
        assert torch.equal(pools[0].a_stack[m], pools[1].a_stack[m]) and torch.equal(pools[0].b_stack[m], pools[1].b_stack[m])
    outs = [e.generate(input_ids=[prompt], sampling_params=greedy, lora_name="x")[0].token_ids for e in engines]
    assert outs[0] == outs[1]
