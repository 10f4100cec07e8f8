"""Trainer log-probs of the engine's samples, in both batch layouts, and the mismatch
telemetry built on them: ~0 in float32 on CPU where the engine and the trainer compute the
same function, clearly non-zero once the trainer's weights move away from the engine's."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import TinyModel, make_prompts
from rollout import Engine, EngineConfig, SamplingParams
from rollout.request import RolloutOutput
from rollout.rl.batch import build_batch
from rollout.rl.loss import LossConfig, grpo_loss
from rollout.rl.mismatch import mismatch_metrics
from rollout.rl.scoring import response_logprobs

N = 3
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def rollouts(llama: TinyModel) -> list[RolloutOutput]:
    engine = Engine(EngineConfig(model=llama.path, page_size=16))
    prompts = make_prompts(llama.vocab_size, [5, 9, 3], seed=11)
    outs = engine.generate(input_ids=prompts, sampling_params=SamplingParams(temperature=TEMPERATURE, max_new_tokens=6,
                                                                             n=N, seed=5))
    return sorted(outs, key=lambda o: (o.prompt_index, o.sample_index))


def _flat(batch, logprobs):
    mask = batch.response_mask.bool()
    return logprobs[mask], batch.rollout_logprobs[mask]


@pytest.mark.parametrize("layout", ["packed", "rows"])
def test_mismatch_is_zero_where_engine_and_trainer_agree(llama: TinyModel, rollouts, layout: str) -> None:
    batch = build_batch(rollouts, torch.zeros(len(rollouts)), N, layout)
    with torch.no_grad():
        trainer = response_logprobs(llama.hf, batch, TEMPERATURE)
    metrics = mismatch_metrics(*_flat(batch, trainer), tis_cap=2.0)
    assert metrics["training/rollout_logprobs_abs_diff_max"] < 1e-4
    assert metrics["training/rollout_probs_diff_max"] < 1e-4
    assert abs(metrics["rollout_corr/k3_kl"]) < 1e-8 and abs(metrics["rollout_corr/kl"]) < 1e-4
    assert metrics["rollout_corr/rollout_is_min"] > 1 - 1e-4 and metrics["rollout_corr/rollout_is_max"] < 1 + 1e-4
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == 0.0


def test_mismatch_sees_perturbed_trainer_weights(llama: TinyModel, rollouts) -> None:
    batch = build_batch(rollouts, torch.zeros(len(rollouts)), N)
    trainer = copy.deepcopy(llama.hf)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.05 * torch.randn_like(p))
        lp = response_logprobs(trainer, batch, TEMPERATURE)
    metrics = mismatch_metrics(*_flat(batch, lp), tis_cap=2.0)
    assert metrics["training/rollout_logprobs_abs_diff_mean"] > 1e-2
    assert metrics["rollout_corr/k3_kl"] > 1e-4
    assert metrics["rollout_corr/rollout_is_max"] > 1.0 > metrics["rollout_corr/rollout_is_min"]


def test_mismatch_by_hand() -> None:
    trainer = torch.log(torch.tensor([0.5, 0.3, 0.9]))
    rollout = torch.log(torch.tensor([0.5, 0.2, 0.3]))  # ratios 1, 1.5, 3
    m = mismatch_metrics(trainer, rollout, tis_cap=2.0)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(5.5 / 3)
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(3.0) and m["rollout_corr/rollout_is_min"] == pytest.approx(1.0)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)  # only 3 > 2 is truncated
    r = torch.tensor([1.0, 1.5, 3.0], dtype=torch.float64)
    assert m["rollout_corr/k3_kl"] == pytest.approx(float((r - r.log() - 1).mean()), rel=1e-5)
    assert m["rollout_corr/kl"] == pytest.approx(-float(r.log().mean()), rel=1e-5)
    assert m["training/rollout_probs_diff_max"] == pytest.approx(0.6, rel=1e-5)
    assert m["training/rollout_logprobs_abs_diff_max"] == pytest.approx(float(torch.log(torch.tensor(3.0))), rel=1e-5)


def _synthetic(vocab: int) -> list[RolloutOutput]:
    """Two groups of 3 with different prompt lengths and ragged responses (one empty)."""
    g = torch.Generator().manual_seed(3)
    outs = []
    for prompt_index, (plen, rlens) in enumerate([(4, (5, 2, 0)), (7, (1, 6, 3))]):
        prompt = torch.randint(0, vocab, (plen,), generator=g).tolist()
        for i, r in enumerate(rlens):
            tokens = torch.randint(0, vocab, (r,), generator=g).tolist()
            outs.append(RolloutOutput(f"{prompt_index}-{i}", prompt_index, i, prompt, tokens, [0.0] * r, "length",
                                      None, 0, 0, [(0, 0, r)] if r else []))
    return outs


def test_both_layouts_equal_hf_per_sample_and_give_the_same_gradient(llama: TinyModel) -> None:
    outs = _synthetic(llama.vocab_size)
    advantages = torch.tensor([1.0, -0.5, 0.3, -1.0, 0.2, 0.8])
    grads, values = {}, {}
    for layout in ("packed", "rows"):
        model = copy.deepcopy(llama.hf)
        batch = build_batch(outs, advantages, 3, layout)
        lp = response_logprobs(model, batch)
        for b, out in enumerate(outs):
            if out.token_ids:
                want = llama.logprobs(out.prompt_ids, out.token_ids)
                assert torch.allclose(lp[b, : len(out.token_ids)].detach(), want, atol=1e-5), (layout, b)
        assert (lp[batch.response_mask == 0] == 0).all()
        out = grpo_loss(lp, lp.detach(), batch.rollout_logprobs, batch.advantages, batch.response_mask, LossConfig(tis_cap=None))
        out.loss.backward()
        values[layout] = float(out.loss.detach())
        grads[layout] = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert values["packed"] == pytest.approx(values["rows"], abs=1e-6)
    assert torch.allclose(grads["packed"], grads["rows"], atol=1e-5, rtol=1e-4)
    assert grads["packed"].abs().max() > 0


def test_group_slices_keep_both_layouts_aligned(llama: TinyModel) -> None:
    outs = _synthetic(llama.vocab_size)
    for layout in ("packed", "rows"):
        batch = build_batch(outs, torch.zeros(6), 3, layout)
        with torch.no_grad():
            whole = response_logprobs(llama.hf, batch)
            parts = torch.cat([response_logprobs(llama.hf, batch.groups(g, g + 1)) for g in range(2)])
        assert torch.allclose(whole, parts, atol=1e-6), layout


def test_build_batch_refuses_mixed_groups(llama: TinyModel) -> None:
    outs = _synthetic(llama.vocab_size)
    with pytest.raises(ValueError, match="groups of 4"):
        build_batch(outs, torch.zeros(6), 4)
    with pytest.raises(ValueError, match="not the same prompt"):
        build_batch(outs, torch.zeros(6), 2)
