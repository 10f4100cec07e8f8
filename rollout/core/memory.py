"""Sleep and wake: give the engine's device memory back to a colocated trainer, then take it
again, in stages.

Tags (what wake() restores, in this order):
  "weights"   model parameters and buffers. sleep(level=1) keeps a copy in pinned host memory
              (allocated at the first sleep and reused, so cycles do not grow host memory);
              level=2 drops the parameters (the trainer's next full sync refills them; buffers
              such as rope tables are not trained and always keep their host copy).
  "kv_cache"  the KV pool, the LoRA slots, the attention backend's workspace and the decode
              CUDA graphs (recaptured: they bake the new buffers' addresses in).

Released tensors keep their identity (their `.data` is swapped for an empty tensor and back),
so everything that holds a reference (hooks, the scheduler's pools) stays valid; objects that
bake addresses in (graphs, attention plans) are rebuilt. After a release the caching allocator
is emptied, so the memory goes back to the device, not to torch's cache.

Knows the engine's parts; does not decide when to sleep (the trainer does) or what happens to
requests (the engine retracts them first: their KV is gone, their tokens are kept).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

log = logging.getLogger("rollout")
TAGS = ("weights", "kv_cache")


@dataclass
class SleepStats:
    """What the last sleep released and the last wake restored, in bytes per tag, and how long
    each stage took."""

    level: int = 0  # 0: awake
    released_bytes: dict[str, int] = field(default_factory=dict)
    restored_bytes: dict[str, int] = field(default_factory=dict)
    wake_seconds: dict[str, float] = field(default_factory=dict)
    sleeps: int = 0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _release(t: torch.Tensor) -> int:
    """Free a tensor's storage, keeping the tensor object (and its shape on the side)."""
    n = _nbytes(t)
    t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    return n


class MemorySaver:
    def __init__(self, model: nn.Module, kv_tensors: list[torch.Tensor], lora_tensors: list[torch.Tensor],
                 device: torch.device, draft: nn.Module | None = None, draft_kv: list[torch.Tensor] | None = None) -> None:
        self.model = model
        # a draft model sleeps with the target, but level 2 keeps its host copy: the trainer
        # may not own (or sync) the draft, so nothing else could refill it
        self.draft = draft
        self.device = device
        self.kv_tensors = [*kv_tensors, *(draft_kv or [])]  # KV pool buffers and LoRA slot buffers: re-made as zeros
        self.lora_tensors = lora_tensors
        self.stats = SleepStats()
        self.asleep: set[str] = set()  # tags released and not yet restored
        self.weights_discarded = False  # level 2: until a full weight update refills them
        self._host: dict[str, torch.Tensor] = {}  # name -> host copy (pinned on CUDA), reused across cycles
        self._shapes: dict[int, torch.Size] = {}  # id(tensor) -> its shape while released

    # ---- sleep ------------------------------------------------------------------------
    @property
    def can_step(self) -> bool:
        """Does a step run anything: weights and KV resident, and the weights not discarded."""
        return not (self.asleep or self.weights_discarded)

    def release_weights(self, level: int) -> int:
        freed = 0
        for name, t, is_param in self._model_tensors():
            self._shapes[id(t)] = t.shape
            if level == 1 or not is_param:
                host = self._host.get(name)
                if host is None or host.shape != t.shape or host.dtype != t.dtype:
                    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.device.type == "cuda")
                    self._host[name] = host
                host.copy_(t.data, non_blocking=True)
            elif name in self._host:  # a level-2 sleep after a level-1 one: drop the stale copy
                del self._host[name]
        self._sync()  # the copies must land before the device memory is freed
        for _, t, _ in self._model_tensors():
            freed += _release(t)
        self.weights_discarded = level == 2
        self.asleep.add("weights")
        self.stats.released_bytes["weights"] = freed
        return freed

    def release_kv(self) -> int:
        freed = 0
        for t in (*self.kv_tensors, *self.lora_tensors):
            self._shapes[id(t)] = t.shape
            freed += _release(t)
        self.asleep.add("kv_cache")
        self.stats.released_bytes["kv_cache"] = freed
        return freed

    def empty_cache(self) -> None:
        gc.collect()  # graphs, plans and workspaces just dropped: free them before emptying the cache
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    # ---- wake -------------------------------------------------------------------------
    def restore_weights(self) -> int:
        start = time.perf_counter()
        restored = 0
        for name, t, is_param in self._model_tensors():
            shape = self._shapes.pop(id(t))
            host = self._host.get(name)
            if host is not None and not (is_param and self.weights_discarded):
                t.data = host.to(self.device, non_blocking=True)
            else:  # level 2: zeros until the trainer's sync (a step refuses to run on them)
                t.data = torch.zeros(shape, dtype=t.dtype, device=self.device)
            restored += _nbytes(t)
        self._sync()
        self.asleep.discard("weights")
        self.stats.restored_bytes["weights"] = restored
        self.stats.wake_seconds["weights"] = time.perf_counter() - start
        return restored

    def restore_kv(self) -> int:
        restored = 0
        for t in (*self.kv_tensors, *self.lora_tensors):
            # zeros, not empty: padded reads of the KV pool must see finite values
            t.data = torch.zeros(self._shapes.pop(id(t)), dtype=t.dtype, device=self.device)
            restored += _nbytes(t)
        self.asleep.discard("kv_cache")
        self.stats.restored_bytes["kv_cache"] = restored
        return restored

    # ---- helpers ------------------------------------------------------------------------
    def _model_tensors(self) -> Iterator[tuple[str, torch.Tensor, bool]]:
        """(name, tensor, may level 2 discard it): the target's parameters may be discarded."""
        for name, p in self.model.named_parameters():
            yield name, p, True
        for name, b in self.model.named_buffers():
            yield "buffer:" + name, b, False
        if self.draft is not None:
            for name, t in (*self.draft.named_parameters(), *self.draft.named_buffers()):
                yield "draft:" + name, t, False

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
