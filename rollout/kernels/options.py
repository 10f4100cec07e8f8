"""KernelOptions: which kernels an engine launches and how, chosen once when it is built.

The defaults are the engine's choices (BENCHMARKS.md has the measurements behind each);
`EngineConfig.kernel_options` replaces them, for benchmarks that compare two choices in one
process and for tests that run the GPU's Triton kernels on CPU tensors under
TRITON_INTERPRET=1. core/build.py hands the one object to everything that launches a kernel
(the model's layers, the KV pool, the attention backend, the runner, the LoRA pool, the draft
model), each reading the fields it needs from the object it was built with: a decode CUDA
graph is captured with the options of its engine, and two engines in one process may differ.

`None` in a field means the engine's own default, which lives beside the code that uses it
(e.g. lora/pool.py's DEFER_MAX_ROWS) with the measurement that chose it. The environment
variables ROLLOUT_PDL, ROLLOUT_LORA_PDL and ROLLOUT_LORA_TRITON give the defaults of their
fields, read when an options object is made.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

from rollout.kernels.batch_invariant_tiles import TileConfig

__all__ = ["DEFAULT_OPTIONS", "KernelOptions"]


def _env_on(name: str) -> bool:
    """A default-on switch: off when the variable is 0 or false."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false")


def _env_either(name: str) -> bool | None:
    """1/true, 0/false, or unset (None: automatic)."""
    return {"1": True, "true": True, "0": False, "false": False}.get(os.environ.get(name, "").strip().lower())


@dataclass(frozen=True)
class KernelOptions:
    # ---- where the Triton kernels run. None: on CUDA tensors (the torch ops elsewhere, their
    # reference); True: on CPU tensors too, under TRITON_INTERPRET=1 (tests); False: the torch
    # ops on the GPU too.
    fused: bool | None = None  # rollout/kernels: norms, rotary, KV store and copy, GEMV, race, finite check
    lora_triton: bool | None = field(default_factory=lambda: _env_either("ROLLOUT_LORA_TRITON"))  # lora/kernels
    deterministic_triton: bool | None = None  # the deterministic mode's matmul and attention
    # ---- a batch-1 decode step (rollout/kernels/__init__.py)
    skinny_matmul: bool = True  # one row through the skinny GEMV; False: cuBLAS
    silu_epilogue: bool = True  # SiLU-mul in the gate_up GEMV's launch; False: a launch of its own
    rope_epilogue: bool = True  # the rotary and the K/V store in the qkv GEMV's launch; False: apart
    # the rotary stores the new K/V (attention/base.py kv_target); False: a launch of its own
    rotary_kv_store: bool = True
    # ---- programmatic dependent launch (rollout/kernels/pdl.py), where the GPU has it
    pdl: bool = field(default_factory=lambda: _env_on("ROLLOUT_PDL"))  # every kernel of rollout/
    pdl_rotary_attention: bool = True  # ... the rotary and the Triton decode attention too
    lora_pdl: bool = field(default_factory=lambda: _env_on("ROLLOUT_LORA_PDL"))  # the SGMV expand
    # ---- attention: decode graphs of up to this many rows attend with Triton under `auto`
    # (rollout/attention/__init__.py SMALL_DECODE_ROWS)
    small_decode_rows: int | None = None
    # ---- the deterministic matmul's tiles, one fixed config for every shape (its benchmark's
    # candidates, tests); None: chosen per shape (batch_invariant.config_for)
    batch_invariant_tiles: TileConfig | None = None
    # ---- multi-LoRA (lora/pool.py, lora/kernels/sgmv.py)
    lora_split_k: int | None = None  # shrink's split-K; None: from the shapes (tiling.py)
    lora_expand_block_n: int | None = None  # expand's column block (a power of 2 >= 16)
    lora_defer_max_rows: int | None = None  # deltas deferred to the next kernel up to these rows (0: never)
    lora_concurrent_max_rows: int | None = None  # shrinks on a side stream up to these rows
    lora_one_row_epilogue: bool = True  # one row: the adapter's term in the base GEMV's epilogue
    lora_defer_eager: bool = False  # defer outside graphs too, on one stream (tests, on CPU)
    # ---- step layouts (rollout/model/runner.py, speculative/draft_runner.py)
    verify_rows_max: int | None = None  # verify steps as decode rows up to these rows (0: never)
    extend_rows_kv: int | None = None  # prefill chunks as decode rows within this KV budget (0: never)
    draft_rows_max: int | None = None  # the draft model's forwards as decode rows up to these rows

    def __post_init__(self) -> None:
        for f in fields(self):  # by the annotation (a string: `from __future__ import annotations`)
            value = getattr(self, f.name)
            name = f"KernelOptions.{f.name}={value!r}"
            if f.type == "bool" and not isinstance(value, bool):
                raise ValueError(f"{name}: expected True or False")
            if f.type == "bool | None" and value is not None and not isinstance(value, bool):
                raise ValueError(f"{name}: expected None, True or False")
            if f.type == "int | None" and value is not None and (
                    isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name}: expected None or an int >= 0")
        for name in ("lora_split_k", "lora_expand_block_n", "small_decode_rows"):
            if getattr(self, name) == 0:
                raise ValueError(f"KernelOptions.{name}=0: expected None or an int >= 1")
        block_n = self.lora_expand_block_n
        if block_n is not None and (block_n < 16 or block_n & (block_n - 1)):
            raise ValueError(f"KernelOptions.lora_expand_block_n={block_n}: expected a power of 2 >= 16")
        if self.batch_invariant_tiles is not None:
            if not isinstance(self.batch_invariant_tiles, TileConfig):
                raise ValueError(f"KernelOptions.batch_invariant_tiles={self.batch_invariant_tiles!r}: expected a "
                                 "rollout.kernels.batch_invariant_tiles.TileConfig or None")


    @classmethod
    def from_dict(cls, values: dict) -> KernelOptions:
        """From `dataclasses.asdict` of one (a config sent as JSON)."""
        tiles = values.get("batch_invariant_tiles")
        if isinstance(tiles, dict):
            values = {**values, "batch_invariant_tiles": TileConfig(**tiles)}
        return cls(**values)


# What a kernel call made outside an engine (tests, kernel benchmarks) runs with.
DEFAULT_OPTIONS = KernelOptions()
