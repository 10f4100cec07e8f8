"""Tensor parallelism on CPU with gloo: TPEngine spawns its TP ranks as processes (this test
process is TP rank 0), and every rank runs the same scheduler on its shard.

Reference: transformers in float32 (and the TP=1 engine). Greedy tokens must be equal.
Raw log-probs: within 1e-4 of transformers, as the TP=1 engine is held to (different
kernels); within 1e-5 of TP=1: the all-reduce sums per-rank partial matmuls, a different
float32 summation order, which moves log-probs by ~1e-6, not more.
"""

from __future__ import annotations

import copy
import dataclasses
import threading

import pytest
import torch

from conftest import TinyModel, make_prompts
from rollout import Engine, EngineConfig, SamplingParams
from rollout.distributed.ports import free_port
from rollout.distributed.tp_engine import TPEngine

NEW = 8
GREEDY = SamplingParams(temperature=0, max_new_tokens=NEW, logprobs_mode="raw", ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=NEW, n=2, seed=5, logprobs_mode="raw", ignore_eos=True)


# small pages and prefill chunks: longer prompts take several steps, some with no row that samples
LAYOUT = dict(page_size=4, max_prefill_tokens=8)


def tp_config(path: str, size: int = 2) -> EngineConfig:
    # one torch thread per rank: 2 ranks share the CI machine's 2 cores
    return EngineConfig(model=path, tensor_parallel_size=size, num_threads=1, **LAYOUT)


def hf_greedy_and_logprobs(hf, prompt: list[int], completion: list[int]) -> tuple[list[int], torch.Tensor]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        logits = hf(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
    return out[0, len(prompt):].tolist(), lp


def check_against(hf, prompts: list[list[int]], outs) -> None:
    for prompt, out in zip(prompts, outs):
        tokens, lp = hf_greedy_and_logprobs(hf, prompt, out.token_ids)
        assert out.token_ids == tokens
        torch.testing.assert_close(torch.tensor(out.logprobs), lp, atol=1e-4, rtol=0)


def test_tp2_equals_tp1_and_transformers(tiny_model: TinyModel) -> None:
    """Every tiny architecture (GQA, MHA + llama3 rope, qkv bias + tied vocab, q/k norm)."""
    prompts = make_prompts(tiny_model.vocab_size, [5, 11, 3, 8], seed=3)
    one = Engine(EngineConfig(model=tiny_model.path, **LAYOUT))
    want_greedy = one.generate(input_ids=prompts, sampling_params=GREEDY)
    want_sampled = one.generate(input_ids=prompts, sampling_params=SAMPLED)
    with TPEngine(tp_config(tiny_model.path)) as engine:
        greedy = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        sampled = engine.generate(input_ids=prompts, sampling_params=SAMPLED)  # forked prompts, prefix cache
    check_against(tiny_model.hf, prompts, greedy)
    for got, want in zip(greedy + sampled, want_greedy + want_sampled):
        assert got.token_ids == want.token_ids  # sampling too: every rank draws from the same gathered logits
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0)
    assert any(a.token_ids != b.token_ids for a, b in zip(sampled[::2], sampled[1::2]))


@pytest.mark.parametrize("drafter", ["ngram", "draft"])
def test_speculative_decoding_with_tp2(llama: TinyModel, drafter: str) -> None:
    """Drafters are deterministic (a draft model is replicated on every rank), so every rank
    verifies the same drafts; with the governor off the output is plain decoding's."""
    prompts = [p * 3 for p in make_prompts(llama.vocab_size, [5, 4], seed=4)]  # repeats: n-gram drafts
    spec = dict(speculative=drafter, speculative_governor=False, draft_model=llama.path if drafter == "draft" else None)
    want = Engine(EngineConfig(model=llama.path, **LAYOUT, **spec)).generate(input_ids=prompts, sampling_params=SAMPLED)
    with TPEngine(dataclasses.replace(tp_config(llama.path), **spec)) as engine:
        greedy = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        sampled = engine.generate(input_ids=prompts, sampling_params=SAMPLED)
        assert engine.stats().counters["verify_steps"] > 0
    check_against(llama.hf, prompts, greedy)
    assert [o.token_ids for o in sampled] == [o.token_ids for o in want]


def test_multi_lora_with_tp2(llama: TinyModel, tmp_path_factory) -> None:
    """Three adapters and the base model in one batch, each rank holding its part of every
    slot (B's rows of qkv / gate_up, A's columns of o_proj / down_proj), against peft; then a
    LoRA-only update reaches every rank's part."""
    pytest.importorskip("peft")
    from peft_ref import PeftRef, randomize_adapter
    from weightsync import iter_hf_weights

    ref = PeftRef(llama, tmp_path_factory.mktemp("tp_adapters"))
    prompts = make_prompts(llama.vocab_size, [6, 3, 9, 5], seed=21)
    adapters = ["a", None, "b", "c"]
    config = dataclasses.replace(tp_config(llama.path), enable_lora=True, max_loras_per_batch=2, max_lora_rank=8)
    with TPEngine(config) as engine:  # 2 slots for 3 adapters: one is swapped out and back in
        for name, path in ref.dirs.items():
            engine.call("load_lora_adapter", name=name, path=path)
        assert sorted(info.name for info in engine.call("list_lora_adapters")) == sorted(ref.dirs)
        outs = engine.generate(input_ids=prompts + prompts, sampling_params=GREEDY, lora_name=adapters + adapters[::-1])
        for prompt, adapter, out in zip(prompts + prompts, adapters + adapters[::-1], outs):
            assert out.token_ids == ref.greedy(adapter, prompt)
            torch.testing.assert_close(torch.tensor(out.logprobs), ref.logprobs(adapter, prompt, out.token_ids),
                                       atol=1e-4, rtol=0)
        trainer = copy.deepcopy(ref.model)
        trainer.set_adapter("a")
        randomize_adapter(trainer, "a", seed=901)
        assert engine.update_lora_adapter("a", iter_hf_weights(trainer, adapter_only=True)) == 1
        out = engine.generate(input_ids=prompts[:1], sampling_params=GREEDY, lora_name="a")[0]
    trainer.eval()
    with torch.no_grad():
        want = trainer.generate(input_ids=torch.tensor([prompts[0]]), max_new_tokens=len(out.token_ids), do_sample=False,
                                eos_token_id=None, pad_token_id=0, attention_mask=torch.ones(1, len(prompts[0]), dtype=torch.long))
    assert out.token_ids == want[0, len(prompts[0]):].tolist()


