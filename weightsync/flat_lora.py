"""Trainer side of a flat LoRA-only sync: the adapter's parameters live in ONE buffer.

`flat_lora_parameters(peft_model)` moves the active adapter's lora_A / lora_B parameters
into one flat buffer, laid out in the engine's canonical order (lora/flat.py), and returns
it as a `FlatLoraAdapter`. The parameters stay the same objects and become views of that
buffer, so it always holds their current values: after each optimizer step,
`engine.update_lora_adapter(name, flat)` sends the adapter as it is, with no per-tensor
work on either side (the engine checks the layout once, then copies a dozen runs).

Call it once, before the optimizer is built and before wrapping the model (DDP): optimizer
state is keyed by the parameter objects, which do not change, but a wrapper that took
views of the old storage would keep them. Plain (unsharded) parameters of one dtype and
device only; FSDP-sharded models send by name (`iter_hf_weights(model, adapter_only=True)`).
"""

from __future__ import annotations

import torch
from torch import nn

from lora.flat import FlatLoraAdapter
from weightsync.trainer import iter_hf_weights

__all__ = ["flat_lora_parameters"]


@torch.no_grad()
def flat_lora_parameters(model: nn.Module) -> FlatLoraAdapter:
    """Re-point the active LoRA adapter's parameters into one flat buffer; returns it."""
    named = list(iter_hf_weights(model, adapter_only=True))  # refuses what the engine cannot serve
    owners = {(p.data_ptr(), tuple(p.shape)): p for p in model.parameters()}
    params = []
    for name, tensor in named:
        parameter = owners.get((tensor.data_ptr(), tuple(tensor.shape)))
        if parameter is None:
            raise ValueError(f"flat_lora_parameters: {name!r} is not a plain parameter of the model (sharded or "
                             "gathered); send the adapter by name: iter_hf_weights(model, adapter_only=True)")
        params.append(parameter)
    kinds = {(p.dtype, p.device) for p in params}
    if len(kinds) != 1:
        raise ValueError(f"flat_lora_parameters: the adapter's parameters must share one dtype and device, got "
                         f"{sorted(str(k) for k in kinds)}")
    flat = FlatLoraAdapter.pack(named)
    views = dict(flat.named_tensors())
    for (name, _), parameter in zip(named, params):
        parameter.data = views[name]
    return flat
