"""Trainer -> engine weight transfer, engine-agnostic.

The engine side ends in one call: `engine.update_weights(named_tensors, full=...)` with
Hugging Face parameter names. Each transport turns its wire format back into that
(name, tensor) stream; the trainer side walks a model and pushes through a transport.
See weightsync/README.md for who calls what.
"""

from __future__ import annotations

from weightsync.bucket import DEFAULT_BUCKET_BYTES, BucketEntry, BucketMeta, pack_buckets, unpack_bucket
from weightsync.trainer import WeightSyncSender, iter_hf_weights
from weightsync.transports import (
    BroadcastSender,
    InProcessSender,
    SafetensorsDirSender,
    SendStats,
    WeightGroup,
    WeightSyncError,
    close_group,
    iter_safetensors_dir,
    open_group,
    receive,
    save_safetensors_dir,
)

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "BroadcastSender",
    "BucketEntry",
    "BucketMeta",
    "InProcessSender",
    "SafetensorsDirSender",
    "SendStats",
    "WeightGroup",
    "WeightSyncError",
    "WeightSyncSender",
    "close_group",
    "iter_hf_weights",
    "iter_safetensors_dir",
    "open_group",
    "pack_buckets",
    "receive",
    "save_safetensors_dir",
    "unpack_bucket",
]
