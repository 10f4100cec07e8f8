"""Multi-LoRA in the engine against peft (unmerged PeftModel, float32, CPU): three adapters
of different ranks, alphas and target sets (one rslora) mixed with base-model requests in
one batch; page 1 and 16, radix on and off, tight KV (retraction), fewer slots than
adapters; LoRA-only updates; the prefix cache keyed by (adapter, version); refusals."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from conftest import TinyModel, make_prompts

from lora.hook import LoraHook
from rollout import Engine, EngineConfig, SamplingParams
from rollout.kernels.options import KernelOptions
from weightsync import iter_hf_weights

peft = pytest.importorskip("peft")
from peft_ref import ADAPTERS, GREEDY, NEW, PeftRef, randomize_adapter, save_adapter  # noqa: E402


@pytest.fixture(scope="module")
def ref(llama: TinyModel, tmp_path_factory) -> PeftRef:
    return PeftRef(llama, tmp_path_factory.mktemp("adapters"))


def _engine(llama: TinyModel, ref: PeftRef, **kw) -> Engine:
    args = dict(model=llama.path, enable_lora=True, max_loras_per_batch=4, max_lora_rank=16)
    args.update(kw)
    engine = Engine(EngineConfig(**args))
    for name in ADAPTERS:
        engine.load_lora_adapter(name, ref.dirs[name])
    return engine


MIX = ["a", None, "b", "c", "a", "c", None, "b"]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("radix", [True, False])
def test_mixed_batch_matches_peft(llama: TinyModel, ref: PeftRef, page_size: int, radix: bool) -> None:
    engine = _engine(llama, ref, page_size=page_size, enable_radix_cache=radix)
    prompts = make_prompts(llama.vocab_size, [5, 9, 3, 12, 7, 5, 20, 4], seed=40)
    prompts[4] = prompts[0][:3] + prompts[4][3:]  # a shared prefix under the same adapter
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_name=MIX)
    for out, prompt, adapter in zip(outs, prompts, MIX):
        assert out.token_ids == ref.greedy(adapter, prompt), f"adapter {adapter}"
        assert out.lora_name == adapter
        assert out.lora_versions == (None if adapter is None else [(0, 0, NEW)])
        want = ref.logprobs(adapter, prompt, out.token_ids)
        assert torch.allclose(torch.tensor(out.logprobs), want, atol=1e-4), (adapter, out.logprobs, want)


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_as_decode_rows_matches_peft(llama: TinyModel, ref: PeftRef, page_size: int) -> None:
    """Prefill chunks laid out as decode rows (what a GPU replays in a decode graph: runner
    extend_rows_kv), forced on CPU: each adapter's rows form one segment, as in the extend layout."""
    engine = _engine(llama, ref, page_size=page_size, max_prefill_tokens=16,
                     kernel_options=KernelOptions(extend_rows_kv=1 << 30))
    rows: list[int] = []
    inner = engine.runner._prepare_rows
    engine.runner._prepare_rows = lambda batch: rows.append(1) or inner(batch)  # type: ignore[method-assign]
    prompts = make_prompts(llama.vocab_size, [5, 9, 3, 12, 7, 5, 20, 4], seed=42)
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_name=MIX)
    assert rows
    for out, prompt, adapter in zip(outs, prompts, MIX):
        assert out.token_ids == ref.greedy(adapter, prompt), f"adapter {adapter}"
        want = ref.logprobs(adapter, prompt, out.token_ids)
        assert torch.allclose(torch.tensor(out.logprobs), want, atol=1e-4), (adapter, out.logprobs, want)


def test_deferred_deltas_match_peft(llama: TinyModel, ref: PeftRef, monkeypatch: pytest.MonkeyPatch) -> None:
    """The consumer-added adapter deltas (lora/hook.py; on a GPU, decode graphs of up to
    LoraPool.defer_max_rows rows) forced on for every step, prefill included."""
    engine = _engine(llama, ref, kernel_options=KernelOptions(lora_defer_eager=True, lora_defer_max_rows=1 << 20))
    deferred: list[int] = []
    real = LoraHook._deferred
    monkeypatch.setattr(LoraHook, "_deferred", lambda self, x, args: deferred.append(1) or real(self, x, args))
    prompts = make_prompts(llama.vocab_size, [5, 9, 3, 12, 7, 5, 20, 4], seed=41)
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_name=MIX)
    assert deferred, "no projection deferred its delta"
    for out, prompt, adapter in zip(outs, prompts, MIX):
        assert out.token_ids == ref.greedy(adapter, prompt), f"adapter {adapter}"
        want = ref.logprobs(adapter, prompt, out.token_ids)
        assert torch.allclose(torch.tensor(out.logprobs), want, atol=1e-4), (adapter, out.logprobs, want)


