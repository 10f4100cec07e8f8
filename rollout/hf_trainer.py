"""A transformers model as the trainer, for the disaggregated launcher and the weight-sync
benchmarks: load it (a checkpoint, or random weights for a config-only dir), take one real
optimizer step on rollouts' NLL (a toy objective, SFT on its own samples, but a real step,
so the weights change and the weight sync has something to carry), and decode greedily with
transformers itself, the reference the engine must match. Knows transformers and
RolloutOutput; nothing of process groups.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from rollout.request import RolloutOutput


def load_trainer_model(model_dir: str, load_format: str, dtype: torch.dtype, device: torch.device, seed: int = 0) -> nn.Module:
    """`AutoModelForCausalLM.from_pretrained(model_dir)`, or for a config-only dir
    (load_format="dummy") the same class with random weights made on the device."""
    from transformers import AutoModelForCausalLM

    if load_format != "dummy":
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    return random_trainer_model(model_dir, str(device), dtype, seed).eval()


def random_trainer_model(model_dir: str, device: str, dtype: torch.dtype, seed: int) -> nn.Module:
    """The HF class of a config-only dir, with random weights made on `device` from `seed`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype)
    # from_config under a device context may leave memory uninitialized (NaN that the
    # engine rightly refuses): fill it like a real checkpoint
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02)
    return model


def rollout_batch(rollouts: Sequence[RolloutOutput], device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded prompt + completion; labels only on the completion (HF shifts them)."""
    seqs = [o.prompt_ids + o.token_ids for o in rollouts]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (o, seq) in enumerate(zip(rollouts, seqs)):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
        labels[i, len(o.prompt_ids) : len(seq)] = torch.tensor(o.token_ids)
    return {k: v.to(device) for k, v in {"input_ids": ids, "attention_mask": mask, "labels": labels}.items()}


def toy_train_step(model: nn.Module, optimizer: torch.optim.Optimizer, rollouts: Sequence[RolloutOutput],
                   device: torch.device) -> float:
    """One optimizer step on the mean NLL of the sampled completions; returns the loss.
    `model` may be DDP-wrapped: its backward all-reduces the gradients, keeping every
    trainer replica identical."""
    if not rollouts or not any(o.token_ids for o in rollouts):
        raise ValueError("toy_train_step: no generated tokens to train on")
    model.train()
    loss = model(**rollout_batch(rollouts, device)).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    return float(loss.detach())


@torch.no_grad()
def hf_greedy(model: nn.Module, prompt: Sequence[int], max_new_tokens: int, device: torch.device) -> list[int]:
    """transformers' own greedy decode, EOS ignored: the reference the engine must match."""
    ids = torch.tensor([list(prompt)], device=device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
