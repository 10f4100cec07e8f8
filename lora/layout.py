"""Where each LoRA target sits in the engine's model: the engine fuses q/k/v into one
`qkv_proj` and gate/up into `gate_up_proj`, so an adapter on q_proj is slice 0 of
qkv_proj's LoRA, k_proj slice 1, and so on. Under tensor parallelism a rank holds its
shard of each module (rollout/model/parallel.py), so the shapes here are per rank.
Knows shapes (from ModelConfig), nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollout.model.config import ModelConfig

# HF module name -> (engine module, slice index within it)
HF_TO_ENGINE: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
ENGINE_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# split by input columns under TP (the others by output rows)
ROW_PARALLEL = frozenset({"o_proj", "down_proj"})


@dataclass(frozen=True)
class ModuleShape:
    name: str  # engine module
    in_features: int
    slice_widths: tuple[int, ...]  # output columns of each slice, in order

    @property
    def num_slices(self) -> int:
        return len(self.slice_widths)

    @property
    def out_features(self) -> int:
        return sum(self.slice_widths)

    @property
    def slice_offsets(self) -> tuple[int, ...]:
        offsets = [0]
        for w in self.slice_widths:
            offsets.append(offsets[-1] + w)
        return tuple(offsets)


def module_shapes(cfg: ModelConfig, tp_size: int = 1) -> dict[str, ModuleShape]:
    """Each engine module's shape on one of `tp_size` ranks."""
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size // tp_size, cfg.q_size // tp_size, cfg.kv_size // tp_size
    return {
        "qkv_proj": ModuleShape("qkv_proj", h, (q, kv, kv)),
        "o_proj": ModuleShape("o_proj", q, (h,)),
        "gate_up_proj": ModuleShape("gate_up_proj", h, (i, i)),
        "down_proj": ModuleShape("down_proj", i, (h,)),
    }


def engine_modules_for(targets: tuple[str, ...] | frozenset[str]) -> list[str]:
    """The engine modules that need LoRA buffers for these HF targets, in model order."""
    wanted = {HF_TO_ENGINE[t][0] for t in targets}
    return [m for m in ENGINE_MODULES if m in wanted]
