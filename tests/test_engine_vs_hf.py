"""End to end: the engine's greedy tokens and log-probs against transformers (float32, CPU)
on tiny random Llama / Llama-3 / Qwen2 / Qwen3 checkpoints."""

from __future__ import annotations

import pytest
import torch

from conftest import TinyModel, make_prompts
from rollout import Engine, EngineConfig, SamplingParams

LENGTHS = [1, 3, 7, 12, 20, 33, 5, 50]
NEW = 12
_refs: dict[str, list[list[int]]] = {}


def hf_greedy(model: TinyModel) -> tuple[list[list[int]], list[list[int]]]:
    prompts = make_prompts(model.vocab_size, LENGTHS)
    if model.kind not in _refs:
        _refs[model.kind] = [model.greedy(p, NEW) for p in prompts]
    return prompts, _refs[model.kind]


def assert_all_memory_free(engine: Engine) -> None:
    engine.flush_cache()
    alloc = engine.kv.allocator
    assert alloc.num_free_pages == alloc.num_pages - 1, "KV pages leaked"
    assert engine.kv.req_table.num_free == engine.kv.req_table.max_requests, "request rows leaked"


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("radix", [True, False], ids=["radix", "noradix"])
@pytest.mark.parametrize("budget", ["roomy", "tight", "tight-overlap"])
def test_greedy_matches_transformers(tiny_model: TinyModel, page_size: int, radix: bool, budget: str) -> None:
    prompts, expected = hf_greedy(tiny_model)
    # "tight": room for only a few requests at once, so the scheduler must retract and
    # resume; also chunk prefills into 16-token pieces.
    # "tight-overlap": the same, reading each step's tokens back one step later.
    kwargs = dict(max_total_tokens=96 if page_size == 1 else 128, max_prefill_tokens=16) if budget != "roomy" else {}
    if budget == "tight-overlap":
        kwargs["overlap_schedule"] = True
    engine = Engine(EngineConfig(model=tiny_model.path, page_size=page_size, enable_radix_cache=radix, **kwargs))
    outs = engine.generate(input_ids=prompts, sampling_params=SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    assert all(o.finish_reason == "length" for o in outs)
    if budget != "roomy":
        assert engine.counters.retractions > 0, "the tight budget was meant to force retraction"
    assert_all_memory_free(engine)


def test_lpm_policy_matches_transformers(llama: TinyModel) -> None:
    prompts, expected = hf_greedy(llama)
    shared = prompts + [p + [1, 2] for p in prompts]  # prefixes that lpm should reorder for
    engine = Engine(EngineConfig(model=llama.path, schedule_policy="lpm", max_running_requests=3))
    outs = engine.generate(input_ids=shared, sampling_params=SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs[: len(prompts)]] == expected
    assert [o.token_ids for o in outs[len(prompts):]] == [llama.greedy(p, NEW) for p in shared[len(prompts):]]


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_sampled_logprobs_match_transformers(tiny_model: TinyModel, mode: str) -> None:
    prompts = make_prompts(tiny_model.vocab_size, [4, 17, 9], seed=1)
    engine = Engine(EngineConfig(model=tiny_model.path, page_size=16))
    # With temperature 1 and no filter the processed distribution is the raw one.
    params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=7, n=2, ignore_eos=True, logprobs_mode=mode)
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    for out in outs:
        ref = tiny_model.logprobs(out.prompt_ids, out.token_ids)
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)


def test_processed_logprobs_use_the_sampled_distribution(llama: TinyModel) -> None:
    prompt = make_prompts(llama.vocab_size, [6], seed=2)[0]
    engine = Engine(EngineConfig(model=llama.path))
    params = SamplingParams(temperature=0.5, top_k=5, max_new_tokens=8, seed=3, ignore_eos=True, top_logprobs=5)
    out = engine.generate(input_ids=[prompt], sampling_params=params)[0]
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        logits = llama.hf(ids).logits[0, len(prompt) - 1 : -1].float() / 0.5
    top = logits.topk(5, dim=-1)
    filtered = torch.full_like(logits, float("-inf")).scatter(-1, top.indices, top.values)
    ref = torch.log_softmax(filtered, -1).gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)
    assert all(tok in top.indices[i].tolist() for i, tok in enumerate(out.token_ids))
    for i, top_list in enumerate(out.top_logprobs):
        assert len(top_list) == 5 and dict(top_list)[out.token_ids[i]] == pytest.approx(out.logprobs[i], abs=1e-6)


