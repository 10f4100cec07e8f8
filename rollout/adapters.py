"""LoraAdapters: the engine's LoRA calls (load, list, update, unload adapters at runtime).

The work is done by lora/ (parsing and validation in adapter.py, slots in manager.py /
pool.py); this component orders it against the running requests and the prefix cache:

- an adapter's cached KV is keyed by (adapter, version), so an update or an unload drops
  that adapter's entries only, and a request never reuses KV of another adapter, of the
  base model, or of an older version of its own adapter;
- an update is atomic: every tensor is validated before any is written (for several
  adapters in one call: every tensor of all of them, the values with one host sync), and
  the requests running under those adapters are paused first (`pause_mode`, as for
  update_weights), so no token is computed half with the old adapter and half with the new;
- unloading an adapter that requests (running or waiting) use is refused: abort them or
  let them finish first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rollout.validate import check_pause_mode, check_str, named_tensor_list

if TYPE_CHECKING:
    from lora.flat import FlatLoraAdapter
    from lora.manager import LoraAdapterInfo, LoraManager
    from rollout.cache.manager import KVManager
    from rollout.core.hooks import Speculation
    from rollout.core.pause import Pause
    from rollout.model.config import ModelConfig
    from rollout.scheduler import Scheduler


class LoraAdapters:
    """`lora`: the engine's LoraManager (None: LoRA is off, and every call says how to turn it
    on). `speculation()`: speculative decoding's hook, told of an adapter update (a drafter's
    history may no longer match the policy); looked up per update (benchmarks swap it)."""

    def __init__(self, lora: LoraManager | None, model_config: ModelConfig, kv: KVManager, scheduler: Scheduler,
                 pause: Pause, speculation: Callable[[], Speculation]) -> None:
        self.lora = lora
        self.model_config = model_config
        self.kv = kv
        self.scheduler = scheduler
        self.pause = pause
        self.speculation = speculation

    def manager(self) -> LoraManager:
        if self.lora is None:
            raise ValueError("LoRA is off for this engine: EngineConfig(enable_lora=True, max_loras_per_batch=..., "
                             "max_lora_rank=...) turns it on")
        return self.lora

    def load(self, name: str, path: str | Path | None = None, *,
             tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | None = None,
             config: Mapping[str, Any] | None = None) -> LoraAdapterInfo:
        from lora.adapter import LoraAdapterConfig, load_adapter_dir, parse_adapter

        manager = self.manager()
        check_str(name, "name")
        if (path is None) == (tensors is None):
            raise ValueError("load_lora_adapter takes a PEFT directory (path) or tensors= with config=, not both")
        if path is not None:
            if config is not None:
                raise ValueError("load_lora_adapter: config= goes with tensors=; a directory has its own adapter_config.json")
            config, tensors = load_adapter_dir(path)
        elif config is None:
            raise ValueError("load_lora_adapter(tensors=...) needs config= (a LoraConfig-style dict)")
        assert tensors is not None  # a directory's, or given (checked above)
        if name in manager.adapters:
            raise ValueError(f"lora_name={name!r}: an adapter of that name is loaded; unload it or use update_lora_adapter")
        parsed = LoraAdapterConfig.from_dict(config, max_rank=manager.max_rank)
        weights = parse_adapter(parsed, tensors, self.model_config)
        manager.add(name, parsed, weights)
        return next(i for i in manager.info() if i.name == name)

    def loaded(self) -> list[LoraAdapterInfo]:
        return self.manager().info()

    def update(self, updates: Mapping[str, Iterable[tuple[str, torch.Tensor]] | FlatLoraAdapter], *,
               pause_mode: str = "retract") -> dict[str, int]:
        """Every adapter's update validated (names, shapes, then every value with one host sync
        in all) before any is written; returns each new version."""
        from lora.flat import FlatLoraAdapter

        manager = self.manager()
        check_pause_mode(pause_mode)
        if not isinstance(updates, Mapping) or not updates:
            raise ValueError("update_lora_adapters: expected a non-empty {adapter name: tensors} mapping")
        # the whole of every stream, even if refused below (a transport must be read to its end)
        streams = {name: t if isinstance(t, FlatLoraAdapter) else named_tensor_list(t) for name, t in updates.items()}
        for name in streams:
            check_str(name, "lora_name")
            if name not in manager.adapters:
                raise ValueError(f"update_lora_adapter: lora_name={name!r} is not loaded "
                                 f"(loaded: {sorted(manager.adapters)})")
        planned = [(name, manager.plan_update(name, stream)) for name, stream in streams.items()]
        manager.check_values(planned)
        self.pause(pause_mode, lambda req: req.lora_name in streams)
        versions = {name: manager.apply_update(name, update) for name, update in planned}
        speculation = self.speculation()
        for name in versions:
            self.kv.drop_adapter(name)
            speculation.policy_changed(name)
        for req in self.scheduler.waiting:
            if req.lora_name in versions:
                req.lora_version = versions[req.lora_name]
        return versions

    def unload(self, name: str) -> None:
        manager = self.manager()
        if name not in manager.adapters:
            raise ValueError(f"unload_lora_adapter: lora_name={name!r} is not loaded (loaded: {sorted(manager.adapters)})")
        self.pause.drain()  # tokens in flight: read them first
        sched = self.scheduler
        users = [r.rid for r in (*sched.running, *sched.waiting) if r.lora_name == name]
        if users:
            raise ValueError(f"unload_lora_adapter: adapter {name!r} is used by {len(users)} request(s) "
                             f"(e.g. {users[:3]}); abort them or let them finish first")
        self.kv.drop_adapter(name)
        manager.remove(name)
