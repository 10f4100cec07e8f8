"""Transports: trainer-side senders and engine-side receivers, one module each.

| transport      | trainer side            | engine side                                  |
| -------------- | ----------------------- | -------------------------------------------- |
| in-process     | InProcessSender(engine) | (calls engine.update_weights directly)       |
| broadcast      | BroadcastSender(group)  | receive(group, device) -> (name, tensor)...  |
| CUDA IPC       | CudaIpcSender(endpoint) | CudaIpcReceiver(endpoint).serve_once(apply)  |
| safetensors    | SafetensorsDirSender    | iter_safetensors_dir(path)                   |

`group` comes from open_group(...) on every rank. CUDA IPC names load lazily so that
importing this package does not require pyzmq.
"""

from __future__ import annotations

from typing import Any

from weightsync.transports.base import SendStats, SupportsUpdateWeights, WeightSender, WeightSyncError
from weightsync.transports.broadcast import BroadcastSender, receive
from weightsync.transports.disk import SafetensorsDirSender, iter_safetensors_dir, save_safetensors_dir
from weightsync.transports.group import WeightGroup, close_group, open_group
from weightsync.transports.inprocess import InProcessSender

_CUDA_IPC_NAMES = ("CudaIpcSender", "CudaIpcReceiver", "export_handle", "import_handle")

__all__ = [
    "BroadcastSender",
    "InProcessSender",
    "SafetensorsDirSender",
    "SendStats",
    "SupportsUpdateWeights",
    "WeightGroup",
    "WeightSender",
    "WeightSyncError",
    "close_group",
    "iter_safetensors_dir",
    "open_group",
    "receive",
    "save_safetensors_dir",
    *_CUDA_IPC_NAMES,
]


def __getattr__(name: str) -> Any:
    if name in _CUDA_IPC_NAMES:
        from weightsync.transports import cuda_ipc

        return getattr(cuda_ipc, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