def test_tight_kv_and_fewer_slots_than_adapters(llama: TinyModel, ref: PeftRef) -> None:
    """Two slots for three adapters and a KV pool that forces retraction: every request is
    served correctly, and no step ever runs more adapters than there are slots."""
    engine = _engine(llama, ref, max_loras_per_batch=2, max_total_tokens=96, page_size=4)
    seen: list[int] = []
    schedule = engine.scheduler.schedule

    def watched():
        batch = schedule()
        if batch is not None:
            seen.append(len({r.lora_name for r in batch.reqs if r.lora_name is not None}))
        return batch

    engine.scheduler.schedule = watched
    prompts = make_prompts(llama.vocab_size, [9, 14, 6, 11, 8, 13, 7, 10, 12, 5], seed=41)
    names = ["a", "b", "c", None, "c", "b", "a", None, "b", "c"]
    outs = engine.generate(input_ids=prompts, sampling_params=SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True),
                           lora_name=names)
    for out, prompt, adapter in zip(outs, prompts, names):
        assert out.token_ids == ref.greedy(adapter, prompt, 16), f"adapter {adapter}"
    assert max(seen) <= 2
    assert engine.counters.retractions > 0, "the test must exercise retraction"
    assert engine.kv.used_slots() == 0 or engine.kv.tree is not None
    assert all(r == 0 for r in engine.lora.slot_refs), "slot references leaked"


def test_n_samples_fork_under_an_adapter(llama: TinyModel, ref: PeftRef) -> None:
    engine = _engine(llama, ref)
    prompt = make_prompts(llama.vocab_size, [10], seed=42)[0]
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=4, seed=7, logprobs_mode="raw", ignore_eos=True)
    outs = engine.generate(input_ids=[prompt], sampling_params=params, lora_name="c")
    assert [o.num_cached_tokens for o in outs][1:] == [10] * 3  # followers forked the leader's prompt
    for out in outs:
        want = ref.logprobs("c", prompt, out.token_ids)
        assert torch.allclose(torch.tensor(out.logprobs), want, atol=1e-4)


def test_lora_only_update_changes_that_adapter_only(llama: TinyModel, ref: PeftRef, tmp_path) -> None:
    engine = _engine(llama, ref)
    prompts = make_prompts(llama.vocab_size, [11, 11], seed=43)
    names = ["a", "b"]
    first = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_name=names)
    # train-like change to adapter a only, in a separate peft model (the "trainer")
    trainer = copy.deepcopy(ref.model)
    trainer.set_adapter("a")
    randomize_adapter(trainer, "a", seed=777)
    update = list(iter_hf_weights(trainer, adapter_only=True))
    assert update and all("lora_" in n for n, _ in update)
    assert engine.update_lora_adapter("a", update) == 1
    again = engine.generate(input_ids=prompts + [prompts[0]], sampling_params=GREEDY, lora_name=names + [None])
    trainer.eval()
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        want = trainer.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0,
                                attention_mask=torch.ones_like(ids))[0, len(prompts[0]):].tolist()
    assert again[0].token_ids == want and again[0].lora_versions == [(1, 0, NEW)]
    assert again[0].num_cached_tokens == 0, "KV of the old version of a must not be reused"
    assert again[1].token_ids == first[1].token_ids and again[1].num_cached_tokens > 0, "b keeps its cache"
    assert again[2].token_ids == ref.greedy(None, prompts[0])
    assert [i.version for i in engine.list_lora_adapters()] == [1, 0, 0]


def test_update_of_a_running_adapter_retracts_and_resumes_under_the_new_version(llama: TinyModel, ref: PeftRef) -> None:
    engine = _engine(llama, ref)
    prompt = make_prompts(llama.vocab_size, [6], seed=44)[0]
    rid = engine.add_request(prompt, GREEDY, lora_name="b")[0]
    other = engine.add_request(prompt, GREEDY, lora_name="c")[0]
    for _ in range(4):
        engine.step()
    trainer = copy.deepcopy(ref.model)
    trainer.set_adapter("b")
    randomize_adapter(trainer, "b", seed=778)
    engine.update_lora_adapter("b", iter_hf_weights(trainer, adapter_only=True))
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    out = outs[rid]
    assert [v for v, _, _ in out.lora_versions] == [0, 1] and out.lora_versions[-1][2] == NEW
    split = out.lora_versions[0][2]
    assert out.token_ids[:split] == ref.greedy("b", prompt)[:split]
    trainer.eval()
    ids = torch.tensor([prompt + out.token_ids[:split]])
    with torch.no_grad():
        rest = trainer.generate(input_ids=ids, max_new_tokens=NEW - split, do_sample=False, eos_token_id=None,
                                pad_token_id=0, attention_mask=torch.ones_like(ids))[0, ids.shape[1]:].tolist()
    assert out.token_ids[split:] == rest
    assert outs[other].token_ids == ref.greedy("c", prompt) and outs[other].lora_versions == [(0, 0, NEW)]


