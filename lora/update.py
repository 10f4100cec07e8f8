"""The plan phase of an adapter update, by name or as one flat buffer, for one adapter or
many at once: every name, shape and dtype is checked here, and `check_finite` then checks
the values of every update of a call with one host sync in all, before anything is written
(LoraManager.apply_update writes).

By name (`plan_adapter_update`, lora/adapter.py): PEFT state-dict names and tensors, any
subset of the adapter's. Flat (`plan_flat_update`): a FlatLoraAdapter (lora/flat.py), whose
layout is validated once per adapter and layout -- a trainer sends the same layout every
step -- and then costs one identity check; the buffer itself is checked on every call
(1-D, contiguous, floating, large enough).

Pure CPU logic over names and shapes, plus the one reduction over the values.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lora.adapter import LoraWeights, _items, loaded_pair, plan_update_keys
from lora.flat import FlatLayout, FlatLoraAdapter, Run, plan_runs
from rollout.kernels import first_non_finite
from rollout.model.config import ModelConfig
from rollout.validate import is_int

__all__ = ["FlatPlan", "FlatUpdate", "NamedUpdate", "check_finite", "plan_flat_layout", "plan_flat_update",
           "plan_named_update"]


@dataclass
class NamedUpdate:
    names: tuple[str, ...]
    keys: list[tuple[int, str, str]]  # (layer, HF module, "A"|"B") of each tensor; reused across repeats
    tensors: list[torch.Tensor]

    def values(self) -> list[tuple[str, torch.Tensor]]:
        """(tensor name, tensor) of every value to check."""
        return list(zip(self.names, self.tensors))


@dataclass(frozen=True)
class FlatPlan:
    """A validated layout for one adapter: the runs to copy, in buffer order, and the
    layout's name of each layer of each run (to name a bad tensor)."""

    layout: FlatLayout
    runs: tuple[Run, ...]
    run_names: tuple[tuple[str, ...], ...]


@dataclass
class FlatUpdate:
    flat: FlatLoraAdapter
    plan: FlatPlan

    @property
    def runs(self) -> tuple[Run, ...]:
        return self.plan.runs

    def values(self) -> list[tuple[str, torch.Tensor]]:
        """One [num_layers, rows, cols] view per run; a bad one is named by `bad_name`."""
        buffer = self.flat.buffer
        return [(names[0], run.view(buffer)) for run, names in zip(self.plan.runs, self.plan.run_names)]

    def bad_name(self, index: int) -> str:
        """The layout's name of the first non-finite matrix of run `index` (an error path)."""
        view = self.plan.runs[index].view(self.flat.buffer)
        for k, name in enumerate(self.plan.run_names[index]):
            if not bool(torch.isfinite(view[k]).all()):
                return name
        return self.plan.run_names[index][0]


Update = NamedUpdate | FlatUpdate


def plan_named_update(weights: LoraWeights, named_tensors: Iterable[tuple[str, torch.Tensor]],
                      model: ModelConfig) -> NamedUpdate:
    """Names and shapes checked (lora.adapter.plan_update_keys); values not yet (check_finite)."""
    return NamedUpdate(*plan_update_keys(weights, _items(named_tensors), model))


def plan_flat_update(weights: LoraWeights, flat: Any, model: ModelConfig) -> FlatUpdate:
    if not isinstance(flat, FlatLoraAdapter):
        raise ValueError(f"flat LoRA update: expected a FlatLoraAdapter, got {type(flat).__name__}")
    layout, buffer = flat.layout, flat.buffer
    if not isinstance(buffer, torch.Tensor) or buffer.dim() != 1 or not buffer.is_floating_point():
        what = f"{buffer.dtype} {tuple(buffer.shape)}" if isinstance(buffer, torch.Tensor) else type(buffer).__name__
        raise ValueError(f"flat LoRA update: buffer must be a 1-D floating-point tensor, got {what}")
    if buffer.numel() > 1 and buffer.stride(0) != 1:
        raise ValueError(f"flat LoRA update: buffer must be contiguous, got stride {buffer.stride()}")
    last = weights.last_flat
    if last is not None and (layout is last.layout or layout == last.layout):
        plan = last  # the same layout as last time: a trainer's every step
    else:
        plan = plan_flat_layout(weights, layout, model)
        weights.last_flat = plan
    if buffer.numel() < plan.layout.numel:
        raise ValueError(f"flat LoRA update: buffer has {buffer.numel()} elements, its layout needs "
                         f"{plan.layout.numel}")
    return FlatUpdate(flat, plan)


