"""Speculative decoding in the engine (CPU, float32, tiny checkpoints): greedy tokens equal
plain decoding and transformers, with raw log-probs within 1e-4; sampled tokens equal plain
decoding for the same seeds, even under a drafter that is wrong almost always (so rejection
runs on nearly every step): verification draws each position with that position's own
noise, which makes the output identical, not just identically distributed; tight KV with
retraction and n = 8 forks; LoRA adapters; a weight update in between; stats."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import TinyModel, make_prompts
from rollout import Engine, EngineConfig, SamplingParams
from rollout.request import Req
from speculative.base import Drafter

NEW = 16


def _repetitive(vocab: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(2, 4))] * rng.randint(3, 6) for _ in range(count)]


class WrongDrafter(Drafter):
    """Proposes random tokens: nearly every draft is rejected."""

    def __init__(self, vocab: int, k: int) -> None:
        super().__init__(k, 10_000)
        self.rng, self.vocab = random.Random(0), vocab

    def propose(self, req: Req, k: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(k)]

    def observe_step(self, req: Req, drafted: int, accepted: int) -> None:
        pass  # keep drafting at full length: the test wants rejections


@pytest.mark.parametrize("drafter", ["ngram", "suffix"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_equals_plain_decoding_and_transformers(tiny_model: TinyModel, drafter: str, page_size: int) -> None:
    prompts = _repetitive(tiny_model.vocab_size, 5, seed=70) + make_prompts(tiny_model.vocab_size, [7, 12], seed=71)
    params = SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True, logprobs_mode="raw")
    engine = Engine(EngineConfig(model=tiny_model.path, page_size=page_size, speculative=drafter, speculative_governor=False))
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    for out, prompt in zip(outs, prompts):
        assert out.token_ids == tiny_model.greedy(prompt, NEW)
        assert torch.allclose(torch.tensor(out.logprobs), tiny_model.logprobs(prompt, out.token_ids), atol=1e-4)
    stats = engine.stats()
    assert stats.counters["verify_steps"] > 0 and stats.counters["accepted_tokens"] > 0
    assert 0 < stats.draft_acceptance_rate <= 1 and stats.mean_accepted_length > 0
    engine.flush_cache()
    assert engine.kv.used_slots() == 0, "rolled-back KV leaked"


def test_sampled_tokens_equal_plain_decoding_under_a_wrong_drafter(llama: TinyModel) -> None:
    """The two-sample check, in its strongest form: for 64 seeds (x top-p / top-k / min-p
    settings) the speculative engine emits exactly the plain engine's sequences, although
    almost every draft it verifies is rejected."""
    prompts = make_prompts(llama.vocab_size, [4, 9, 6, 11], seed=72)
    settings = [SamplingParams(temperature=1.0, max_new_tokens=12, seed=s, ignore_eos=True, n=2,
                               top_p=[1.0, 0.8][s % 2], top_k=[-1, 20][s // 2 % 2], min_p=[0.0, 0.05][s // 4 % 2])
                for s in range(16)]
    plain = Engine(EngineConfig(model=llama.path))
    spec = Engine(EngineConfig(model=llama.path, speculative="ngram"))
    spec.speculation.drafter = WrongDrafter(llama.vocab_size, 3)
    spec.speculation.governor = None  # keep verifying wrong drafts: the test wants rejections
    for params in settings:
        a = plain.generate(input_ids=prompts, sampling_params=params)
        b = spec.generate(input_ids=prompts, sampling_params=params)
        assert [o.token_ids for o in b] == [o.token_ids for o in a]
        for x, y in zip(a, b):
            assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5)
    c = spec.counters
    assert c.drafted_tokens > 1000 and c.accepted_tokens < 0.05 * c.drafted_tokens, (c.drafted_tokens, c.accepted_tokens)


@pytest.mark.parametrize("drafter", ["ngram", "suffix"])
def test_tight_kv_retraction_and_forks(llama: TinyModel, drafter: str) -> None:
    prompts = _repetitive(llama.vocab_size, 4, seed=73)
    # greedy samples follow the repeating pattern (drafts accepted); sampled ones rarely do
    params = [SamplingParams(temperature=t, max_new_tokens=20, seed=9, n=8, ignore_eos=True) for t in (0.0, 1.0, 0.0, 1.0)]
    want = Engine(EngineConfig(model=llama.path, page_size=4)).generate(input_ids=prompts, sampling_params=params)
    tight = Engine(EngineConfig(model=llama.path, page_size=4, max_total_tokens=240, speculative=drafter, speculative_governor=False))
    got = tight.generate(input_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert tight.counters.retractions > 0 and tight.counters.verify_steps > 0
    tight.flush_cache()
    assert tight.kv.used_slots() == 0 and tight.kv.allocator.num_free_pages == tight.kv.allocator.num_pages - 1


def _adapter(llama: TinyModel, seed: int) -> dict[str, torch.Tensor]:
    cfg, g = llama.hf.config, torch.Generator().manual_seed(seed)
    h = cfg.hidden_size
    out = {}
    for layer in range(cfg.num_hidden_layers):
        name = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        out[f"{name}.lora_A.weight"] = torch.randn(4, h, generator=g) * 0.3
        out[f"{name}.lora_B.weight"] = torch.randn(h, 4, generator=g) * 0.3
    return out


def test_lora_requests_and_weight_updates_keep_outputs_exact(llama: TinyModel) -> None:
    """Drafts run under each request's adapter (the suffix drafter keeps one history per
    adapter); a weight update between rounds changes nothing about exactness."""
    prompts = _repetitive(llama.vocab_size, 4, seed=74)
    names = ["a", None, "a", None]
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW, seed=4, n=2, ignore_eos=True)
    engines = []
    for spec in (None, "suffix"):
        engine = Engine(EngineConfig(model=llama.path, enable_lora=True, max_lora_rank=8, speculative=spec,
                                     speculative_governor=False))
        engine.load_lora_adapter("a", tensors=_adapter(llama, 1), config=dict(r=4, lora_alpha=8, target_modules=["q_proj"]))
        engines.append(engine)
    plain, spec = engines
    for round_ in range(2):
        a = plain.generate(input_ids=prompts, sampling_params=params, lora_name=names)
        b = spec.generate(input_ids=prompts, sampling_params=params, lora_name=names)
        assert [o.token_ids for o in b] == [o.token_ids for o in a], round_
        weights = [("model.norm.weight", llama.hf.model.norm.weight.detach() * (1.1 + round_))]
        plain.update_weights(weights)
        spec.update_weights(weights)
    assert spec.counters.accepted_tokens > 0


def test_updates_restart_the_governor_and_honour_the_history_option(llama: TinyModel) -> None:
    """A base or adapter update makes the governor measure afresh (it may have switched
    drafting off on the old policy); with keep_history_on_update=False an adapter update
    drops that adapter's rollouts only."""
    engine = Engine(EngineConfig(model=llama.path, enable_lora=True, max_lora_rank=8, speculative="suffix",
                                 speculative_keep_history_on_update=False))
    engine.load_lora_adapter("a", tensors=_adapter(llama, 1), config=dict(r=4, lora_alpha=8, target_modules=["q_proj"]))
    prompts = _repetitive(llama.vocab_size, 2, seed=75)
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    engine.generate(input_ids=prompts, sampling_params=params, lora_name=["a", None])
    history = engine.speculation.drafter.history
    assert len(history) == 2
    governor = engine.speculation.governor
    governor.drafting = governor.probing = False
    engine.update_lora_adapter("a", _adapter(llama, 2).items())
    assert governor.drafting and governor.probing
    (left,) = history._groups  # the base model's prompt; the adapter's is gone
    assert left == (None, tuple(prompts[1]))
    governor.drafting = governor.probing = False
    engine.update_weights([("model.norm.weight", llama.hf.model.norm.weight.detach() * 1.1)])
    assert governor.drafting and governor.probing and len(history) == 0