@pytest.fixture(scope="module")
def updated_hf(llama: TinyModel):
    """The tiny Llama after a fake optimizer step: every weight moved."""
    hf = copy.deepcopy(llama.hf)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3 * p.std())
    return hf


def _with_nan(hf, name: str, column: int) -> list[tuple[str, torch.Tensor]]:
    pairs = [(n, p.detach().clone()) for n, p in hf.named_parameters()]
    dict(pairs)[name][:, column] = float("nan")
    return pairs


@pytest.fixture(scope="module")
def tp2(llama: TinyModel):
    """One TP=2 engine of the tiny Llama for the weight-sync tests (starting its rank is most of
    a test's time). A test leaves it with the tiny Llama's weights, at a later weight version."""
    with TPEngine(tp_config(llama.path)) as engine:
        yield engine


def test_weight_sync_into_tp2_is_atomic_across_ranks(llama: TinyModel, updated_hf, tp2: TPEngine) -> None:
    prompts = make_prompts(llama.vocab_size, [6, 9], seed=11)
    engine = tp2
    v0 = engine.stats().weight_version
    with pytest.raises(TypeError, match=r"prompt 1: token 1 is 4.5 \(float\); token ids must be ints"):  # refused before any rank sees it
        engine.generate(input_ids=[[1, 2], [3, 4.5]])
    check_against(llama.hf, prompts, engine.generate(input_ids=prompts, sampling_params=GREEDY))
    # HF-named full tensors in; each rank keeps its shard; the version bumps on every rank
    # (TPEngine checks every rank's version after each call)
    assert engine.update_weights(updated_hf.named_parameters(), full=True) == v0 + 1
    after = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    check_against(updated_hf, prompts, after)
    # down_proj is split by columns: column 0 is TP rank 0's, the last column TP rank 1's.
    # The rank holding the NaN fails its own validation; the other rank, whose shard is
    # fine, refuses too, and neither writes (the next outputs are unchanged).
    name = "model.layers.1.mlp.down_proj.weight"
    for column, rank in ((-1, 1), (0, 0)):
        with pytest.raises(ValueError, match=rf"refused on every TP rank: TP rank {rank} of 2 failed validation: "
                                             rf"parameter '{name}' has non-finite values"):
            engine.update_weights(_with_nan(llama.hf, name, column))
    with pytest.raises(ValueError, match=r"TP rank 0 of 2 .* shape \(3, 64\) does not match the model's \(160, 64\)"):
        engine.update_weights([("lm_head.weight", torch.zeros(3, 64))])
    assert engine.stats().weight_version == v0 + 1
    assert [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)] == \
        [o.token_ids for o in after]
    # sleep/wake composes: every rank drops its shard (level 2), the full sync refills them
    engine.call("sleep", level=2)
    engine.call("wake", tags=["weights"])
    assert engine.update_weights(llama.hf.named_parameters(), full=True) == v0 + 2
    engine.call("wake", tags=["kv_cache"])
    check_against(llama.hf, prompts, engine.generate(input_ids=prompts, sampling_params=GREEDY))


def test_broadcast_from_a_trainer_into_tp2(llama: TinyModel, updated_hf, tp2: TPEngine) -> None:
    """The trainer's BroadcastSender (the NCCL path's code, here over gloo) into both TP ranks:
    each rank joins the weight-sync group (rank_offset + TP rank) and keeps its shard."""
    from weightsync import iter_hf_weights
    from weightsync.transports.broadcast import BroadcastSender
    from weightsync.transports.group import close_group, open_group

    port, errors = free_port(), []

    def trainer() -> None:
        try:
            group = open_group("127.0.0.1", port, 0, 3, backend="gloo", timeout_s=60)
            BroadcastSender(group, bucket_bytes=16 * 1024).send(iter_hf_weights(updated_hf))
            close_group(group)
        except Exception as error:  # surfaced by the assertion below
            errors.append(error)

    prompts = make_prompts(llama.vocab_size, [7], seed=12)
    engine = tp2
    v0 = engine.stats().weight_version
    thread = threading.Thread(target=trainer)
    thread.start()
    engine.call("init_weight_sync_group", master_addr="127.0.0.1", master_port=port, rank_offset=1, world_size=3)
    assert engine.call("update_weights_from_distributed", full=True) == v0 + 1
    engine.call("destroy_weight_sync_group")
    thread.join(timeout=60)
    assert not errors
    check_against(updated_hf, prompts, engine.generate(input_ids=prompts, sampling_params=GREEDY))
    engine.update_weights(llama.hf.named_parameters(), full=True)  # the base weights back, for the module's next test