def test_same_seed_same_tokens_whatever_the_batch(llama: TinyModel) -> None:
    prompts = make_prompts(llama.vocab_size, [5, 9, 14, 3], seed=4)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=10, seed=11, ignore_eos=True)
    alone = Engine(EngineConfig(model=llama.path)).generate(input_ids=[prompts[1]], sampling_params=params)[0]
    other = SamplingParams(temperature=0.8, max_new_tokens=6, seed=5, ignore_eos=True)
    mixed = Engine(EngineConfig(model=llama.path, page_size=16)).generate(
        input_ids=prompts, sampling_params=[other, params, other, other]
    )[1]
    assert alone.token_ids == mixed.token_ids
    # and a different seed gives a different stream
    diff = Engine(EngineConfig(model=llama.path)).generate(
        input_ids=[prompts[1]], sampling_params=SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=10, seed=12, ignore_eos=True)
    )[0]
    assert diff.token_ids != alone.token_ids


def test_retracted_sampled_requests_resume_identically(llama: TinyModel) -> None:
    prompts = make_prompts(llama.vocab_size, [20, 25, 30, 18, 22], seed=5)
    params = SamplingParams(temperature=1.0, max_new_tokens=20, seed=21, ignore_eos=True)
    roomy = Engine(EngineConfig(model=llama.path)).generate(input_ids=prompts, sampling_params=params)
    tight_engine = Engine(EngineConfig(model=llama.path, max_total_tokens=100))
    tight = tight_engine.generate(input_ids=prompts, sampling_params=params)
    assert tight_engine.counters.retractions > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    for a, b in zip(tight, roomy):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


@pytest.mark.parametrize("page_size", [1, 16])
def test_n_samples_prefill_the_prompt_once(llama: TinyModel, page_size: int) -> None:
    prompt = make_prompts(llama.vocab_size, [200], seed=6)[0]
    engine = Engine(EngineConfig(model=llama.path, page_size=page_size))
    params = SamplingParams(temperature=1.0, max_new_tokens=5, n=8, seed=0, ignore_eos=True)
    outs = engine.generate(input_ids=[prompt], sampling_params=params)
    assert [o.sample_index for o in outs] == list(range(8))
    # the prompt once, then 4 decode steps per sample (the first token comes from the prefill)
    assert engine.counters.computed_tokens == 200 + 8 * 4
    assert [o.num_cached_tokens for o in outs] == [0] + [200] * 7
    assert len({tuple(o.token_ids) for o in outs}) > 1, "samples of one prompt must differ"
    # each forked sample matches transformers' log-probs on its own sequence
    for out in outs:
        torch.testing.assert_close(torch.tensor(out.logprobs), llama.logprobs(prompt, out.token_ids), atol=1e-4, rtol=0)
    # a repeated request hits the cache (all but the last, page-aligned)
    again = engine.generate(input_ids=[prompt], sampling_params=SamplingParams(temperature=0, max_new_tokens=2))[0]
    assert again.num_cached_tokens == (199 // page_size) * page_size
    assert engine.stats().prefix_cache_hit_rate > 0.8
    assert_all_memory_free(engine)


def test_without_radix_each_sample_prefills(llama: TinyModel) -> None:
    prompt = make_prompts(llama.vocab_size, [40], seed=6)[0]
    engine = Engine(EngineConfig(model=llama.path, enable_radix_cache=False))
    engine.generate(input_ids=[prompt], sampling_params=SamplingParams(temperature=1.0, max_new_tokens=3, n=4, ignore_eos=True))
    assert engine.counters.computed_tokens == 4 * 40 + 4 * 2
    assert engine.stats().prefix_cache_hit_rate == 0.0
