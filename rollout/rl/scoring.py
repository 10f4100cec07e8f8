"""Trainer-side scoring: the log-prob of each response token under the training model.

This is the number the engine's log-probs must agree with (float32 on CPU: to ~1e-5), and
the differentiable input of the policy loss. Logits are cast to float32 before the
log-softmax whatever the model's dtype, as verl and TRL do, and divided by the sampling
temperature: the engine's "processed" log-probs are those of the tempered distribution
(with top-p / top-k off, which GRPO sampling uses, that is all the processing there is).
"""

from __future__ import annotations

import torch
from torch import nn

from rollout.rl.batch import TrainBatch


def response_logprobs(model: nn.Module, batch: TrainBatch, temperature: float = 1.0) -> torch.Tensor:
    """[B, R] float32 log-probs of batch.response_ids (zeros on padding). Differentiable
    when grad is enabled. `model` may be wrapped (DDP, PEFT)."""
    if not temperature > 0:
        raise ValueError(f"temperature={temperature}: trainer log-probs need a temperature > 0")
    keep = batch.logits_to_keep
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                logits_to_keep=keep, use_cache=False)
    logits = out.logits[:, -keep:]  # [X, keep, V]: column j is position P - 1 + j
    logits = logits[batch.source_row[:, None], batch.predict_index].float()  # [B, R, V]
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, batch.response_ids[..., None]).squeeze(-1)  # [B, R]
    return (picked - torch.logsumexp(logits, dim=-1)) * batch.response_mask