def plan_flat_layout(weights: LoraWeights, layout: Any, model: ModelConfig) -> FlatPlan:
    """Validate a flat layout against a loaded adapter: every name one of its tensors (any
    subset, each at most once), with its loaded shape, inside `layout.numel`, no two
    overlapping. Raises ValueError naming the first bad entry."""
    if not isinstance(layout, FlatLayout):
        raise ValueError(f"flat LoRA update: layout must be a FlatLayout, got {type(layout).__name__}")
    names, shapes, offsets = layout.names, layout.shapes, layout.offsets
    if not (isinstance(names, tuple) and isinstance(shapes, tuple) and isinstance(offsets, tuple)
            and len(names) == len(shapes) == len(offsets) and names):
        raise ValueError("flat LoRA update: layout.names, .shapes and .offsets must be non-empty tuples of one length")
    if not is_int(layout.numel) or layout.numel < 0:
        raise ValueError(f"flat LoRA update: layout.numel={layout.numel!r} must be an int >= 0")
    seen: dict[tuple[int, str, str], str] = {}
    entries: list[tuple[int, int, str, str, int, int, str]] = []
    for name, shape, offset in zip(names, shapes, offsets):
        layer, module, which, pair = loaded_pair(weights, name, model)
        parsed = (layer, module, which)
        want = tuple(pair[which == "B"].shape)
        if not (isinstance(shape, tuple) and all(is_int(d) for d in shape) and tuple(shape) == want):
            raise ValueError(f"adapter tensor {name!r}: shape {shape!r} in the flat layout does not match the loaded "
                             f"lora_{which} {want}")
        rows, cols = want
        if not is_int(offset) or offset < 0 or offset + rows * cols > layout.numel:
            raise ValueError(f"adapter tensor {name!r}: offset {offset!r} + {rows * cols} elements lies outside the "
                             f"flat layout's {layout.numel}")
        if parsed in seen:
            raise ValueError(f"adapter tensor {name!r}: given twice in one update (also as {seen[parsed]!r})")
        seen[parsed] = name
        entries.append((int(offset), layer, module, which, rows, cols, name))
    entries.sort()  # buffer order
    for (off, *_, rows, cols, name), (next_off, *_, next_name) in zip(entries, entries[1:]):
        if off + rows * cols > next_off:
            raise ValueError(f"adapter tensors {name!r} and {next_name!r} overlap in the flat layout")
    runs = plan_runs((layer, module, which, off, rows, cols) for off, layer, module, which, rows, cols, _ in entries)
    run_names, i = [], 0
    for run in runs:
        run_names.append(tuple(e[-1] for e in entries[i : i + run.num_layers]))
        i += run.num_layers
    return FlatPlan(layout, tuple(runs), tuple(run_names))


def check_finite(updates: Sequence[tuple[str, Update]]) -> None:
    """NaN/Inf in any value of any of these (adapter name, update)s raises a ValueError naming
    the adapter and the tensor. One multi-tensor max-abs and one host sync per (device,
    dtype) of the values, for all the updates together."""
    spans, values = [], []
    for adapter, update in updates:
        named = update.values()
        spans.append((adapter, update, len(values), len(named)))
        values.extend(named)
    bad = first_non_finite([tensor for _, tensor in values])
    if bad is None:
        return
    for adapter, update, start, count in spans:
        if start <= bad < start + count:
            name = update.bad_name(bad - start) if isinstance(update, FlatUpdate) else values[bad][0]
            raise ValueError(f"adapter {adapter!r}: adapter tensor {name!r} has non-finite values (NaN or Inf)")
    raise AssertionError("unreachable")
