"""WeightSync: new weights into the serving engine, in place, from any transport.

Every transport ends in `update`: (HF name, tensor) pairs from the caller, a private
torch.distributed group the trainer broadcasts into (NCCL on GPU, gloo on CPU), CUDA IPC
buckets from a trainer process on the same GPU, or a safetensors directory. With a
`lora_name` a transport's stream goes to one adapter instead (LoraAdapters.update).

An update is atomic: every write is planned and validated (rollout/model/loader.py: names,
shapes, dtypes, finiteness; under TP every rank agrees) before the affected requests are
paused and anything is written, so a bad update raises and the old weights keep serving.
Then the prefix cache is flushed (its KV was made by the old weights) and the version goes up.

Owns the weight version and the weight-sync group. Knows the model and the draft model, the
KV manager (to flush), the memory saver (weights asleep or discarded change what an update
may be) and the pause; not the step loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rollout.model.loader import WeightWrite, apply_writes, plan_writes
from rollout.validate import check_bool, check_float, check_int, check_pause_mode, check_str, named_tensor_list

if TYPE_CHECKING:
    from torch import nn

    from rollout.adapters import LoraAdapters
    from rollout.cache.manager import KVManager
    from rollout.core.hooks import Speculation
    from rollout.core.memory import MemorySaver
    from rollout.core.pause import Pause
    from rollout.distributed.tp import TensorParallel
    from speculative.draft_runner import DraftRunner
    from weightsync.transports.group import WeightGroup

Stream = Iterable[tuple[str, torch.Tensor]]


class WeightSync:
    """`speculation()`: speculative decoding's hook, told of a policy change and of a draft
    model's sync; looked up per update (benchmarks swap the engine's)."""

    def __init__(self, model: nn.Module, draft: DraftRunner | None, tp: TensorParallel, device: torch.device,
                 kv: KVManager, memory: MemorySaver, pause: Pause, adapters: LoraAdapters,
                 speculation: Callable[[], Speculation]) -> None:
        self.model = model
        self.draft = draft
        self.tp = tp
        self.device = device
        self.kv = kv
        self.memory = memory
        self.pause = pause
        self.adapters = adapters
        self.speculation = speculation
        self.version = 0  # the policy's weight version: every output carries the one(s) that made it
        self.group: WeightGroup | None = None

    # ---- the update ---------------------------------------------------------------------
    def update(self, named_tensors: Stream, *, full: bool = False, pause_mode: str = "retract",
               target: str = "model") -> int:
        check_bool(full, "full")
        check_pause_mode(pause_mode)
        if "weights" in self.memory.asleep:
            raise RuntimeError("update_weights: the weights are asleep; wake(['weights']) first")
        if self.memory.weights_discarded and not full:
            raise ValueError("update_weights: sleep(level=2) discarded the weights; the next update must be full=True")
        # every TP rank takes the stream and validates its shard, then all write or none does
        # (a rank whose stream or shard fails makes every rank refuse: TensorParallel.agree)
        writes, draft_writes = self.tp.agree(lambda: self._plan(named_tensors, full, target), "update_weights")
        if writes is not None:
            self.pause(pause_mode)
        if draft_writes is not None:  # between steps the draft holds no step's work: no pause
            apply_writes(draft_writes)
        if writes is not None:
            apply_writes(writes)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        speculation = self.speculation()
        if writes is not None:
            self.kv.flush()
            speculation.policy_changed()
            self.memory.weights_discarded = False
            self.version += 1
        if draft_writes is not None:
            speculation.draft_updated(self.version)
        return self.version

    def _plan(self, named_tensors: Stream, full: bool, target: str) -> tuple[list[WeightWrite] | None,
                                                                            list[WeightWrite] | None]:
        """(the target's writes, the draft's), all validated; None where nothing goes."""
        pairs, draft_pairs = self._split_draft(named_tensor_list(named_tensors), target)
        draft_writes = None
        if draft_pairs:
            assert self.draft is not None  # _split_draft refuses draft tensors without a draft model
            draft_writes = self.draft.plan_update(draft_pairs, full)
        writes = plan_writes(self.model, pairs, full=full) if pairs or draft_writes is None else None
        return writes, draft_writes

    def _split_draft(self, pairs: list, target: str) -> tuple[list, list]:
        """(the target's tensors, the draft's): by `target`, or by the "draft." name prefix."""
        if target not in ("model", "draft"):
            raise ValueError(f"update_weights: target={target!r}: expected 'model' or 'draft'")
        if target == "draft":
            mine, draft = [], pairs
        else:
            mine = [(n, t) for n, t in pairs if not n.startswith("draft.")]
            draft = [(n[len("draft."):], t) for n, t in pairs if n.startswith("draft.")]
        if draft and self.draft is None:
            raise ValueError(f"update_weights: {'target=' + repr(target) if target == 'draft' else repr(pairs[0][0])}"
                             " names the draft model, and this engine has none (speculative='draft')")
        if target == "draft" and not draft:
            raise ValueError("update_weights(target='draft'): no tensors given")
        return mine, draft

    def applier(self, lora_name: str | None, full: bool, pause_mode: str,
                target: str = "model") -> Callable[[Stream], int]:
        """Where a received stream goes: the base weights (or the draft model's, `target=
        "draft"`), or (LoRA-only sync: the trainer sends `iter_hf_weights(peft_model,
        adapter_only=True)`, a few MB) one adapter."""
        if target not in ("model", "draft"):
            raise ValueError(f"target={target!r}: expected 'model' or 'draft'")
        if lora_name is None:
            return lambda stream: self.update(stream, full=full, pause_mode=pause_mode, target=target)
        if target != "model":
            raise ValueError("lora_name and target='draft' together: an adapter belongs to the target model")
        check_str(lora_name, "lora_name")
        adapter: str = lora_name
        return lambda stream: self.adapters.update({adapter: stream}, pause_mode=pause_mode)[adapter]

    # ---- transports ---------------------------------------------------------------------
    def init_group(self, master_addr: str, master_port: int, rank_offset: int, world_size: int,
                   backend: str = "gloo", *, timeout_s: float = 300.0, join_timeout_s: float | None = None) -> None:
        from weightsync.transports.group import open_group

        if self.group is not None:
            raise RuntimeError("a weight-sync group is already open; destroy_weight_sync_group() first")
        check_str(master_addr, "master_addr")
        check_int(master_port, "master_port", min=1, max=65535)
        check_int(world_size, "world_size", min=2)
        # rank 0 is the trainer (it hosts the rendezvous): an engine there would wait for itself
        check_int(rank_offset, "rank_offset", min=1, max=world_size - 1)
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend={backend!r}: expected 'gloo' or 'nccl'")
        if backend == "nccl" and self.device.type != "cuda":
            raise ValueError(f"backend='nccl' needs a CUDA engine; this one is on {self.device} (use 'gloo')")
        for name, value in (("timeout_s", timeout_s), ("join_timeout_s", join_timeout_s)):
            if value is not None and check_float(value, name) <= 0:
                raise ValueError(f"{name}={value}: must be > 0")
        device = self.device if backend == "nccl" else None
        self.group = open_group(master_addr, master_port, rank_offset, world_size, backend=backend,
                                timeout_s=timeout_s, join_timeout_s=join_timeout_s, device=device)

    def update_from_distributed(self, *, full: bool = True, pause_mode: str = "retract",
                                lora_name: str | None = None, target: str = "model") -> int:
        from weightsync.transports.broadcast import receive

        if self.group is None:
            raise RuntimeError("no weight-sync group: call init_weight_sync_group() first")
        apply = self.applier(lora_name, full, pause_mode, target)
        return apply(receive(self.group, device=self.device))

    def destroy_group(self) -> None:
        from weightsync.transports.group import close_group

        if self.group is not None:
            group, self.group = self.group, None
            close_group(group)

    def update_from_ipc(self, endpoint: str, *, full: bool = True, pause_mode: str = "retract",
                        timeout_s: float = 300.0, lora_name: str | None = None, target: str = "model") -> int:
        from weightsync.transports.cuda_ipc import CudaIpcReceiver

        check_str(endpoint, "endpoint")
        apply = self.applier(lora_name, full, pause_mode, target)
        receiver = CudaIpcReceiver(endpoint, device=self.device, timeout_s=timeout_s)
        try:
            return receiver.serve_once(apply)
        finally:
            receiver.close()

    def update_from_disk(self, path: str | Path, *, full: bool = True, pause_mode: str = "retract",
                         lora_name: str | None = None, target: str = "model") -> int:
        from rollout.model.loader import iter_checkpoint

        if not isinstance(path, (str, Path)) or not Path(path).is_dir():
            raise ValueError(f"update_weights_from_disk: path={path!r} is not a directory")
        apply = self.applier(lora_name, full, pause_mode, target)
        if lora_name is not None:
            from lora.adapter import load_adapter_dir

            _, tensors = load_adapter_dir(path)
            return apply(tensors.items() if isinstance(tensors, dict) else tensors)
        return apply(iter_checkpoint(path))