@pytest.mark.parametrize("drafter", ["ngram", "suffix"])
def test_sampled_outputs_with_coupled_drafts_equal_plain_decoding(llama: TinyModel, drafter: str, monkeypatch) -> None:
    """Coupled drafts (the sampler's own noise raced over the history's counts) change what
    is proposed, never what is emitted: GRPO-like epochs (n = 8; temperature 0.3, then with
    top-k / top-p, then temperature 1 with min-p; the suffix drafter's history warm from the
    earlier ones) give plain decoding's tokens and log-probs, the race really ran over
    several candidates, and from the suffix drafter's history of samples it was accepted far
    more often than point-mass drafts of the same history (the same engine with
    `coupled=False`; n-gram lookup has only the request's own tokens to count, about as
    good either way here)."""
    import speculative.choice as choice

    races = []
    real = choice.coupled
    monkeypatch.setattr(choice, "coupled", lambda levels, key: races.append(len(choice.blended(levels))) or real(levels, key))
    prompts = _repetitive(llama.vocab_size, 4, seed=75)
    epochs = [SamplingParams(temperature=0.3, max_new_tokens=24, seed=0, n=8, ignore_eos=True),
              SamplingParams(temperature=0.3, max_new_tokens=24, seed=1, n=8, ignore_eos=True, top_k=40, top_p=0.9),
              SamplingParams(temperature=1.0, max_new_tokens=24, seed=2, n=8, ignore_eos=True, min_p=0.05)]
    plain = Engine(EngineConfig(model=llama.path))
    want = [plain.generate(input_ids=prompts, sampling_params=params) for params in epochs]
    accepted = {}
    for coupled in (True, False):
        spec = Engine(EngineConfig(model=llama.path, speculative=drafter, speculative_governor=False))
        spec.speculation.drafter.coupled = coupled
        for params, a in zip(epochs, want):
            b = spec.generate(input_ids=prompts, sampling_params=params)
            assert [o.token_ids for o in b] == [o.token_ids for o in a]
            for x, y in zip(a, b):
                assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5)
        accepted[coupled] = spec.counters.accepted_tokens
        if coupled:
            assert sum(n > 1 for n in races) > 20, "the coupled race ran over several candidates"
    assert min(accepted.values()) > 0, accepted
    if drafter == "suffix":
        assert accepted[True] > 1.5 * accepted[False], accepted


