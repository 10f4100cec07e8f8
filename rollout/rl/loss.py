"""The policy loss: PPO's clipped surrogate on per-token log-probs, with truncated
importance sampling (TIS) against the engine that sampled the tokens.

Three policies meet here, per response token t:
- rollout: the engine's log-prob (the behaviour policy; what actually drew the token);
- old: the trainer's log-prob of the same token before this step's update;
- new: the trainer's log-prob now (differentiable).

    ratio_t = exp(new_t - old_t)                                  # PPO ratio
    tis_t   = min(exp(old_t - rollout_t), tis_cap)                # TIS weight, no gradient
    loss_t  = -tis_t * min(ratio_t * A, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A)

The TIS weight corrects for the engine and the trainer computing slightly different
distributions (kernels, precision, a stale version); truncating it at `tis_cap` (verl's
`tis_imp_ratio_cap`, default 2) bounds the variance. With one update per batch, new ==
old at the gradient, so the ratio is 1 and the clip only matters for later mini-batches.

Aggregation is verl's "token-mean": the sum over every response token of the batch divided
by the number of tokens (under data parallelism: of the global batch, see `grpo_loss`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# exp() of a log-ratio beyond this overflows nothing but means the sample is garbage anyway.
_LOG_RATIO_BOUND = 20.0


@dataclass(frozen=True)
class LossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.2  # > clip_low is DAPO's "clip higher"
    tis_cap: float | None = 2.0  # None: no importance correction (pure on-policy assumption)

    def __post_init__(self) -> None:
        if not (self.clip_low > 0 and self.clip_high > 0):
            raise ValueError(f"clip_low={self.clip_low}, clip_high={self.clip_high}: must be > 0")
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ValueError(f"tis_cap={self.tis_cap}: must be > 0 (or None to turn TIS off)")


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable
    pg_clipfrac: float  # fraction of tokens whose ratio was clipped (and the clip was active)
    ppo_kl: float  # mean(old - new): how far this update has moved from the old policy
    tis_weights: torch.Tensor  # [B, R] the truncated weights used (0 on padding)


def tis_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                cap: float | None) -> torch.Tensor:
    """min(pi_old / pi_rollout, cap) per token, 0 on padding; detached."""
    if cap is None:
        return mask.to(torch.float32)
    log_ratio = (old_logprobs.detach() - rollout_logprobs).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    return torch.exp(log_ratio).clamp(max=cap) * mask


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig,
    num_tokens: float | None = None,
) -> LossOutput:
    """All per-token tensors are [B, R] (R: longest response, right-padded); advantages is
    [B] (one per sample, shared by its tokens); mask is 1.0 on response tokens.

    num_tokens: the denominator of the token mean; default mask.sum(). Data-parallel ranks
    pass (global token count / world size), so that DDP's gradient averaging over ranks gives
    exactly the gradient of the global token mean, whatever each rank's share of tokens.
    """
    mask = mask.to(torch.float32)
    denominator = float(mask.sum()) if num_tokens is None else float(num_tokens)
    denominator = max(denominator, 1.0)
    old = old_logprobs.detach()
    log_ratio = (logprobs - old).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    adv = advantages.to(torch.float32)[:, None]
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
    per_token = torch.maximum(unclipped, clipped)
    weights = tis_weights(old, rollout_logprobs, mask, config.tis_cap)
    loss = (per_token * weights * mask).sum() / denominator
    with torch.no_grad():
        valid = mask.sum().clamp(min=1.0)
        clipfrac = float(((clipped > unclipped).float() * mask).sum() / valid)
        ppo_kl = float(((old - logprobs.detach()) * mask).sum() / valid)
    return LossOutput(loss, clipfrac, ppo_kl, weights)
