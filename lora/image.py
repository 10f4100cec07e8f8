"""HostImage: a loaded adapter's host copy, laid out as its device slot is.

One flat buffer (pinned on CUDA) in the model's dtype, with lora_B * scaling folded in, in
the canonical order of lora/flat.py: per (HF module, A|B) its layers back to back. A slot
is filled from it, and read back into it, in one copy per run (lora.flat.Run: 14 for an
adapter on every module of every layer); updates by name write single tensors through
`modules`, views of the same buffer.

Knows the adapter's tensors and their layout; nothing of slots or devices beyond pinning.
"""

from __future__ import annotations

import torch

from lora.adapter import LoraWeights, adapter_tensor_name
from lora.flat import FlatLayout, Run, plan_runs

__all__ = ["EngineAdapter", "HostImage"]

# (layer, HF module name) -> (lora_A [rank, in], lora_B * scaling [out, rank]), model dtype
EngineAdapter = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


class HostImage:
    def __init__(self, weights: LoraWeights, dtype: torch.dtype, pin: bool) -> None:
        keys = {adapter_tensor_name(layer, module, which): (layer, module, which)
                for layer, module in weights.modules for which in "AB"}
        shapes = {name: weights.modules[layer, module][which == "B"].shape for name, (layer, module, which) in keys.items()}
        layout = FlatLayout.canonical(shapes.items())
        self.buffer = torch.empty(layout.numel, dtype=dtype, pin_memory=pin)
        self.rank = weights.rank
        # (layer, module, which) -> element offset of that matrix in the buffer
        self.offsets: dict[tuple[int, str, str], int] = {}
        entries = []
        for name, (rows, cols), offset in zip(layout.names, layout.shapes, layout.offsets):
            key = keys[name]
            self.offsets[key] = offset
            entries.append((*key, offset, rows, cols))
        self.runs: list[Run] = plan_runs(entries)
        self.modules: EngineAdapter = {}
        with torch.no_grad():
            for (layer, module), (a, b) in weights.modules.items():
                a_view, b_view = self._matrix(layer, module, "A", a.shape), self._matrix(layer, module, "B", b.shape)
                a_view.copy_(a)
                b_view.copy_(b * weights.scaling)  # scaled in its incoming dtype, rounded once by the copy
                self.modules[layer, module] = (a_view, b_view)

    def _matrix(self, layer: int, module: str, which: str, shape: torch.Size) -> torch.Tensor:
        offset = self.offsets[layer, module, which]
        return self.buffer[offset : offset + shape[0] * shape[1]].view(shape[0], shape[1])

    def run_view(self, run: Run) -> torch.Tensor | None:
        """[num_layers, rows, cols] of this image where `run` (a run of some other buffer)
        lands, or None when its layers are not back to back here (then write by name)."""
        offset = self.offsets.get((run.first_layer, run.module, run.which))
        last = self.offsets.get((run.first_layer + run.num_layers - 1, run.module, run.which))
        if offset is None or last != offset + (run.num_layers - 1) * run.rows * run.cols:
            return None
        return self.buffer[offset : offset + run.numel].view(run.num_layers, run.rows, run.cols)

    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()
