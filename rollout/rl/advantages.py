"""GRPO's group-normalized advantages: each sample's reward against the other samples of
the same prompt, so no value model is needed.

    A_i = (r_i - mean(r_group)) / (std(r_group) + eps)

std is the unbiased (n - 1) one, as torch.std, verl's GRPO estimator and TRL use. A group
whose samples all got the same reward has A = 0 for every sample: it teaches nothing.
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6, scale: bool = True) -> torch.Tensor:
    """rewards: [num_groups, group_size] -> advantages of the same shape (float32).

    scale=False gives Dr. GRPO's mean-only centring (no division by the std)."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards: expected [num_groups, group_size], got shape {tuple(rewards.shape)}")
    if rewards.shape[1] < 2:
        raise ValueError("group_advantages: a group needs at least 2 samples (n >= 2)")
    rewards = rewards.to(torch.float32)
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale:
        return centred
    return centred / (rewards.std(dim=1, keepdim=True) + eps)
