"""Live weight sync into the real engine: a trainer takes an optimizer step, syncs (in
process, or over a gloo broadcast from another process, or from a safetensors dir), and
the engine's greedy output equals transformers run with the trainer's new weights. Bad
updates are refused whole; the pause modes do what they say; nothing in flight is lost."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from conftest import TinyModel, make_prompts
from rollout import Engine, EngineConfig, SamplingParams
from rollout.distributed.ports import free_port
from weightsync.trainer import iter_hf_weights
from weightsync.transports.disk import save_safetensors_dir

GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)


def train_step(model: torch.nn.Module, seed: int = 0) -> None:
    """One real optimizer step on random tokens, big enough to change greedy outputs."""
    torch.manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=5.0)
    ids = torch.randint(0, model.config.vocab_size, (4, 16))
    model.train()
    loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    model.eval()


@pytest.fixture
def trainer(llama: TinyModel):
    return copy.deepcopy(llama.hf)


def hf_greedy(model, prompt: list[int], n: int = 8) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def test_in_process_sync_after_an_optimizer_step(llama: TinyModel, trainer) -> None:
    prompts = make_prompts(llama.vocab_size, [5, 11], seed=20)
    engine = Engine(EngineConfig(model=llama.path))
    before = [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)]
    train_step(trainer)
    assert engine.update_weights(iter_hf_weights(trainer), full=True) == 1
    after = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    expected = [hf_greedy(trainer, p) for p in prompts]
    assert [o.token_ids for o in after] == expected
    assert expected != before, "the optimizer step should change greedy outputs"
    assert all(o.weight_version == 1 and o.weight_versions == [(1, 0, 8)] for o in after)
    assert after[0].num_cached_tokens == 0, "the prefix cache must be flushed on update"


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda ws: [(n, t[:-1] if n.endswith("q_proj.weight") else t) for n, t in ws], "q_proj.weight.*shape"),
        (lambda ws: [(n, t.clone().fill_(float("nan")) if "layers.1.mlp.down" in n else t) for n, t in ws], "down_proj.*non-finite"),
        (lambda ws: ws + [("model.layers.0.self_attn.r_proj.weight", torch.zeros(3))], "unknown parameter.*r_proj"),
        (lambda ws: [(n, t) for n, t in ws if "input_layernorm" not in n], "missing tensors.*input_layernorm"),
        (lambda ws: [(n, t.to(torch.int32) if n.endswith("norm.weight") else t) for n, t in ws], "not a floating-point"),
    ],
    ids=["shape", "nan", "unknown", "missing", "dtype"],
)
def test_bad_updates_are_refused_whole(llama: TinyModel, trainer, corrupt, message: str) -> None:
    prompt = make_prompts(llama.vocab_size, [7], seed=21)[0]
    engine = Engine(EngineConfig(model=llama.path))
    before = engine.generate(input_ids=[prompt], sampling_params=GREEDY)[0].token_ids
    train_step(trainer)
    weights = [(n, t.detach().clone()) for n, t in iter_hf_weights(trainer)]
    with pytest.raises(ValueError, match=message):
        engine.update_weights(corrupt(weights), full=True)
    assert engine.weight_version == 0
    assert engine.generate(input_ids=[prompt], sampling_params=GREEDY)[0].token_ids == before == llama.greedy(prompt, 8)


def _start(engine: Engine, prompts: list[list[int]], new: int, steps: int) -> list[str]:
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True))[0] for p in prompts]
    for _ in range(steps):
        engine.step()
    return ids


def _drain(engine: Engine) -> dict:
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    outs.update({o.request_id: o for o in engine.step()})  # pending outputs, if any
    return outs


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_pause_mode_retract_resumes_under_new_weights(llama: TinyModel, trainer, overlap: bool) -> None:
    prompts = make_prompts(llama.vocab_size, [4, 9, 6], seed=22)
    # with overlap scheduling the 4th token is still in flight when the update arrives:
    # it must be read back (version 0) before the pause
    engine = Engine(EngineConfig(model=llama.path, overlap_schedule=overlap))
    ids = _start(engine, prompts, new=10, steps=4)  # 4 tokens made by version 0
    train_step(trainer)
    engine.update_weights(iter_hf_weights(trainer), full=True, pause_mode="retract")
    outs = _drain(engine)
    assert set(outs) == set(ids), "no request may be lost"
    for rid, prompt in zip(ids, prompts):
        out = outs[rid]
        assert out.finish_reason == "length" and len(out.token_ids) == 10
        assert out.weight_versions == [(0, 0, 4), (1, 4, 10)]
        assert out.token_ids[:4] == llama.greedy(prompt, 4)
        # the rest continues the same sequence under the new weights
        assert out.token_ids[4:] == hf_greedy(trainer, prompt + out.token_ids[:4], 6)


def test_pause_mode_wait_finishes_under_old_weights(llama: TinyModel, trainer) -> None:
    prompts = make_prompts(llama.vocab_size, [4, 9], seed=23)
    engine = Engine(EngineConfig(model=llama.path))
    ids = _start(engine, prompts, new=6, steps=2)
    train_step(trainer)
    engine.update_weights(iter_hf_weights(trainer), full=True, pause_mode="wait")
    assert not engine.has_unfinished()
    outs = _drain(engine)
    assert [outs[i].token_ids for i in ids] == [llama.greedy(p, 6) for p in prompts]
    assert all(outs[i].weight_versions == [(0, 0, 6)] for i in ids)
    assert engine.weight_version == 1


def test_pause_mode_abort_returns_what_they_had(llama: TinyModel, trainer) -> None:
    prompts = make_prompts(llama.vocab_size, [4, 9], seed=24)
    engine = Engine(EngineConfig(model=llama.path))
    ids = _start(engine, prompts, new=6, steps=3)
    train_step(trainer)
    engine.update_weights(iter_hf_weights(trainer), full=True, pause_mode="abort")
    outs = _drain(engine)
    for rid, prompt in zip(ids, prompts):
        assert outs[rid].finish_reason == "abort"
        assert outs[rid].token_ids == llama.greedy(prompt, 3)
    alloc = engine.kv.allocator
    assert alloc.num_free_pages == alloc.num_pages - 1, "aborted requests must free their KV"


def test_sync_from_a_safetensors_dir(llama: TinyModel, trainer, tmp_path: Path) -> None:
    prompt = make_prompts(llama.vocab_size, [6], seed=25)[0]
    engine = Engine(EngineConfig(model=llama.path, page_size=16))
    train_step(trainer)
    save_safetensors_dir(iter_hf_weights(trainer), tmp_path / "step1", max_shard_bytes=30_000)
    assert engine.update_weights_from_disk(tmp_path / "step1") == 1
    assert engine.generate(input_ids=[prompt], sampling_params=GREEDY)[0].token_ids == hf_greedy(trainer, prompt)


def _trainer_process(model_path: str, port: int, out_dir: str) -> None:
    """Rank 0: load the checkpoint, take a step, save the reference, broadcast over gloo."""
    from transformers import AutoModelForCausalLM

    from weightsync.transports.broadcast import BroadcastSender
    from weightsync.transports.group import close_group, open_group

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    train_step(model, seed=3)
    model.save_pretrained(out_dir)
    group = open_group("127.0.0.1", port, 0, 2, backend="gloo", timeout_s=60)
    try:
        BroadcastSender(group, bucket_bytes=64 * 1024).send(iter_hf_weights(model))
    finally:
        close_group(group)


def test_gloo_broadcast_from_a_trainer_process_during_generation(llama: TinyModel, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    prompts = make_prompts(llama.vocab_size, [5, 12, 3], seed=26)
    engine = Engine(EngineConfig(model=llama.path))
    ids = _start(engine, prompts, new=9, steps=3)  # requests in flight while the sync happens
    port = free_port()
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_trainer_process, args=(llama.path, port, str(tmp_path / "ref")))
    proc.start()
    try:
        engine.init_weight_sync_group("127.0.0.1", port, rank_offset=1, world_size=2, backend="gloo",
                                      timeout_s=60, join_timeout_s=120)
        assert engine.update_weights_from_distributed(full=True) == 1
    finally:
        engine.destroy_weight_sync_group()
        proc.join(timeout=60)
    assert proc.exitcode == 0
    outs = _drain(engine)
    assert set(outs) == set(ids)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "ref", dtype=torch.float32).eval()
    for rid, prompt in zip(ids, prompts):
        out = outs[rid]
        assert out.weight_versions == [(0, 0, 3), (1, 3, 9)]
        assert out.token_ids[3:] == hf_greedy(reference, prompt + out.token_ids[:3], 6)
    fresh = make_prompts(llama.vocab_size, [8], seed=27)[0]
    assert engine.generate(input_ids=[fresh], sampling_params=GREEDY)[0].token_ids == hf_greedy(reference, fresh)


def test_tied_lm_head_is_accepted(tmp_path: Path) -> None:
    """A tied model: the update may carry lm_head.weight too (as an unwrapped state dict
    does); it lands on the shared embedding, and a full update without it is complete."""
    tied = TinyModel("qwen2", tmp_path / "tied")
    assert tied.hf.config.tie_word_embeddings
    engine = Engine(EngineConfig(model=tied.path))
    trainer = copy.deepcopy(tied.hf)
    train_step(trainer)
    named = [(n, p.detach().clone()) for n, p in trainer.named_parameters()]
    assert engine.update_weights(named + [("lm_head.weight", trainer.lm_head.weight.detach().clone())], full=True) == 1
    assert engine.update_weights(iter_hf_weights(trainer, skip_tied=True), full=True) == 2
    prompt = make_prompts(tied.vocab_size, [7], seed=28)[0]
    assert engine.generate(input_ids=[prompt], sampling_params=GREEDY)[0].token_ids == hf_greedy(trainer, prompt)