def test_update_from_disk_by_name(llama: TinyModel, ref: PeftRef, tmp_path) -> None:
    engine = _engine(llama, ref)
    trainer = copy.deepcopy(ref.model)
    trainer.set_adapter("c")
    randomize_adapter(trainer, "c", seed=779)
    assert engine.update_weights_from_disk(save_adapter(trainer, "c", tmp_path), lora_name="c") == 1
    prompt = make_prompts(llama.vocab_size, [7], seed=45)[0]
    out = engine.generate(input_ids=[prompt], sampling_params=GREEDY, lora_name="c")[0]
    trainer.eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        want = trainer.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0,
                                attention_mask=torch.ones_like(ids))[0, len(prompt):].tolist()
    assert out.token_ids == want


def test_unload_in_use_is_refused_then_works(llama: TinyModel, ref: PeftRef) -> None:
    engine = _engine(llama, ref)
    prompt = make_prompts(llama.vocab_size, [6], seed=46)[0]
    rid = engine.add_request(prompt, GREEDY, lora_name="a")[0]
    engine.step()
    with pytest.raises(ValueError, match="adapter 'a' is used by 1 request"):
        engine.unload_lora_adapter("a")
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    assert outs[rid].token_ids == ref.greedy("a", prompt)
    engine.unload_lora_adapter("a")
    assert [i.name for i in engine.list_lora_adapters()] == ["b", "c"]
    with pytest.raises(ValueError, match="lora_name='a' is not loaded"):
        engine.generate(input_ids=[prompt], sampling_params=GREEDY, lora_name="a")
    engine.load_lora_adapter("a", ref.dirs["a"])  # loads again, fresh
    assert engine.generate(input_ids=[prompt], sampling_params=GREEDY, lora_name="a")[0].token_ids == ref.greedy("a", prompt)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        ("rank", ValueError, "r=8.*max_lora_rank|rank"),
        ("twice", ValueError, "lora_name='b': an adapter of that name is loaded"),
        ("unknown_generate", ValueError, "lora_name='zzz' is not loaded"),
        ("bad_type", TypeError, "lora_name=3"),
        ("list_len", ValueError, "lora_name has 1 entries for 2 prompts"),
        ("both", ValueError, "not both"),
        ("no_config", ValueError, "needs config="),
        ("update_unknown", ValueError, "lora_name='zzz' is not loaded"),
        ("update_shape", ValueError, "shape"),
        ("update_nan", ValueError, "non-finite|NaN"),
        ("max_loaded", ValueError, "max_loaded_loras=3"),
        ("target_outside", ValueError, "outside the engine's lora_target_modules"),
    ],
)
def test_refusals_name_the_field_and_the_engine_keeps_serving(llama: TinyModel, ref: PeftRef, call, error, message) -> None:
    engine = _engine(llama, ref, max_loaded_loras=3, lora_target_modules=tuple(ADAPTERS["a"]["target_modules"]))
    prompt = make_prompts(llama.vocab_size, [6], seed=47)[0]
    accepted = engine.add_request(prompt, GREEDY, lora_name="b")[0]
    engine.step()
    b_tensors = dict(_adapter_tensors(ref, "b"))
    calls = {
        "rank": lambda: Engine.load_lora_adapter(_small_rank_engine(llama), "a", ref.dirs["a"]),
        "twice": lambda: engine.load_lora_adapter("b", ref.dirs["b"]),
        "unknown_generate": lambda: engine.generate(input_ids=[prompt], sampling_params=GREEDY, lora_name="zzz"),
        "bad_type": lambda: engine.generate(input_ids=[prompt], sampling_params=GREEDY, lora_name=3),
        "list_len": lambda: engine.generate(input_ids=[prompt, prompt], sampling_params=GREEDY, lora_name=["a"]),
        "both": lambda: engine.load_lora_adapter("d", ref.dirs["a"], tensors=b_tensors, config={}),
        "no_config": lambda: engine.load_lora_adapter("d", tensors=b_tensors),
        "update_unknown": lambda: engine.update_lora_adapter("zzz", b_tensors.items()),
        "update_shape": lambda: engine.update_lora_adapter("b", [(n, t[:1]) for n, t in b_tensors.items()]),
        "update_nan": lambda: engine.update_lora_adapter("b", [(n, t * float("nan")) for n, t in b_tensors.items()]),
        "max_loaded": lambda: engine.load_lora_adapter("d", tensors=b_tensors, config=dict(ADAPTERS["b"], peft_type="LORA")),
        "target_outside": lambda: _engine_q_only(llama).load_lora_adapter("a", ref.dirs["a"]),
    }
    with pytest.raises(error, match=message):
        calls[call]()
    assert [i.version for i in engine.list_lora_adapters()] == [0, 0, 0], "a refused update changed a version"
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    assert outs[accepted].token_ids == ref.greedy("b", prompt)
    assert engine.generate(input_ids=[prompt], sampling_params=GREEDY, lora_name="c")[0].token_ids == ref.greedy("c", prompt)


