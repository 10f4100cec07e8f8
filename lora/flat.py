"""A LoRA adapter as ONE flat buffer, laid out as the engine's device slot holds it.

A slot (lora/pool.py) keeps, per engine module, every layer's lora_A and lora_B of one
adapter back to back, so one HF module's lora_A over a run of consecutive layers is one
strided region of the slot. An adapter stacked the same way -- per (HF module, A or B), its
layers back to back -- moves between a trainer's buffer, the host copy and a slot in one
copy per (module, A|B, run of layers): 14 for an adapter on all seven modules of every
layer, instead of one per tensor (448 for Llama-3-8B). That is what makes a LoRA-only sync
cheap on the host: the per-tensor Python work and multi-tensor launches of an update by
name become a dozen copies, one finiteness check per adapter, and layout checks done once
per layout.

Canonical order: HF modules in decoder order (q, k, v, o, gate, up, down), lora_A before
lora_B, layers ascending. Each tensor is stored whole (lora_A [r, in], lora_B [out, r],
row-major), unscaled, in the buffer's dtype. Any other layout is accepted too (the engine
merges what it can into runs); this one gives the fewest copies.

Trainer side: `FlatLoraAdapter.pack(named_tensors)` copies a PEFT state dict in (one
`torch.cat`), or `weightsync.flat_lora_parameters(peft_model)` re-points the model's own
LoRA parameters into a flat buffer once, so every later sync sends it as is.

Pure torch and PEFT names: nothing of slots, devices, or the model's shapes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from lora.config import TARGET_MODULES

__all__ = ["FlatLayout", "FlatLoraAdapter", "Run", "canonical_key", "parse_peft_name", "plan_runs"]

_NAME = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<module>\w+)"
    r"\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$"
)
_MODULE_ORDER = {module: i for i, module in enumerate(TARGET_MODULES)}
_UNKNOWN = (len(TARGET_MODULES), 0, 0)  # names the engine will refuse sort last


def parse_peft_name(name: str) -> tuple[int, str, str] | None:
    """(layer, HF module, "A"|"B") of a PEFT LoRA tensor name, or None (the engine's parser,
    lora/adapter.py, says why a name is refused)."""
    m = _NAME.match(name)
    if m is None or m["module"] not in _MODULE_ORDER:
        return None
    return int(m["layer"]), m["module"], m["which"]


def canonical_key(layer: int, module: str, which: str) -> tuple[int, int, int]:
    return _MODULE_ORDER[module], which == "B", layer


def _name_key(name: str) -> tuple[tuple[int, int, int], str]:
    parsed = parse_peft_name(name)
    return (_UNKNOWN if parsed is None else canonical_key(*parsed)), name


@dataclass(frozen=True)
class FlatLayout:
    """Where each tensor of a flat adapter lies: `names[i]` is the [rows, cols] matrix at
    elements `offsets[i] : offsets[i] + rows * cols` of the buffer. Immutable: a trainer
    that sends the same layout every step lets the engine validate it once."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, int], ...]
    offsets: tuple[int, ...]
    numel: int  # elements the buffer holds at least

    @classmethod
    def canonical(cls, named_shapes: Iterable[tuple[str, Sequence[int]]]) -> FlatLayout:
        """The tensors packed densely in canonical order."""
        items = sorted(((name, tuple(int(d) for d in shape)) for name, shape in named_shapes),
                       key=lambda item: _name_key(item[0]))
        offsets, total = [], 0
        for _, shape in items:
            if len(shape) != 2:
                raise ValueError(f"flat LoRA adapter: {_first(items, shape)!r} has shape {shape}; LoRA weights are "
                                 "2-D (lora_A [r, in], lora_B [out, r])")
            offsets.append(total)
            total += shape[0] * shape[1]
        return cls(tuple(n for n, _ in items), tuple(s for _, s in items), tuple(offsets), total)

    def __len__(self) -> int:
        return len(self.names)


def _first(items: list[tuple[str, tuple[int, ...]]], shape: tuple[int, ...]) -> str:
    return next(name for name, s in items if s == shape)


@dataclass(frozen=True)
class FlatLoraAdapter:
    """A LoRA adapter's tensors in one 1-D buffer (any floating dtype, any device), by
    `layout`. `engine.update_lora_adapter(name, flat)` takes it whole."""

    buffer: torch.Tensor
    layout: FlatLayout

    @classmethod
    def pack(cls, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *,
             dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> FlatLoraAdapter:
        """Copy PEFT-named tensors into a new flat buffer in canonical order (one cat).
        dtype / device default to the first tensor's."""
        items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
        if not items:
            raise ValueError("flat LoRA adapter: no tensors to pack")
        for name, tensor in items:
            if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                raise ValueError(f"flat LoRA adapter: {name!r} is not a floating-point tensor")
        layout = FlatLayout.canonical((name, tensor.shape) for name, tensor in items)
        by_name = dict(items)
        first = items[0][1]
        dtype, device = dtype or first.dtype, torch.device(device) if device is not None else first.device
        buffer = torch.cat([by_name[name].detach().reshape(-1).to(device=device, dtype=dtype) for name in layout.names])
        return cls(buffer, layout)

    def view(self, name: str) -> torch.Tensor:
        """The tensor `name` as a [rows, cols] view of the buffer (writes go through)."""
        i = self.layout.names.index(name)
        (rows, cols), off = self.layout.shapes[i], self.layout.offsets[i]
        return self.buffer[off : off + rows * cols].view(rows, cols)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(name, view) pairs, for consumers that take tensors by name (the TP engine, the
        engine process's client)."""
        buf = self.buffer
        return [(name, buf[off : off + rows * cols].view(rows, cols))
                for name, (rows, cols), off in zip(self.layout.names, self.layout.shapes, self.layout.offsets)]


@dataclass(frozen=True)
class Run:
    """`num_layers` consecutive layers' lora_{which} of one HF module, stored back to back
    from element `offset` of a flat buffer: a [num_layers, rows, cols] block."""

    module: str  # HF module name
    which: str  # "A" or "B"
    first_layer: int
    num_layers: int
    rows: int
    cols: int
    offset: int

    @property
    def numel(self) -> int:
        return self.num_layers * self.rows * self.cols

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        """[num_layers, rows, cols] of a 1-D buffer."""
        return buffer[self.offset : self.offset + self.numel].view(self.num_layers, self.rows, self.cols)


def plan_runs(entries: Iterable[tuple[int, str, str, int, int, int]]) -> list[Run]:
    """Merge (layer, module, which, offset, rows, cols) entries into runs: an entry joins the
    previous run when it is the same module's next layer with the same matrix shape and
    starts where the run ends in the buffer. Entries in canonical order make one run per
    (module, A|B, stretch of consecutive layers)."""
    runs: list[Run] = []
    for layer, module, which, offset, rows, cols in entries:
        last = runs[-1] if runs else None
        if (last is not None and last.module == module and last.which == which and last.rows == rows
                and last.cols == cols and layer == last.first_layer + last.num_layers
                and offset == last.offset + last.numel):
            runs[-1] = Run(module, which, last.first_layer, last.num_layers + 1, rows, cols, last.offset)
        else:
            runs.append(Run(module, which, layer, 1, rows, cols, offset))
    return runs
