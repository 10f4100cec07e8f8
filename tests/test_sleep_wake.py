"""sleep / wake on CPU: every buffer is released (weights, KV pool, LoRA slots; graphs and
the attention backend dropped) and re-made, outputs after wake equal outputs before, requests
accepted before sleep finish after wake, new ones are refused while asleep, and level 2 needs
a full weight sync. (GPU: resident memory and wake time are measured in BENCHMARKS.md.)"""

from __future__ import annotations

import pytest
import torch

from conftest import TinyModel, make_prompts
from rollout import Engine, EngineConfig, SamplingParams
from weightsync import iter_hf_weights

GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=8, seed=5, ignore_eos=True, logprobs_mode="raw")


def _adapter(llama: TinyModel, seed: int) -> dict[str, torch.Tensor]:
    """Random rank-4 LoRA tensors on q_proj and down_proj, under PEFT state-dict names."""
    cfg, g = llama.hf.config, torch.Generator().manual_seed(seed)
    h, i = cfg.hidden_size, cfg.intermediate_size
    out = {}
    for layer in range(cfg.num_hidden_layers):
        for module, part, fan_in, fan_out in (("q_proj", "self_attn", h, h), ("down_proj", "mlp", i, h)):
            name = f"base_model.model.model.layers.{layer}.{part}.{module}"
            out[f"{name}.lora_A.weight"] = torch.randn(4, fan_in, generator=g) * 0.3
            out[f"{name}.lora_B.weight"] = torch.randn(fan_out, 4, generator=g) * 0.3
    return out


def _device_tensors(engine: Engine) -> list[torch.Tensor]:
    tensors = [*engine.model.parameters(), *engine.model.buffers(), *engine.kv_pool.k_buffers, *engine.kv_pool.v_buffers]
    if engine.lora is not None:
        tensors += engine.lora.device_tensors()
    return tensors


@pytest.mark.parametrize("lora", [False, True])
def test_level1_releases_everything_and_wakes_to_the_same_outputs(llama: TinyModel, lora: bool) -> None:
    engine = Engine(EngineConfig(model=llama.path, page_size=4, enable_lora=lora, max_lora_rank=8))
    prompts = make_prompts(llama.vocab_size, [5, 9, 3], seed=60)
    names = None
    if lora:  # an adapter resident in a slot whose host copy is stale (updated in place) when sleep comes
        config = dict(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"])
        engine.load_lora_adapter("a", tensors=_adapter(llama, 1), config=config)
        names = ["a", None, "a"]
        engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_name=names)
        engine.update_lora_adapter("a", _adapter(llama, 2).items())
        assert engine.lora.adapters["a"].host_stale
    # Both runs below must compute their KV the same way: sleep drops the prefix cache, so the
    # run before it must not reuse KV the greedy run cached (a different batch shape: in the
    # default, not batch-invariant, mode fp32 sums differ in the last bits on some CPUs).
    engine.flush_cache()
    before = engine.generate(input_ids=prompts, sampling_params=SAMPLED, lora_name=names)
    total = sum(t.numel() * t.element_size() for t in _device_tensors(engine))
    stats = engine.sleep(level=1)
    assert all(t.numel() == 0 for t in _device_tensors(engine)), "a buffer stayed resident"
    assert engine.runner.graphs is None and engine.runner.backend is None
    assert sum(stats.released_bytes.values()) == total
    with pytest.raises(RuntimeError, match="the engine is asleep"):
        engine.generate(input_ids=prompts, sampling_params=GREEDY)
    engine.wake()
    assert sum(engine.memory.stats.restored_bytes.values()) == total and engine.memory.stats.level == 0
    after = engine.generate(input_ids=prompts, sampling_params=SAMPLED, lora_name=names)
    assert [o.token_ids for o in after] == [o.token_ids for o in before]
    assert [o.logprobs for o in after] == [o.logprobs for o in before]
    for _ in range(3):  # cycles: the host copies are reused, nothing accumulates
        engine.sleep(level=1)
        engine.wake()
    assert engine.generate(input_ids=prompts[:1], sampling_params=GREEDY)[0].token_ids == llama.greedy(prompts[0], 8)


