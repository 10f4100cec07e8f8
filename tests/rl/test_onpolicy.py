"""True on-policy scoring: OnPolicyScorer, fed the trainer's (transformers') weights,
recomputes a deterministic engine's raw and processed log-probs bit for bit, for sampled
rollouts at two temperatures, greedy ones, n > 1 samples, and again after a weight update
applied to both. (tests/test_deterministic.py shows the default engine's results moving with
the batch, which is what makes these bitwise checks able to fail.)"""

from __future__ import annotations

import pytest
import torch

from conftest import TinyModel, make_prompts
from rollout import Engine, EngineConfig, SamplingParams
from rollout.rl.onpolicy import OnPolicyScorer
from weightsync.trainer import iter_hf_weights


def _rollouts(engine: Engine, prompts, temperature: float, logprobs_mode: str, n: int = 1):
    params = SamplingParams(temperature=temperature, max_new_tokens=12, seed=3, n=n, ignore_eos=True,
                            logprobs_mode=logprobs_mode)
    return engine.generate(input_ids=prompts, sampling_params=params)


@pytest.fixture(scope="module")
def scorer(llama: TinyModel) -> OnPolicyScorer:
    s = OnPolicyScorer(llama.path)
    s.load(iter_hf_weights(llama.hf))
    return s


def _check(engine, scorer, prompts, temperature, n=1) -> None:
    for mode in ("raw", "processed"):
        outs = _rollouts(engine, prompts, temperature, mode, n)
        expanded = [p for p in prompts for _ in range(n)]
        scored = scorer.score(expanded, [o.token_ids for o in outs], temperature=temperature)
        for out, s in zip(outs, scored, strict=True):
            assert out.logprobs == getattr(s, mode), (temperature, mode)


def test_scorer_reproduces_the_engine_bitwise(llama: TinyModel, scorer) -> None:
    engine = Engine(EngineConfig(model=llama.path, deterministic=True, max_prefill_tokens=16))
    prompts = make_prompts(llama.vocab_size, [9, 30, 4, 17], seed=8)
    for temperature in (1.0, 0.7, 0.0):
        _check(engine, scorer, prompts, temperature)
    _check(engine, scorer, prompts[:2], 1.0, n=3)


def test_after_a_weight_update_to_both(llama: TinyModel) -> None:
    engine = Engine(EngineConfig(model=llama.path, deterministic=True))
    scorer = OnPolicyScorer(llama.path)
    g = torch.Generator().manual_seed(4)
    update = [(name, t + torch.randn(t.shape, generator=g) * 0.02) for name, t in iter_hf_weights(llama.hf)]
    engine.update_weights(update, full=True)
    scorer.load(update)
    _check(engine, scorer, make_prompts(llama.vocab_size, [12, 5], seed=9), 1.0)


def test_the_default_engine_is_only_close(llama: TinyModel, scorer) -> None:
    engine = Engine(EngineConfig(model=llama.path))
    prompts = make_prompts(llama.vocab_size, [9, 30, 4, 17], seed=8)
    outs = _rollouts(engine, prompts, 1.0, "raw")
    scored = scorer.score(prompts, [o.token_ids for o in outs])
    got = [x for o in outs for x in o.logprobs]
    want = [x for s in scored for x in s.raw]
    assert got == pytest.approx(want, abs=1e-4)  # close, not held to bitwise


def test_bad_inputs(scorer) -> None:
    with pytest.raises(ValueError, match="responses: 1 for 2 prompts"):
        scorer.score([[1], [2]], [[3]])
    with pytest.raises(ValueError, match="at least one token"):
        scorer.score([[1]], [[]])
    with pytest.raises(ValueError, match="max_tokens"):
        scorer.score([[1] * 9000], [[2]])
