"""LoraManager: the one owner of where adapters live. Loaded adapters have a host copy
(pinned, in the model's dtype, lora_B with its scaling folded in); the ones running requests
use sit in device slots of the LoraPool. Invariants:

- a slot holds at most one adapter, and an adapter at most one slot;
- a slot whose adapter some running request uses (refs > 0) is never replaced; among the
  others the least recently used is replaced first when a new adapter needs a slot;
- an adapter's current values are in its slot when it has one, else in its host copy: an
  update of a resident adapter writes the slot only (a few MB per step, no device->host
  copy) and marks the host copy stale; it is read back before the slot is given away.

Host copies are laid out as the slots are (lora/image.py), so filling a slot, reading one
back and a flat update (lora/flat.py) are one copy per run of layers, not per tensor.

The scheduler asks `can_acquire` / `acquire` / `release` per request; the engine's LoRA
API (rollout/adapters.py) adds, updates and removes adapters.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from lora.adapter import LoraAdapterConfig, LoraWeights
from lora.flat import FlatLoraAdapter
from lora.image import HostImage
from lora.pool import LoraPool
from lora.update import FlatUpdate, Update, check_finite, plan_flat_update, plan_named_update
from rollout.model.config import ModelConfig
from rollout.request import Req


@dataclass
class AdapterEntry:
    name: str
    config: LoraAdapterConfig
    weights: LoraWeights  # as loaded: updates are validated (names, shapes) against it, never written to it
    host: HostImage  # what a slot is filled from
    version: int = 0
    host_stale: bool = False  # the slot holds newer values than `host`


@dataclass(frozen=True)
class LoraAdapterInfo:
    name: str
    rank: int
    alpha: float
    scaling: float
    target_modules: tuple[str, ...]
    version: int
    slot: int | None  # device slot, None when only the host copy exists


class LoraManager:
    def __init__(self, pool: LoraPool, model_config: ModelConfig, dtype: torch.dtype, max_rank: int,
                 max_loaded: int | None) -> None:
        self.pool = pool
        self.model_config = model_config
        self.dtype = dtype
        self.max_rank = max_rank
        self.max_loaded = max_loaded
        self.adapters: dict[str, AdapterEntry] = {}
        n = pool.num_slots
        self.slot_owner: list[str | None] = [None] * n
        self.slot_refs = [0] * n
        self._slot_used = [0] * n  # last-use clock, for LRU replacement
        self._clock = itertools.count(1)
        self._pin = pool.device.type == "cuda"

    # ---- adapters -----------------------------------------------------------------------
    def add(self, name: str, config: LoraAdapterConfig, weights: LoraWeights) -> AdapterEntry:
        if name in self.adapters:
            raise ValueError(f"lora_name={name!r}: an adapter of that name is loaded; unload it or use update_lora_adapter")
        if self.max_loaded is not None and len(self.adapters) >= self.max_loaded:
            raise ValueError(f"cannot load {name!r}: max_loaded_loras={self.max_loaded} adapters are loaded; unload one first")
        outside = sorted(set(config.target_modules) - self.pool.targets)
        if outside:
            raise ValueError(f"adapter {name!r}: target_modules {outside} are outside the engine's "
                             f"lora_target_modules {sorted(self.pool.targets)} (EngineConfig.lora_target_modules)")
        entry = AdapterEntry(name, config, weights, HostImage(weights, self.dtype, self._pin))
        self.adapters[name] = entry
        return entry

    def remove(self, name: str) -> None:
        """Forget an adapter (the caller has checked no request uses it)."""
        slot = self.slot_of(name)
        if slot is not None:
            assert self.slot_refs[slot] == 0, "remove: adapter still in use"
            self.slot_owner[slot] = None
            self.pool.clear(slot)
        del self.adapters[name]

    def plan_update(self, name: str, tensors: Iterable[tuple[str, torch.Tensor]] | FlatLoraAdapter) -> Update:
        """Validate names and shapes of an update of one adapter (by name, or one flat
        buffer); the values are checked by `check_values`, still before any write."""
        weights = self.adapters[name].weights
        if isinstance(tensors, FlatLoraAdapter):
            return plan_flat_update(weights, tensors, self.model_config)
        return plan_named_update(weights, tensors, self.model_config)

    @staticmethod
    def check_values(updates: list[tuple[str, Update]]) -> None:
        """NaN/Inf anywhere in these planned updates raises (one host sync for all of them)."""
        check_finite(updates)

    @torch.no_grad()
    def apply_update(self, name: str, update: Update) -> int:
        """Write a validated update: into the slot when resident (the host copy goes stale
        until the slot is given away), else into the host copy. Returns the new version."""
        entry = self.adapters[name]
        slot = self.slot_of(name)
        rank, scale = entry.config.r, entry.config.scaling
        if isinstance(update, FlatUpdate):
            buffer = update.flat.buffer
            if slot is not None:
                self.pool.write_runs(slot, list(update.runs), buffer, rank, scale)
                entry.host_stale = True
            else:
                for run in update.runs:
                    _write_run_to_host(entry.host, run, buffer, scale)
        elif slot is not None:
            self.pool.write_named(slot, update.keys, update.tensors, rank, scale)
            entry.host_stale = True
        else:
            for (layer, module, which), value in zip(update.keys, update.tensors):
                a, b = entry.host.modules[layer, module]
                if which == "A":
                    a.copy_(value)
                else:
                    b.copy_(value * scale)
        entry.version += 1
        return entry.version

    def info(self) -> list[LoraAdapterInfo]:
        return [
            LoraAdapterInfo(e.name, e.config.r, e.config.lora_alpha, e.config.scaling,
                            tuple(sorted(e.config.target_modules)), e.version, self.slot_of(e.name))
            for e in self.adapters.values()
        ]

    # ---- slots ------------------------------------------------------------------------
    def slot_of(self, name: str) -> int | None:
        try:
            return self.slot_owner.index(name)
        except ValueError:
            return None

    def can_acquire(self, name: str) -> bool:
        return name in self.slot_owner or any(r == 0 for r in self.slot_refs)

    def acquire(self, req: Req) -> None:
        """Give a request admitted under an adapter its slot (loading the adapter into the
        least recently used free slot if it is not resident). Call can_acquire first."""
        name = req.lora_name
        assert name is not None
        slot = self.slot_of(name)
        if slot is None:
            slot = self._free_slot()
            entry = self.adapters[name]
            self.pool.write(slot, entry.host)
            self.slot_owner[slot] = name
        self.slot_refs[slot] += 1
        self._slot_used[slot] = next(self._clock)
        req.lora_slot = slot

    def release(self, req: Req) -> None:
        if req.lora_slot < 0:
            return
        self.slot_refs[req.lora_slot] -= 1
        self._slot_used[req.lora_slot] = next(self._clock)
        req.lora_slot = -1

    def evict_all(self) -> None:
        """Empty every slot (the engine is going to sleep; no request holds one): slots with
        the only current copy of an adapter are read back into its host copy first."""
        for slot, name in enumerate(self.slot_owner):
            if name is None:
                continue
            assert self.slot_refs[slot] == 0, "evict_all: a slot is still in use"
            entry = self.adapters[name]
            if entry.host_stale:
                self.pool.read(slot, entry.host)
                entry.host_stale = False
            self.slot_owner[slot] = None
        self.pool.release_views()

    def device_tensors(self) -> list[torch.Tensor]:
        """Every device buffer of the slots (released while the engine sleeps; `rebind`
        after they are re-made)."""
        return self.pool.device_tensors()

    def rebind(self) -> None:
        """The slots' buffers were re-made (wake): point the per-layer views at them."""
        self.pool.bind_views()

    def _free_slot(self) -> int:
        empty = [s for s, owner in enumerate(self.slot_owner) if owner is None]
        if empty:
            return empty[0]
        idle = [s for s, refs in enumerate(self.slot_refs) if refs == 0]
        if not idle:
            raise RuntimeError("LoRA: no slot free (can_acquire was not asked)")
        slot = min(idle, key=self._slot_used.__getitem__)
        owner = self.adapters[self.slot_owner[slot]]  # type: ignore[index]
        if owner.host_stale:  # the slot has the only current copy: read it back first
            self.pool.read(slot, owner.host)
            owner.host_stale = False
        self.slot_owner[slot] = None
        return slot


def _write_run_to_host(host: HostImage, run, buffer: torch.Tensor, scale: float) -> None:
    """A flat update's run into a host copy (the adapter has no slot): one copy, B scaled."""
    src = run.view(buffer)
    dst = host.run_view(run)
    if dst is None:  # not back to back in the host copy: matrix by matrix
        for k in range(run.num_layers):
            a, b = host.modules[run.first_layer + k, run.module]
            (a if run.which == "A" else b).copy_(src[k] if run.which == "A" else src[k] * scale)
        return
    if run.which == "A":
        dst.copy_(src)
    else:
        torch.mul(src.to(dst.device), scale, out=dst)