def test_requests_accepted_before_sleep_finish_after_wake(llama: TinyModel) -> None:
    engine = Engine(EngineConfig(model=llama.path))
    prompts = make_prompts(llama.vocab_size, [6, 11], seed=61)
    ids = [engine.add_request(p, GREEDY)[0] for p in prompts]
    engine.step()
    engine.step()
    engine.sleep()
    assert engine.step() == [] and engine.stats().num_waiting == 2, "accepted requests wait while asleep"
    with pytest.raises(RuntimeError, match="asleep"):
        engine.add_request(prompts[0], GREEDY)
    engine.wake(["weights"])  # staged: the KV cache is still released
    with pytest.raises(RuntimeError, match="asleep"):
        engine.add_request(prompts[0], GREEDY)
    engine.wake(["kv_cache"])
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    assert [outs[i].token_ids for i in ids] == [llama.greedy(p, 8) for p in prompts]
    assert engine.kv.used_slots() == 0 or engine.kv.tree is not None


def test_level2_discards_weights_until_a_full_sync(llama: TinyModel) -> None:
    engine = Engine(EngineConfig(model=llama.path))
    prompt = make_prompts(llama.vocab_size, [7], seed=62)[0]
    engine.sleep(level=2)
    with pytest.raises(ValueError, match="'kv_cache' needs the weights awake"):
        engine.wake(["kv_cache"])
    with pytest.raises(RuntimeError, match="the weights are asleep"):
        engine.update_weights(iter_hf_weights(llama.hf), full=True)
    engine.wake(["weights"])
    assert all(float(p.abs().sum()) == 0 for p in engine.model.parameters()), "level 2 keeps no weights"
    with pytest.raises(ValueError, match="must be full=True"):
        engine.update_weights([("model.norm.weight", llama.hf.model.norm.weight.detach())])
    engine.update_weights(iter_hf_weights(llama.hf), full=True)  # the trainer's sync, before the KV returns
    engine.wake(["kv_cache"])
    assert engine.generate(input_ids=[prompt], sampling_params=GREEDY)[0].token_ids == llama.greedy(prompt, 8)


@pytest.mark.parametrize("level", [1, 2])
def test_a_wait_update_while_asleep_returns_and_the_requests_run_under_it(llama: TinyModel, level: int) -> None:
    """pause_mode="wait" with requests accepted before sleep: none can run until wake, so the
    update does not wait for them (it used to step forever); they resume under the new weights."""
    engine = Engine(EngineConfig(model=llama.path))
    prompts = make_prompts(llama.vocab_size, [6, 9], seed=63)
    ids = [engine.add_request(p, GREEDY)[0] for p in prompts]
    engine.step()
    engine.sleep(level=level)
    engine.wake(["weights"])  # the trainer syncs before the KV cache returns
    assert engine.update_weights(iter_hf_weights(llama.hf), full=True, pause_mode="wait") == 1
    engine.wake(["kv_cache"])
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    assert [outs[i].token_ids for i in ids] == [llama.greedy(p, 8) for p in prompts]
    assert all(outs[i].weight_versions[-1][0] == 1 for i in ids)


