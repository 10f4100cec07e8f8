"""The engine's API: bad input raises a named error and the engine keeps serving;
streaming add_request/step, abort, stop conditions, stats."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from conftest import TinyModel, make_prompts
from rollout import Engine, EngineConfig, SamplingParams

GREEDY = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(llama: TinyModel) -> Engine:
    return Engine(EngineConfig(model=llama.path, max_total_tokens=400))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=-2), "top_k"),
        (dict(n=0), "n="),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(min_p=1.5), "min_p"),
        (dict(logprobs_mode="both"), "logprobs_mode"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], GREEDY, "empty prompt"),
        ([1, 2, 10_000], GREEDY, "token id 10000 is outside the vocabulary"),
        ([-1], GREEDY, "token id -1 is outside"),
        ([1] * 500, SamplingParams(max_new_tokens=100), "exceeds the model's context length 512"),
        ([1] * 300, SamplingParams(max_new_tokens=150), "exceeds the whole KV budget"),
    ],
)
def test_bad_requests_raise_and_the_engine_keeps_serving(engine: Engine, llama: TinyModel, prompt, params, message) -> None:
    good = make_prompts(llama.vocab_size, [5], seed=9)[0]
    rid = engine.add_request(good, GREEDY)[0]  # accepted before the bad one arrives
    with pytest.raises(ValueError, match=message):
        engine.generate(input_ids=[good, prompt], sampling_params=params)
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    assert outs[rid].token_ids == llama.greedy(good, 6)
    assert engine.generate(input_ids=[good], sampling_params=GREEDY)[0].token_ids == llama.greedy(good, 6)


def test_unknown_architecture(llama: TinyModel, tmp_path: Path) -> None:
    shutil.copytree(llama.path, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture.*FalconForCausalLM"):
        Engine(EngineConfig(model=str(tmp_path / "m")))


def test_missing_weight_files_and_tensors(llama: TinyModel, tmp_path: Path) -> None:
    (tmp_path / "nofiles").mkdir()
    shutil.copy(Path(llama.path) / "config.json", tmp_path / "nofiles")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        Engine(EngineConfig(model=str(tmp_path / "nofiles")))
    with pytest.raises(FileNotFoundError, match="config not found"):
        Engine(EngineConfig(model=str(tmp_path / "does-not-exist")))
    shutil.copytree(llama.path, tmp_path / "partial")
    weights = load_file(tmp_path / "partial" / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "partial" / "model.safetensors")
    with pytest.raises(ValueError, match="missing tensors.*layers.1.mlp.up_proj"):
        Engine(EngineConfig(model=str(tmp_path / "partial")))


def test_sharded_checkpoint_with_index(llama: TinyModel, tmp_path: Path) -> None:
    llama.hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    prompt = make_prompts(llama.vocab_size, [7], seed=3)[0]
    out = Engine(EngineConfig(model=str(tmp_path))).generate(input_ids=[prompt], sampling_params=GREEDY)[0]
    assert out.token_ids == llama.greedy(prompt, 6)


def test_streaming_step_api_and_abort(engine: Engine, llama: TinyModel) -> None:
    prompts = make_prompts(llama.vocab_size, [4, 8], seed=10)
    keep = engine.add_request(prompts[0], SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True), request_id="keep")
    drop = engine.add_request(prompts[1], SamplingParams(temperature=0, max_new_tokens=50, ignore_eos=True), request_id="drop")
    assert (keep, drop) == (["keep"], ["drop"])
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(prompts[0], GREEDY, request_id="keep")
    for _ in range(3):
        engine.step()
    stats = engine.stats()
    assert stats.num_running == 2 and stats.kv_used_tokens > 0
    aborted = engine.abort("drop")
    assert aborted is not None and aborted.finish_reason == "abort" and len(aborted.token_ids) == 3
    assert engine.abort("drop") is None
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.request_id for o in outs] == ["keep"] and outs[0].token_ids == llama.greedy(prompts[0], 8)
    assert engine.stats().tokens_per_second > 0


def test_stop_token_and_eos(engine: Engine, llama: TinyModel) -> None:
    prompt = make_prompts(llama.vocab_size, [6], seed=11)[0]
    ref = llama.greedy(prompt, 8)
    out = engine.generate(input_ids=[prompt], sampling_params=SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=[ref[3]]))[0]
    assert out.finish_reason == "stop" and out.token_ids == ref[: ref.index(ref[3]) + 1]
    engine.eos_token_ids.add(ref[2])
    try:
        stopped = engine.generate(input_ids=[prompt], sampling_params=SamplingParams(temperature=0, max_new_tokens=8))[0]
        ignored = engine.generate(input_ids=[prompt], sampling_params=SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))[0]
    finally:
        engine.eos_token_ids.discard(ref[2])
    assert stopped.token_ids == ref[: ref.index(ref[2]) + 1] and stopped.finish_reason == "stop"
    assert ignored.token_ids == ref and ignored.finish_reason == "length"


def test_outputs_carry_the_weight_version(engine: Engine, llama: TinyModel) -> None:
    out = engine.generate(input_ids=[[1, 2, 3]], sampling_params=GREEDY)[0]
    assert out.weight_version == engine.weight_version == 0
    assert out.weight_versions == [(0, 0, 6)]


def test_config_without_architectures_falls_back_to_model_type(llama: TinyModel, tmp_path: Path) -> None:
    """Configs written from GGUF files (and some older exports) carry model_type only."""
    shutil.copytree(llama.path, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    del cfg["architectures"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    prompt = make_prompts(llama.vocab_size, [6], seed=5)[0]
    out = Engine(EngineConfig(model=str(tmp_path / "m"))).generate(input_ids=[prompt], sampling_params=GREEDY)[0]
    assert out.token_ids == llama.greedy(prompt, 6)
    cfg["model_type"] = "falcon"
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="no `architectures` and model_type 'falcon' is not supported"):
        Engine(EngineConfig(model=str(tmp_path / "m")))
