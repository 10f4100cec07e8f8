"""Group-normalized advantages and the clipped policy-gradient loss with TIS, against
small cases computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rollout.rl.advantages import group_advantages
from rollout.rl.loss import LossConfig, grpo_loss, tis_weights


def test_group_advantages_by_hand() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0],    # mean 0.5, unbiased std sqrt(1/3)
                            [0.5, 0.5, 0.5, 0.5],    # all equal: nothing to learn
                            [0.0, 0.0, 0.0, 3.0]])   # mean 0.75, unbiased std 1.5
    adv = group_advantages(rewards[[0, 2]], eps=0.0)
    s = math.sqrt(1 / 3)
    assert adv[0].tolist() == pytest.approx([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s])
    assert adv[1].tolist() == pytest.approx([-0.5, -0.5, -0.5, 1.5])
    assert group_advantages(rewards)[1].tolist() == [0.0, 0.0, 0.0, 0.0]  # eps keeps 0 / 0 out
    assert group_advantages(rewards, scale=False)[2].tolist() == pytest.approx([-0.75, -0.75, -0.75, 2.25])
    assert group_advantages(rewards).sum(dim=1).abs().max() < 1e-6


def test_group_advantages_refuses_bad_shapes() -> None:
    with pytest.raises(ValueError, match="num_groups, group_size"):
        group_advantages(torch.zeros(4))
    with pytest.raises(ValueError, match="at least 2"):
        group_advantages(torch.zeros(3, 1))


def test_loss_by_hand() -> None:
    # Two samples, three response tokens, the second sample one token shorter.
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
    # new / old ratios: 1.5 (clipped to 1.2 for A > 0), 1.0, 0.5 | 0.7 (clipped to 0.8 for A < 0), 1.1
    new = old + torch.log(torch.tensor([[1.5, 1.0, 0.5], [0.7, 1.1, 9.0]]))
    # engine probs: old / rollout ratios 1.0, 4.0 (truncated at 2), 0.5 | 1.0, 1.0
    rollout = old - torch.log(torch.tensor([[1.0, 4.0, 0.5], [1.0, 1.0, 1.0]]))
    new.requires_grad_(True)
    out = grpo_loss(new, old, rollout, adv, mask, LossConfig(clip_low=0.2, clip_high=0.2, tis_cap=2.0))
    # per token -min(r * A, clip(r) * A) * tis:
    #   sample 0 (A=1):  -min(1.5, 1.2) * 1 = -1.2 ; -1.0 * 2 = -2.0 ; -min(0.5, 0.8) * 0.5 = -0.25
    #   sample 1 (A=-2): -min(-1.4, -1.6) * 1 = 1.6 ; -min(-2.2, -2.2) * 1 = 2.2
    want = (-1.2 - 2.0 - 0.25 + 1.6 + 2.2) / 5
    assert float(out.loss.detach()) == pytest.approx(want, abs=1e-6)
    assert out.pg_clipfrac == pytest.approx(2 / 5)  # the 1.5 and the 0.7 tokens
    assert torch.allclose(out.tis_weights, torch.tensor([[1.0, 2.0, 0.5], [1.0, 1.0, 0.0]]))
    out.loss.backward()
    # d/d new of -r * A * w = -r * A * w; clipped tokens and padding get no gradient
    want_grad = torch.tensor([[0.0, -1.0 * 2.0, -0.5 * 0.5], [0.0, 1.1 * 2.0, 0.0]]) / 5
    assert torch.allclose(new.grad, want_grad, atol=1e-6)


def test_loss_denominator_and_tis_off() -> None:
    mask = torch.ones(2, 2)
    lp = torch.zeros(2, 2, requires_grad=True)
    adv = torch.tensor([1.0, -1.0])
    far = torch.full((2, 2), -3.0)  # the engine thought these tokens unlikely: ratios e^3
    capped = grpo_loss(lp, lp.detach(), far, adv, mask, LossConfig(tis_cap=2.0), num_tokens=8.0)
    off = grpo_loss(lp, lp.detach(), far, adv, mask, LossConfig(tis_cap=None), num_tokens=8.0)
    # ratio 1 everywhere: per token -A * w, summed: (-1 -1 +1 +1) * w = 0 -> check one sample
    one = grpo_loss(lp[:1], lp[:1].detach(), far[:1], adv[:1], mask[:1], LossConfig(tis_cap=2.0), num_tokens=8.0)
    assert float(one.loss.detach()) == pytest.approx(-2 * 2.0 / 8.0)
    assert float(capped.loss.detach()) == pytest.approx(0.0) and float(off.loss.detach()) == pytest.approx(0.0)
    assert tis_weights(lp, far, mask, None).tolist() == [[1.0, 1.0], [1.0, 1.0]]
    with pytest.raises(ValueError, match="tis_cap"):
        LossConfig(tis_cap=0.0)
