"""The draft-model drafter (speculative="draft") on tiny checkpoints, CPU, float32: greedy
tokens equal transformers and plain decoding whether the draft is the target itself (every
draft accepted) or an unrelated model of the same vocabulary (most rejected); sampled tokens
equal plain decoding under tight KV with forks; the draft's KV never leaks; weight sync
routes to the draft by `target="draft"` or the "draft." prefix, atomically, and drafting
pauses while the draft is behind the policy; sleep/wake releases and restores the draft."""

from __future__ import annotations

import pytest
import torch

from conftest import TinyModel, make_prompts
from rollout import Engine, EngineConfig, SamplingParams
from rollout.kernels.options import KernelOptions

NEW = 16


@pytest.fixture(scope="module")
def other(llama: TinyModel, tmp_path_factory):
    """A draft unrelated to the llama target: the same shapes and vocabulary, other random
    weights (so most of its drafts are rejected)."""
    from types import SimpleNamespace

    from transformers import LlamaForCausalLM

    torch.manual_seed(99)
    hf = LlamaForCausalLM(llama.hf.config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" not in name:
                p.mul_(4.0)
    path = tmp_path_factory.mktemp("draft_other")
    hf.save_pretrained(path)
    return SimpleNamespace(path=str(path), hf=hf)


def _engine(target: TinyModel, draft: str, **kw) -> Engine:
    return Engine(EngineConfig(model=target.path, speculative="draft", draft_model=draft, speculative_governor=False, **kw))


def _draft_free(engine: Engine) -> bool:
    alloc = engine.draft.pool.allocator  # type: ignore[union-attr]
    return alloc.num_free_slots == alloc.capacity_slots and not engine.speculation.drafter.seqs  # type: ignore[attr-defined]


@pytest.mark.parametrize("which", ["self", "other"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_equals_transformers(llama: TinyModel, other, which: str, page_size: int) -> None:
    prompts = make_prompts(llama.vocab_size, [5, 9, 14, 30], seed=80)
    engine = _engine(llama, llama.path if which == "self" else other.path, page_size=page_size)
    params = SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True, logprobs_mode="raw")
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    for out, prompt in zip(outs, prompts):
        assert out.token_ids == llama.greedy(prompt, NEW)
        torch.testing.assert_close(torch.tensor(out.logprobs), llama.logprobs(prompt, out.token_ids), atol=1e-4, rtol=0)
    c = engine.stats().counters
    assert c["verify_steps"] > 0
    if which == "self":  # the target drafting for itself greedily: every draft is accepted
        assert c["accepted_tokens"] == c["drafted_tokens"] > 0
        assert c["steps"] < NEW  # several tokens per step
    else:
        assert c["accepted_tokens"] < c["drafted_tokens"]
    assert _draft_free(engine), "draft KV leaked"
    engine.flush_cache()
    assert engine.kv.used_slots() == 0


def test_sampled_equals_plain_decoding_with_tight_kv_and_forks(llama: TinyModel, other) -> None:
    prompts = make_prompts(llama.vocab_size, [6, 11, 17], seed=81)
    params = [SamplingParams(temperature=t, top_p=p, max_new_tokens=24, ignore_eos=True, seed=s, n=4)
              for t, p, s in ((1.0, 1.0, 1), (0.7, 0.9, 2), (0.3, 1.0, 3))]
    plain = Engine(EngineConfig(model=llama.path)).generate(input_ids=prompts, sampling_params=params)
    for draft in (llama.path, other.path):
        # 96 KV tokens for 12 sequences of up to 41: retraction; the draft's pool is as tight
        engine = _engine(llama, draft, max_total_tokens=96, max_running_requests=8)
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
        assert engine.stats().counters["verify_steps"] > 0
        assert _draft_free(engine)


def _greedy_counters(engine: Engine, prompts) -> dict:
    before = dict(engine.stats().counters)
    engine.generate(input_ids=prompts, sampling_params=SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True))
    return {k: v - before[k] for k, v in engine.stats().counters.items()}


def test_weight_sync_reaches_the_draft_and_a_stale_draft_pauses(llama: TinyModel, other) -> None:
    prompts = make_prompts(llama.vocab_size, [7, 12], seed=82)
    engine = _engine(llama, other.path)
    target_sd = {n: t.clone() for n, t in llama.hf.state_dict().items()}
    assert engine.stats().draft_weight_version == 0 and not engine.stats().draft_stale

    # the policy moves on alone: drafting pauses (visibly), nothing is drafted from a stale draft
    engine.update_weights(target_sd.items())
    stats = engine.stats()
    assert stats.weight_version == 1 and stats.draft_stale and stats.draft_weight_version == 0
    assert _greedy_counters(engine, prompts)["drafted_tokens"] == 0

    # the draft's own update (here: the target's weights, so every greedy draft is accepted)
    assert engine.update_weights(target_sd.items(), target="draft") == 1  # the policy version stays
    stats = engine.stats()
    assert not stats.draft_stale and stats.draft_weight_version == 1
    c = _greedy_counters(engine, prompts)
    assert c["accepted_tokens"] == c["drafted_tokens"] > 0

    # both in one update by name prefix: one version bump, the draft in step
    both = [*target_sd.items(), *((f"draft.{n}", t) for n, t in target_sd.items())]
    assert engine.update_weights(both) == 2
    assert engine.stats().draft_weight_version == 2 and not engine.stats().draft_stale


def test_a_bad_draft_tensor_refuses_the_whole_update(llama: TinyModel, other) -> None:
    engine = _engine(llama, other.path)
    target_before = {n: p.clone() for n, p in engine.model.named_parameters()}
    draft_before = {n: p.clone() for n, p in engine.draft.model.named_parameters()}  # type: ignore[union-attr]
    good = [(n, t + 1.0) for n, t in llama.hf.state_dict().items()]
    bad = torch.full_like(other.hf.state_dict()["model.norm.weight"], float("nan"))
    with pytest.raises(ValueError, match="draft model.*model.norm.weight.*non-finite"):
        engine.update_weights([*good, ("draft.model.norm.weight", bad)])
    with pytest.raises(ValueError, match="draft model.*shape"):
        engine.update_weights([("model.norm.weight", torch.ones(3))], target="draft")
    for before, model in ((target_before, engine.model), (draft_before, engine.draft.model)):  # type: ignore[union-attr]
        for n, p in model.named_parameters():
            assert torch.equal(p, before[n]), f"{n} was written by a refused update"
    assert engine.weight_version == 0
    with pytest.raises(ValueError, match="target='model'.*expected 'model' or 'draft'|expected 'model' or 'draft'"):
        engine.update_weights(good, target="policy")
    plain = Engine(EngineConfig(model=llama.path))
    with pytest.raises(ValueError, match="has none"):
        plain.update_weights(good, target="draft")
    with pytest.raises(ValueError, match="has none"):
        plain.update_weights([("draft.model.norm.weight", torch.ones(64))])


def test_a_fixed_draft_keeps_drafting_after_a_target_update(llama: TinyModel) -> None:
    engine = _engine(llama, llama.path, speculative_draft_sync=False)
    engine.update_weights(llama.hf.state_dict().items())
    assert not engine.stats().draft_stale
    assert _greedy_counters(engine, make_prompts(llama.vocab_size, [9], seed=83))["accepted_tokens"] > 0


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_releases_the_draft_and_wake_restores_it(llama: TinyModel, level: int) -> None:
    prompts = make_prompts(llama.vocab_size, [8, 13], seed=84)
    engine = _engine(llama, llama.path)
    params = SamplingParams(temperature=0.8, max_new_tokens=NEW, ignore_eos=True, seed=9)
    before = engine.generate(input_ids=prompts, sampling_params=params)
    draft_kv = sum(t.numel() for t in engine.draft.kv_tensors())  # type: ignore[union-attr]
    engine.sleep(level)
    assert all(t.numel() == 0 for t in engine.draft.kv_tensors())  # type: ignore[union-attr]
    assert all(p.numel() == 0 for p in engine.draft.model.parameters())  # type: ignore[union-attr]
    engine.wake(["weights"])
    if level == 2:  # the target's weights were dropped (the draft's kept on the host): a full sync,
        # the draft's in the same update, or drafting would pause as behind the policy
        sd = llama.hf.state_dict()
        engine.update_weights([*sd.items(), *((f"draft.{n}", t) for n, t in sd.items())], full=True)
    engine.wake(["kv_cache"])
    assert sum(t.numel() for t in engine.draft.kv_tensors()) == draft_kv  # type: ignore[union-attr]
    c0 = dict(engine.counters.__dict__)
    after = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in after] == [o.token_ids for o in before]
    assert engine.counters.accepted_tokens > c0["accepted_tokens"]  # the restored draft drafts well


