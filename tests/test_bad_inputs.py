"""Bad input at every public entry point: refused at the boundary with the field named (and
the prompt index where there is one), and the engine keeps serving afterwards, with the
requests it had already accepted intact."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import TinyModel, make_prompts
from rollout import Engine, EngineConfig, SamplingParams

GREEDY = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(llama: TinyModel) -> Engine:
    return Engine(EngineConfig(model=llama.path, max_total_tokens=400))


def _still_serves(engine: Engine, llama: TinyModel, accepted: str | None = None, prompt: list[int] | None = None) -> None:
    """The request accepted before the bad call finishes correctly, and a new one runs."""
    good = make_prompts(llama.vocab_size, [5], seed=31)[0]
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    if accepted is not None:
        assert outs[accepted].token_ids == llama.greedy(prompt, 4), "an accepted request was lost or changed"
    assert engine.generate(input_ids=[good], sampling_params=GREEDY)[0].token_ids == llama.greedy(good, 4)
    assert not engine.has_unfinished() and engine.kv.used_slots() == 0


@pytest.mark.parametrize(
    ("kwargs", "error", "field"),
    [
        (dict(temperature=math.nan), ValueError, "temperature=nan: must be finite"),
        (dict(temperature=math.inf), ValueError, "temperature=inf: must be finite"),
        (dict(top_p=math.nan), ValueError, "top_p=nan"),
        (dict(min_p=-math.inf), ValueError, "min_p=-inf"),
        (dict(temperature="0.5"), TypeError, "temperature='0.5': expected a number"),
        (dict(top_k=2.5), TypeError, "top_k=2.5: expected an int"),
        (dict(max_new_tokens="8"), TypeError, "max_new_tokens='8'"),
        (dict(n=True), TypeError, "n=True: expected an int"),
        (dict(seed=1.5), TypeError, "seed=1.5"),
        (dict(stop_token_ids=[1, "2"]), TypeError, r"stop_token_ids\[1\]"),
        (dict(stop_token_ids=[1.0]), TypeError, r"stop_token_ids\[0\]=1.0"),
        (dict(stop_token_ids=[-3]), ValueError, r"stop_token_ids\[0\]=-3: must be >= 0"),
        (dict(stop_token_ids=7), TypeError, "stop_token_ids=7: expected a list"),
        (dict(stop=["ok", 3]), TypeError, r"stop\[1\]"),
        (dict(stop=[""]), ValueError, r"stop\[0\]: must be a non-empty"),
        (dict(ignore_eos="yes"), TypeError, "ignore_eos='yes'"),
        (dict(top_logprobs=-1), ValueError, "top_logprobs=-1"),
        (dict(top_logprobs=2.0), TypeError, "top_logprobs=2.0"),
    ],
)
def test_sampling_params_refuse_with_the_field_named(kwargs: dict, error: type, field: str) -> None:
    with pytest.raises(error, match=f"SamplingParams.{field}"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (dict(input_ids=[[1, 2.5]]), TypeError, r"prompt 0: token 1 is 2.5 \(float\); token ids must be ints"),
        (dict(input_ids=[[1, 2], [3, "4"]]), TypeError, "prompt 1: token 1 is '4' \\(str\\)"),
        (dict(input_ids=[[1, True]]), TypeError, "prompt 0: token 1 is True"),
        (dict(input_ids=[1, 2, 3]), TypeError, "flat list of ints"),
        (dict(input_ids=[[[1, 2]]]), TypeError, "prompt 0: token 0 is a list"),
        (dict(input_ids="1 2 3"), TypeError, "input_ids: expected a list of prompts"),
        (dict(input_ids=7), TypeError, "input_ids: expected a list of prompts"),
        (dict(input_ids=torch.ones(2, 2, 2, dtype=torch.long)), ValueError, "input_ids: a tensor must be 2-D"),
        (dict(input_ids=[torch.tensor([1.0, 2.0])]), TypeError, "prompt 0: token ids must be integers"),
        (dict(prompts="hello"), TypeError, "prompts: expected a list of strings"),
        (dict(prompts=[b"hello"]), TypeError, r"prompts\[0\]"),
        (dict(input_ids=[[1, 2]], sampling_params=SamplingParams(stop_token_ids=[10_000])), ValueError,
         "prompt 0: SamplingParams.stop_token_ids has 10000, outside the vocabulary"),
        (dict(input_ids=[[1, 2]], sampling_params=SamplingParams(top_logprobs=10**6)), ValueError,
         "prompt 0: SamplingParams.top_logprobs=1000000 exceeds the vocabulary size 160"),
        (dict(input_ids=[[1, 2]], sampling_params=[GREEDY, GREEDY]), ValueError, "sampling_params has 2 entries for 1"),
        (dict(input_ids=[[1, 2]], sampling_params={"temperature": 0}), TypeError, "sampling_params must be a SamplingParams"),
        (dict(input_ids=[[1, 2]], namespace=3), TypeError, "namespace=3"),
    ],
)
def test_generate_refuses_and_keeps_serving(engine: Engine, llama: TinyModel, call: dict, error: type, message: str) -> None:
    prompt = make_prompts(llama.vocab_size, [6], seed=30)[0]
    rid = engine.add_request(prompt, GREEDY)[0]  # accepted before the bad call
    with pytest.raises(error, match=message):
        engine.generate(**call)
    _still_serves(engine, llama, rid, prompt)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "message"),
    [
        (([[1, 2]],), {}, TypeError, "prompt 0: token 0 is a list"),
        (([1, 2],), dict(request_id=5), TypeError, "request_id=5: expected a str"),
        (([1, 2],), dict(request_id=""), ValueError, "request_id: must be a non-empty"),
        (([1, 2],), dict(prompt_index=-1), ValueError, "prompt_index=-1: must be >= 0"),
        (([1, 2],), dict(prompt_index="0"), TypeError, "prompt_index='0'"),
        (([1, 2], "greedy"), {}, TypeError, "sampling_params must be a SamplingParams"),
        (([1, 2.0],), {}, TypeError, r"prompt 0: token 1 is 2.0"),
    ],
)
def test_add_request_refuses_and_keeps_serving(engine: Engine, llama: TinyModel, args, kwargs, error, message) -> None:
    prompt = make_prompts(llama.vocab_size, [6], seed=32)[0]
    rid = engine.add_request(prompt, GREEDY)[0]
    with pytest.raises(error, match=message):
        engine.add_request(*args, **kwargs)
    _still_serves(engine, llama, rid, prompt)


@pytest.mark.parametrize(
    ("kind", "error", "message"),
    [
        ("dict", TypeError, "expected an iterable of \\(name, tensor\\) pairs; for a dict pass .items"),
        ("module", TypeError, "got a module"),
        ("not_pairs", TypeError, r"named_tensors\[1\]: expected a \(name: str, tensor\) pair"),
        ("pause_mode", ValueError, "pause_mode='later'"),
        ("full", TypeError, "full='yes'"),
        ("nan", ValueError, "non-finite"),
        ("shape", ValueError, "shape \\(3,\\) does not match"),
    ],
)
def test_update_weights_refuses_and_keeps_serving(engine: Engine, llama: TinyModel, kind: str, error, message) -> None:
    prompt = make_prompts(llama.vocab_size, [6], seed=33)[0]
    rid = engine.add_request(prompt, GREEDY)[0]
    engine.step()  # running, with KV, when the bad update arrives
    weight = llama.hf.model.norm.weight.detach()
    calls = {
        "dict": lambda: engine.update_weights({"model.norm.weight": weight}),
        "module": lambda: engine.update_weights(llama.hf),
        "not_pairs": lambda: engine.update_weights([("model.norm.weight", weight), weight]),
        "pause_mode": lambda: engine.update_weights([("model.norm.weight", weight)], pause_mode="later"),
        "full": lambda: engine.update_weights([("model.norm.weight", weight)], full="yes"),
        "nan": lambda: engine.update_weights([("model.norm.weight", weight * math.nan)]),
        "shape": lambda: engine.update_weights([("model.norm.weight", weight[:3])]),
    }
    with pytest.raises(error, match=message):
        calls[kind]()
    assert engine.weight_version == 0
    _still_serves(engine, llama, rid, prompt)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(master_addr=""), ValueError, "master_addr: must be a non-empty"),
        (dict(master_port=70000), ValueError, "master_port=70000: must be <= 65535"),
        (dict(master_port="29500"), TypeError, "master_port='29500'"),
        (dict(world_size=1), ValueError, "world_size=1: must be >= 2"),
        (dict(rank_offset=0), ValueError, "rank_offset=0: must be >= 1"),
        (dict(rank_offset=2), ValueError, "rank_offset=2: must be <= 1"),
        (dict(backend="mpi"), ValueError, "backend='mpi'"),
        (dict(backend="nccl"), ValueError, "backend='nccl' needs a CUDA engine"),
        (dict(timeout_s=math.nan), ValueError, "timeout_s=nan: must be finite"),
        (dict(timeout_s=0), ValueError, "timeout_s=0: must be > 0"),
    ],
)
def test_init_weight_sync_group_refuses_before_connecting(engine: Engine, llama: TinyModel, kwargs, error, message) -> None:
    args = dict(master_addr="127.0.0.1", master_port=29999, rank_offset=1, world_size=2, backend="gloo")
    args.update(kwargs)
    with pytest.raises(error, match=message):
        engine.init_weight_sync_group(**args)
    assert engine.weights.group is None
    _still_serves(engine, llama)


def test_weight_update_sources_refuse_bad_paths(engine: Engine, llama: TinyModel, tmp_path) -> None:
    with pytest.raises(ValueError, match="update_weights_from_disk: path=.* is not a directory"):
        engine.update_weights_from_disk(tmp_path / "missing")
    with pytest.raises(TypeError, match="endpoint=5: expected a str"):
        engine.update_weights_from_ipc(5)
    with pytest.raises(RuntimeError, match="no weight-sync group"):
        engine.update_weights_from_distributed()
    _still_serves(engine, llama)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(gpu_memory_fraction=math.nan), ValueError, "gpu_memory_fraction=nan: must be finite"),
        (dict(page_size=16.0), TypeError, "page_size=16.0: expected an int"),
        (dict(max_total_tokens=0), ValueError, "max_total_tokens=0: must be >= 1"),
        (dict(device="gpu"), ValueError, "device='gpu'"),
        (dict(device=0), TypeError, "device=0"),
        (dict(cuda_graph="no"), TypeError, "cuda_graph='no'"),
        (dict(overlap_schedule=1), TypeError, "overlap_schedule=1"),
        (dict(cuda_graph_max_bs=0), ValueError, "cuda_graph_max_bs=0"),
        (dict(model=""), ValueError, "model=''"),
    ],
)
def test_engine_config_refuses_with_the_field_named(llama: TinyModel, kwargs, error, message) -> None:
    args = dict(model=llama.path)
    args.update(kwargs)
    with pytest.raises(error, match=f"EngineConfig.{message}"):
        EngineConfig(**args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_device_without_cuda_names_the_device_and_the_build(llama: TinyModel) -> None:
    with pytest.raises(ValueError, match=r"EngineConfig.device='cuda': torch .* sees no CUDA device"):
        Engine(EngineConfig(model=llama.path, device="cuda"))
    with pytest.raises(TypeError, match="expected an EngineConfig"):
        Engine({"model": llama.path})


def test_token_ids_take_plain_ints_fast_and_other_integers_converted() -> None:
    """rollout.validate.token_ids: a list of plain ints comes back as a copy (the fast scan);
    numpy and torch integer scalars in a list still pass, as Python ints; a bool among plain
    ints still fails the exact-type scan and is refused."""
    import numpy as np

    from rollout.validate import token_ids

    plain = [3, 1, 4]
    out = token_ids(plain, "p")
    assert out == plain and out is not plain
    mixed = token_ids([np.int64(5), torch.tensor(6), 7], "p")
    assert mixed == [5, 6, 7] and all(type(t) is int for t in mixed)
    with pytest.raises(TypeError, match="token 2 is True"):
        token_ids([1, 2, True], "p")
