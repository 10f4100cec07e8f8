"""Train-vs-rollout mismatch telemetry: how far the trainer's log-probs of the sampled
tokens are from the engine's, per response token. Named as verl names them:

- training/rollout_probs_diff_{mean,max,std}: |p_trainer - p_rollout| (probabilities, verl);
- training/rollout_logprobs_abs_diff_{mean,max}: |logp_trainer - logp_rollout| (no verl name);
- rollout_corr/kl: mean(logp_rollout - logp_trainer), the direct KL(rollout || trainer) estimate;
- rollout_corr/k3_kl: mean(r - log r - 1) with r = p_trainer / p_rollout (Schulman's K3,
  never negative, lower variance for small KL);
- rollout_corr/rollout_is_{mean,min,max}: the importance ratio r before truncation;
- rollout_corr/rollout_is_ratio_fraction_high: fraction of tokens with r > tis_cap (the
  fraction TIS truncates); ..._fraction_low: r < 1 / tis_cap.

Where engine and trainer compute the same function (float32 on CPU) every number here is
~0 (ratios ~1); a bf16 engine, a kernel bug or a stale weight sync shows up here first.
Inputs are flat: the valid tokens of the whole (global) batch, trainer values pre-update.
"""

from __future__ import annotations

import torch

_LOG_RATIO_BOUND = 20.0


def mismatch_metrics(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                     tis_cap: float | None = 2.0) -> dict[str, float]:
    """trainer_logprobs, rollout_logprobs: 1-D, one entry per response token."""
    if trainer_logprobs.shape != rollout_logprobs.shape or trainer_logprobs.dim() != 1:
        raise ValueError(f"expected two equal 1-D tensors, got {tuple(trainer_logprobs.shape)} "
                         f"and {tuple(rollout_logprobs.shape)}")
    if trainer_logprobs.numel() == 0:
        return {}
    trainer = trainer_logprobs.detach().to(torch.float64)
    rollout = rollout_logprobs.detach().to(torch.float64)
    log_ratio = (trainer - rollout).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)  # log(p_trainer / p_rollout)
    ratio = torch.exp(log_ratio)
    probs_diff = (torch.exp(trainer) - torch.exp(rollout)).abs()
    logprobs_diff = log_ratio.abs()
    metrics = {
        "training/rollout_probs_diff_mean": probs_diff.mean(),
        "training/rollout_probs_diff_max": probs_diff.max(),
        "training/rollout_probs_diff_std": probs_diff.std() if probs_diff.numel() > 1 else torch.zeros(()),
        "training/rollout_logprobs_abs_diff_mean": logprobs_diff.mean(),
        "training/rollout_logprobs_abs_diff_max": logprobs_diff.max(),
        "rollout_corr/kl": (rollout - trainer).mean(),
        "rollout_corr/k3_kl": (ratio - log_ratio - 1.0).mean(),
        "rollout_corr/rollout_is_mean": ratio.mean(),
        "rollout_corr/rollout_is_min": ratio.min(),
        "rollout_corr/rollout_is_max": ratio.max(),
    }
    if tis_cap is not None:
        metrics["rollout_corr/rollout_is_ratio_fraction_high"] = (ratio > tis_cap).to(torch.float64).mean()
        metrics["rollout_corr/rollout_is_ratio_fraction_low"] = (ratio < 1.0 / tis_cap).to(torch.float64).mean()
    return {k: float(v) for k, v in metrics.items()}