class _Scripted:
    """A governor stand-in that drafts on a fixed pattern of steps (on for 3, off for 2), so
    every transition between drafting and overlapped plain steps happens many times."""

    def __init__(self) -> None:
        self.steps, self.drains, self.drained_tokens, self.drafting = 0, 0, 0, True

    def observe(self, seconds, tokens, decode_only=True, verified=None, share=None) -> None:
        self.steps += 1
        self.drafting = self.steps % 5 < 3

    def observe_drain(self, seconds, tokens) -> None:
        self.drains += 1
        self.drained_tokens += tokens

    def restart(self) -> None:
        pass

    def check_due(self) -> bool:
        return False  # the pattern alone decides


@pytest.mark.parametrize("drafter", ["ngram", "suffix"])
def test_plain_steps_overlap_between_drafting_steps(llama: TinyModel, drafter: str) -> None:
    """While the governor keeps drafting off, steps overlap as without speculation; a drafting
    step first reads back the token in flight (that wait is plain decoding's). Outputs equal
    plain decoding's for greedy and seeded sampled requests, with forks and tight KV."""
    prompts = _repetitive(llama.vocab_size, 6, seed=76)
    greedy = SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, max_new_tokens=NEW, seed=9, n=3, ignore_eos=True)
    kw = dict(model=llama.path, page_size=4, overlap_schedule=True)
    plain = Engine(EngineConfig(**kw))
    spec = Engine(EngineConfig(**kw, speculative=drafter))
    assert spec.config.overlap is False and spec.loop.overlap is True  # drafting steps do not overlap; plain ones do
    script = spec.speculation.governor = _Scripted()
    overlapped = []
    launch = spec.loop.sample

    def sample(forwarded, record_rows=None):
        overlapped.append(record_rows is not None)  # an overlapped step keeps its tokens on the device
        return launch(forwarded, record_rows)

    spec.loop.sample = sample
    for params in (greedy, sampled):
        want = plain.generate(input_ids=prompts, sampling_params=params)
        got = spec.generate(input_ids=prompts, sampling_params=params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        for g, w in zip(got, want, strict=True):
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)
    assert any(overlapped) and not all(overlapped), "both kinds of step ran"
    assert script.drains > 0 and script.drained_tokens > 0
    assert spec.counters.accepted_tokens > 0
    spec.flush_cache()
    assert spec.kv.used_slots() == 0 and spec.loop.inflight is None
    tight = Engine(EngineConfig(**kw, speculative=drafter, max_total_tokens=160))
    tight.speculation.governor = _Scripted()
    got = tight.generate(input_ids=prompts, sampling_params=sampled)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate(input_ids=prompts, sampling_params=sampled)]
    assert tight.counters.retractions > 0