def test_config_refuses_a_draft_that_does_not_fit(llama: TinyModel, tmp_path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    with pytest.raises(ValueError, match="draft_model"):
        EngineConfig(model=llama.path, speculative="draft")
    with pytest.raises(ValueError, match="draft_model"):
        EngineConfig(model=llama.path, draft_model=llama.path)
    cfg = LlamaConfig(vocab_size=170, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "wrong_vocab")
    with pytest.raises(ValueError, match="vocabulary of 170 tokens.*160"):
        _engine(llama, str(tmp_path / "wrong_vocab"))


def test_draft_rows_layout_proposes_as_the_extend_layout(llama: TinyModel, other) -> None:
    """The draft's catch-up as decode rows (what replays its graphs on CUDA) drafts the same
    tokens as the extend layout: the same outputs and the same acceptance counts."""
    prompts = make_prompts(llama.vocab_size, [5, 11, 18], seed=85)
    params = SamplingParams(temperature=0.6, max_new_tokens=NEW, ignore_eos=True, seed=2, n=2)
    results = []
    for rows_max in (0, 1 << 20):
        engine = _engine(llama, other.path, kernel_options=KernelOptions(draft_rows_max=rows_max))
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        c = engine.stats().counters
        results.append(([o.token_ids for o in outs], c["drafted_tokens"], c["accepted_tokens"]))
    assert results[0] == results[1] and results[0][1] > 0
