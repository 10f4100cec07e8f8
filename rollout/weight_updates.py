"""The engine's side of live weight sync: every transport ends in Engine.update_weights.

A mixin so that engine.py keeps the step loop and this file keeps the transports: a
private torch.distributed group (NCCL on GPU, gloo on CPU) the trainer broadcasts into,
CUDA IPC buckets from a trainer process on the same GPU, and a safetensors directory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from rollout.validate import check_float, check_int, check_str

if TYPE_CHECKING:
    from weightsync.transports.group import WeightGroup


class WeightUpdatesMixin:
    """Needs `self.update_weights(named_tensors, full=, pause_mode=)` and `self.device`."""

    _sync_group: WeightGroup | None = None

    def init_weight_sync_group(
        self,
        master_addr: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        backend: str = "gloo",
        *,
        timeout_s: float = 300.0,
        join_timeout_s: float | None = None,
    ) -> None:
        """Join the trainer's weight-sync group as rank `rank_offset` (the trainer is rank 0).
        Every rank calls this with the same address; it returns once all have joined."""
        from weightsync.transports.group import open_group

        if self._sync_group is not None:
            raise RuntimeError("a weight-sync group is already open; destroy_weight_sync_group() first")
        check_str(master_addr, "master_addr")
        check_int(master_port, "master_port", min=1, max=65535)
        check_int(world_size, "world_size", min=2)
        # rank 0 is the trainer (it hosts the rendezvous): an engine there would wait for itself
        check_int(rank_offset, "rank_offset", min=1, max=world_size - 1)
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend={backend!r}: expected 'gloo' or 'nccl'")
        if backend == "nccl" and self.device.type != "cuda":  # type: ignore[attr-defined]
            raise ValueError(f"backend='nccl' needs a CUDA engine; this one is on {self.device} (use 'gloo')")  # type: ignore[attr-defined]
        for name, value in (("timeout_s", timeout_s), ("join_timeout_s", join_timeout_s)):
            if value is not None and check_float(value, name) <= 0:
                raise ValueError(f"{name}={value}: must be > 0")
        device = self.device if backend == "nccl" else None  # type: ignore[attr-defined]
        self._sync_group = open_group(master_addr, master_port, rank_offset, world_size, backend=backend,
                                      timeout_s=timeout_s, join_timeout_s=join_timeout_s, device=device)

    def update_applier(self, lora_name: str | None, full: bool, pause_mode: str,
                      target: str = "model") -> Callable[[Iterable], int]:
        """Where a received stream goes: the base weights (or the draft model's, `target=
        "draft"`), or (LoRA-only sync: the trainer sends `iter_hf_weights(peft_model,
        adapter_only=True)`, a few MB) one adapter."""
        if target not in ("model", "draft"):
            raise ValueError(f"target={target!r}: expected 'model' or 'draft'")
        if lora_name is None:
            return lambda stream: self.update_weights(stream, full=full, pause_mode=pause_mode, target=target)  # type: ignore[attr-defined]
        if target != "model":
            raise ValueError("lora_name and target='draft' together: an adapter belongs to the target model")
        check_str(lora_name, "lora_name")
        return lambda stream: self.update_lora_adapter(lora_name, stream, pause_mode=pause_mode)  # type: ignore[attr-defined]

    def update_weights_from_distributed(self, *, full: bool = True, pause_mode: str = "retract",
                                        lora_name: str | None = None, target: str = "model") -> int:
        """Receive one broadcast update from the trainer (it calls BroadcastSender.send)."""
        from weightsync.transports.broadcast import receive

        if self._sync_group is None:
            raise RuntimeError("no weight-sync group: call init_weight_sync_group() first")
        apply = self.update_applier(lora_name, full, pause_mode, target)
        return apply(receive(self._sync_group, device=self.device))  # type: ignore[attr-defined]

    def destroy_weight_sync_group(self) -> None:
        from weightsync.transports.group import close_group

        if self._sync_group is not None:
            group, self._sync_group = self._sync_group, None
            close_group(group)

    def update_weights_from_ipc(self, endpoint: str, *, full: bool = True, pause_mode: str = "retract",
                                timeout_s: float = 300.0, lora_name: str | None = None, target: str = "model") -> int:
        """Serve one CUDA IPC update on `endpoint` (loopback tcp or ipc://); the trainer's
        CudaIpcSender.send() returns the new version or raises with the engine's error."""
        from weightsync.transports.cuda_ipc import CudaIpcReceiver

        check_str(endpoint, "endpoint")
        apply = self.update_applier(lora_name, full, pause_mode, target)
        receiver = CudaIpcReceiver(endpoint, device=self.device, timeout_s=timeout_s)  # type: ignore[attr-defined]
        try:
            return receiver.serve_once(apply)
        finally:
            receiver.close()

    def update_weights_from_disk(self, path: str | Path, *, full: bool = True, pause_mode: str = "retract",
                                 lora_name: str | None = None, target: str = "model") -> int:
        """Load an update from a safetensors directory (with or without an index), or with
        `lora_name` an adapter's new tensors from a PEFT directory (save_pretrained)."""
        from rollout.model.loader import iter_checkpoint

        if not isinstance(path, (str, Path)) or not Path(path).is_dir():
            raise ValueError(f"update_weights_from_disk: path={path!r} is not a directory")
        apply = self.update_applier(lora_name, full, pause_mode, target)
        if lora_name is not None:
            from lora.adapter import load_adapter_dir

            _, tensors = load_adapter_dir(path)
            return apply(tensors.items() if isinstance(tensors, dict) else tensors)
        return apply(iter_checkpoint(path))