class SparseDrafter(Drafter):
    """Drafts (wrong ones, nearly always: a hash of the position) only where the context's
    length is a multiple of 5, and says so one token ahead (`may_draft_next`): chains of steps
    with nothing to draft, a drain before each drafting step, and pauses after rejections."""

    def __init__(self, vocab: int) -> None:
        super().__init__(3, 10_000)
        self.vocab = vocab
        self.verified: dict[str, int] = {}  # request id -> its verify steps

    def propose(self, req: Req, k: int) -> list[int]:
        return [(req.known_len * 7919 + j) % self.vocab for j in range(k)] if req.known_len % 5 == 0 else []

    def may_draft_next(self, req: Req) -> bool:
        return (req.known_len + 1) % 5 == 0

    def observe_step(self, req: Req, drafted: int, accepted: int) -> None:
        self.verified[req.rid] = self.verified.get(req.rid, 0) + 1
        super().observe_step(req, drafted, accepted)


def test_drafting_steps_with_nothing_to_draft_overlap(llama: TinyModel) -> None:
    """With overlap on (forced on CPU, as CUDA runs it): a drafting step that has no draft
    overlaps like a plain step, and the next step waits for its token only when the drafter
    says a draft may follow it, so no draft is lost: every request verifies exactly as often
    as with every such step run without overlap. Greedy and seeded sampled outputs (with
    forks and tight KV) equal plain decoding's; no KV leaks; paused requests draft again."""
    prompts = _repetitive(llama.vocab_size, 4, seed=80) + make_prompts(llama.vocab_size, [9, 14], seed=81)
    kw = dict(model=llama.path, page_size=4, overlap_schedule=True)
    plain = Engine(EngineConfig(**kw))
    for params in (SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True),
                   SamplingParams(temperature=1.0, max_new_tokens=64, seed=5, n=3, ignore_eos=True)):
        for max_total in (None, 200):
            want = plain.generate(input_ids=prompts, sampling_params=params)
            verified = []
            for draftless_overlap in (True, False):
                spec = Engine(EngineConfig(**kw, speculative="ngram", speculative_governor=False,
                                           **({} if max_total is None else {"max_total_tokens": max_total})))
                spec.speculation.drafter = drafter = SparseDrafter(llama.vocab_size)
                spec.speculation.governor = None
                spec.speculation.draftless_overlap = draftless_overlap
                got = spec.generate(input_ids=prompts, sampling_params=params)
                assert [o.token_ids for o in got] == [o.token_ids for o in want]
                for g, w in zip(got, want, strict=True):
                    assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)
                c = spec.counters
                if draftless_overlap:
                    assert c.spec_overlapped_steps > 2 * c.spec_drains > 0 and c.verify_steps > 0, c
                else:
                    assert c.spec_overlapped_steps == 0
                spec.flush_cache()
                assert spec.kv.used_slots() == 0 and spec.loop.inflight is None
                verified.append(drafter.verified)
            if max_total is None:  # (retraction's timing differs with overlap; without it the runs match)
                assert verified[0] == verified[1], "overlapping lost no draft"
                # two full rejections pause a request 16 steps; then it drafts again
                assert len(verified[0]) == len(got) and min(verified[0].values()) >= 3, verified[0]


@pytest.mark.parametrize("drafter", ["ngram", "suffix"])
def test_draftless_overlap_loses_no_draft_of_the_real_drafters(llama: TinyModel, drafter: str) -> None:
    """The n-gram and suffix drafters, overlap on, greedy on repetitive prompts: every draft
    proposed (request, position, tokens) and every verification equal the run whose draft-less
    steps do not overlap."""
    prompts = _repetitive(llama.vocab_size, 5, seed=90)
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    logs = []
    for draftless_overlap in (True, False):
        engine = Engine(EngineConfig(model=llama.path, page_size=4, overlap_schedule=True, speculative=drafter,
                                     speculative_governor=False))
        engine.speculation.draftless_overlap = draftless_overlap
        log: list[tuple] = []
        d = engine.speculation.drafter
        propose_batch = d.propose_batch

        def logged(wanted, propose_batch=propose_batch, log=log):
            out = propose_batch(wanted)
            log.extend((r.rid, r.known_len, tuple(x)) for (r, _), x in zip(wanted, out) if x)
            return out

        d.propose_batch = logged
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        logs.append((log, [o.token_ids for o in outs], engine.counters.verify_steps, engine.counters.accepted_tokens,
                     engine.counters.spec_overlapped_steps))
    (log_on, toks_on, v_on, a_on, ovl), (log_off, toks_off, v_off, a_off, _) = logs
    assert toks_on == toks_off and v_on == v_off and a_on == a_off and log_on == log_off
    assert ovl > 0 and v_on > 0, "overlapped steps ran, and drafts were verified"