def _adapter_tensors(ref: PeftRef, name: str):
    ref.model.set_adapter(name)
    return list(iter_hf_weights(ref.model, adapter_only=True))


def _small_rank_engine(llama: TinyModel) -> Engine:
    return Engine(EngineConfig(model=llama.path, enable_lora=True, max_lora_rank=4))


def _engine_q_only(llama: TinyModel) -> Engine:
    return Engine(EngineConfig(model=llama.path, enable_lora=True, max_lora_rank=16, lora_target_modules=("q_proj",)))


def test_lora_off_is_refused_clearly(llama: TinyModel, ref: PeftRef) -> None:
    engine = Engine(EngineConfig(model=llama.path))
    with pytest.raises(ValueError, match="enable_lora=True"):
        engine.load_lora_adapter("a", ref.dirs["a"])
    with pytest.raises(ValueError, match="LoRA is off"):
        engine.generate(input_ids=[[1, 2]], sampling_params=GREEDY, lora_name="a")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real CUDA graphs and the Triton SGMV kernels need a GPU")
@pytest.mark.parametrize("overlap,max_bs", [(False, 8), (True, 8), (True, 128)])
def test_gpu_graphs_replay_any_adapter_mix(llama: TinyModel, ref: PeftRef, overlap: bool, max_bs: int) -> None:
    """On the GPU (Triton SGMV inside captured decode graphs, overlap on and off): tokens
    equal peft's (fp32) for a mixed batch, and equal the same engine run eagerly. Graphs to
    128 rows take the 65-token prefill too, as decode rows (runner.extend_rows_kv)."""
    prompts = make_prompts(llama.vocab_size, [5, 9, 3, 12, 7, 5, 20, 4], seed=48)
    common = dict(device="cuda", max_total_tokens=4096, overlap_schedule=overlap, attention="triton")
    graphed = _engine(llama, ref, cuda_graph_max_bs=max_bs, **common)
    eager = _engine(llama, ref, cuda_graph=False, **common)
    rows: list[int] = []
    inner = graphed.runner._prepare_rows
    graphed.runner._prepare_rows = lambda batch: rows.append(1) or inner(batch)  # type: ignore[method-assign]
    a = graphed.generate(input_ids=prompts, sampling_params=GREEDY, lora_name=MIX)
    b = eager.generate(input_ids=prompts, sampling_params=GREEDY, lora_name=MIX)
    assert graphed.runner.graphs is not None and graphed.runner.graphs.num_replays > 0
    assert bool(rows) == (max_bs == 128)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for out, prompt, adapter in zip(a, prompts, MIX):
        assert out.token_ids == ref.greedy(adapter, prompt), f"adapter {adapter}"
        want = ref.logprobs(adapter, prompt, out.token_ids)
        assert torch.allclose(torch.tensor(out.logprobs), want, atol=2e-3), adapter


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU twin; on CUDA test_gpu_graphs_replay_any_adapter_mix covers it")
def test_graph_twin_replays_the_lora_graph_only_for_adapter_batches(llama: TinyModel, ref: PeftRef) -> None:
    """The decode-graph replay logic with LoRA on CPU (graph_twin): a base-only batch replays
    the plain graph, a batch with adapters the one with the LoRA ops; tokens equal peft's."""
    pytest.importorskip("triton")
    from graph_twin import EagerDecodeGraphs

    engine = _engine(llama, ref, attention="triton")
    engine.runner.graphs = EagerDecodeGraphs(engine.model, engine.runner.backend, max_bs=4, max_context=64,
                                             device=engine.device, lora=engine.lora.pool)
    engine.runner.graphs.capture()
    graphs = engine.runner.graphs
    prompts = make_prompts(llama.vocab_size, [5, 9, 3, 7], seed=49)
    base = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert graphs.num_replays > 0 and graphs.num_lora_replays == 0
    names = ["a", None, "c", "b"]
    mixed = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_name=names)
    assert graphs.num_lora_replays > 0
    for out, prompt in zip(base, prompts):
        assert out.token_ids == ref.greedy(None, prompt)
    for out, prompt, adapter in zip(mixed, prompts, names):
        assert out.token_ids == ref.greedy(adapter, prompt), adapter