def test_bad_sleep_and_wake_calls(llama: TinyModel) -> None:
    engine = Engine(EngineConfig(model=llama.path))
    with pytest.raises(ValueError, match="level=3: must be <= 2"):
        engine.sleep(level=3)
    with pytest.raises(ValueError, match="expected a non-empty subset"):
        engine.wake(["gpu"])
    engine.wake()  # awake already: nothing to do
    engine.sleep()
    with pytest.raises(RuntimeError, match="already asleep"):
        engine.sleep()
    engine.wake()
    prompt = make_prompts(llama.vocab_size, [4], seed=63)[0]
    assert engine.generate(input_ids=[prompt], sampling_params=GREEDY)[0].token_ids == llama.greedy(prompt, 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's CUDA caching allocator and real CUDA graphs need a GPU")
@pytest.mark.whole_gpu  # its engine sizes its KV cache from the free memory; it counts reserved bytes
def test_sleep_wake_cycles_do_not_grow_reserved_memory(llama: TinyModel) -> None:
    """Each wake re-captures the decode graphs. cuBLAS keeps a workspace per (handle, stream)
    that empty_cache() never frees, so a capture on a new stream each wake left one workspace
    (32 MiB on Hopper) behind per cycle; with one capture stream per device the reserved
    memory after a cycle stays where the first cycle left it."""
    engine = Engine(EngineConfig(model=llama.path, device="cuda", page_size=16, cuda_graph=True))
    prompt = make_prompts(llama.vocab_size, [7], seed=61)
    first = engine.generate(input_ids=prompt, sampling_params=GREEDY)[0].token_ids
    assert engine.runner.graphs is not None
    reserved = []
    for _ in range(4):
        engine.sleep(level=1)
        engine.wake()
        assert engine.generate(input_ids=prompt, sampling_params=GREEDY)[0].token_ids == first
        torch.cuda.synchronize()
        reserved.append(torch.cuda.memory_reserved())
    grown = reserved[-1] - reserved[0]
    assert grown < 16 * 2**20, f"reserved memory grew {grown / 2**20:.1f} MiB over 3 sleep/wake cycles: {reserved}"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.whole_gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs and torch's allocator need a GPU")])])
@pytest.mark.parametrize("overlap", [False, True])
def test_a_dropped_engine_frees_its_model_and_kv(llama: TinyModel, device: str, overlap: bool) -> None:
    """An engine that served (LoRA on, an adapter loaded) and is dropped leaves nothing behind:
    a process that builds a second engine (a benchmark comparing configs, a trainer restarting
    its rollout side) must get the first one's memory back. On GPU with its graphs captured, and
    torch's allocated bytes come back to where they were."""
    import gc
    import weakref

    if device == "cuda":
        _warm_cublas_workspaces()
    allocated = torch.cuda.memory_allocated() if device == "cuda" else 0
    engine = Engine(EngineConfig(model=llama.path, device=device, page_size=16, overlap_schedule=overlap,
                                 enable_lora=True, max_lora_rank=8, max_total_tokens=4096))
    engine.load_lora_adapter("a", tensors=_adapter(llama, 1),
                             config=dict(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]))
    engine.generate(input_ids=make_prompts(llama.vocab_size, [5, 9, 3], seed=62), sampling_params=GREEDY,
                    lora_name=["a", None, "a"])
    held = [weakref.ref(x) for x in (engine, engine.model, engine.kv_pool, engine.kv_pool.k_buffers[0])]
    del engine
    gc.collect()
    assert [ref() is None for ref in held] == [True] * len(held), "something still holds the engine's parts"
    if device == "cuda":
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() - allocated < 2**20


def _warm_cublas_workspaces() -> None:
    """cuBLAS keeps a workspace per (handle, stream), made through torch's allocator at the
    stream's first matmul and kept for the process (rollout/model/cuda_graph.py capture_stream
    says why the engine leaves it): made before the baseline, it is not counted as the engine's
    whichever test ran first in this process."""
    from rollout.model.cuda_graph import capture_stream

    for stream in (torch.cuda.current_stream(), capture_stream(torch.device("cuda"))):
        with torch.cuda.stream(stream):
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.ones(8, 8, device="cuda", dtype=dtype)
                torch.nn.functional.linear(x, x, x[0])  # addmm (cublasLt) and
                torch.nn.functional.linear(x, x)  # mm (cublas)
    torch.cuda.synchronize()
