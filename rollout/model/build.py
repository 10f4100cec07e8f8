"""The model object: built in its dtype on its device, and random weights for
`load_format="dummy"` (benchmarks of large shapes with no checkpoint). Checkpoint and live
weights go through `loader.py`."""

from __future__ import annotations

import torch

from rollout.distributed.tp import SINGLE, TensorParallel
from rollout.kernels.options import DEFAULT_OPTIONS, KernelOptions
from rollout.model.config import ModelConfig
from rollout.model.llama import LlamaModel


def build_model(cfg: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device,
                tp: TensorParallel = SINGLE, options: KernelOptions = DEFAULT_OPTIONS) -> LlamaModel:
    """The model (with `tp`: this rank's shard of it), weights uninitialized; `options`: the
    kernels its layers launch."""
    # Build directly in the target dtype on the target device: an 8B model built in fp32
    # on the CPU first would cost 32 GB and minutes.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaModel(cfg, max_positions, tp, options)
    finally:
        torch.set_default_dtype(previous)
    # rope tables stay float32 whatever the weights are
    model.rotary.to(torch.float32)
    return model.eval()


@torch.no_grad()
def init_random_weights(model: LlamaModel, seed: int) -> None:
    """Random weights (std 0.02, norms at 1), drawn on the model's device."""
    gen = torch.Generator(device=model.embed_tokens.weight.device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, 0.02, generator=gen)
