"""For the CUDA IPC protocol tests: the CUDA-only calls (export/import/release handle) replaced
by an in-process registry that counts every IPC reference, and small serving helpers.
Imported by test modules (fixtures included); kept out of test collection by its name.
"""

from __future__ import annotations

import ctypes
import gc
import threading
import warnings
import weakref

import pytest
import torch
from _weightsync_helpers import FakeEngine
from rollout.distributed.ports import free_port

from weightsync.bucket import BucketMeta, pack_buckets
from weightsync.transports import cuda_ipc_handles
from weightsync.transports.cuda_ipc import CudaIpcReceiver, release_ipc_endpoint
from weightsync.transports.ipc_wire import (
    CudaIpcHandle,
)



def _handle(**overrides) -> CudaIpcHandle:
    fields = dict(
        device_index=0,
        device_uuid="GPU-1234",
        storage_handle=b"\x01" * 64,
        storage_size_bytes=1 << 20,
        storage_offset_bytes=512,
        ref_counter_handle=b"/torch_123_456",
        ref_counter_offset=3,
        event_handle=b"\x02" * 64,
        event_sync_required=True,
        tensor_offset=256,
        nbytes=4096,
    )
    return CudaIpcHandle(**(fields | overrides))


def _meta(total_bytes: int = 4096) -> BucketMeta:
    (meta, _), = list(pack_buckets([("w", torch.zeros(total_bytes // 4))], 1 << 20))
    return meta



class FakeIpc:
    """export/import/release as an in-process registry, with torch's reference counting.

    Each export holds one reference on the trainer's memory; the engine gives it back by
    unmapping (the fake mapping dies with its last view, as torch's storage deleter does)
    or by release_handle. A reference given back twice is an error; one never given back
    is a leak (`assert_balanced`).
    """

    def __init__(self) -> None:
        self.storages: dict[bytes, torch.UntypedStorage] = {}
        self.exported: list[int] = []  # data_ptr of each export's storage
        self.imported: list[int] = []  # export id of each import
        self.released: list[bytes] = []  # storage handles given back unmapped
        self.references: dict[int, int] = {}  # export id -> references outstanding
        self.errors: list[str] = []

    def export(self, buffer: torch.Tensor) -> CudaIpcHandle:
        storage = buffer.untyped_storage()
        key = storage.data_ptr().to_bytes(8, "little")
        self.storages[key] = storage  # like torch's limbo: the memory outlives the trainer's use
        export_id = len(self.exported)
        self.exported.append(storage.data_ptr())
        self.references[export_id] = 1
        return CudaIpcHandle(
            device_index=0, device_uuid="", storage_handle=key, storage_size_bytes=storage.nbytes(),
            storage_offset_bytes=0, ref_counter_handle=b"/fake", ref_counter_offset=export_id,
            event_handle=None, event_sync_required=False, tensor_offset=buffer.storage_offset(), nbytes=buffer.numel(),
        )  # fmt: skip

    def import_(self, handle: CudaIpcHandle) -> torch.Tensor:
        export_id = handle.ref_counter_offset
        if self.references.get(export_id, 0) <= 0:
            self.errors.append(f"export {export_id} mapped after its reference was given back")
        self.imported.append(export_id)
        storage = self.storages[handle.storage_handle]
        raw = (ctypes.c_uint8 * max(handle.nbytes, 1)).from_address(storage.data_ptr() + handle.tensor_offset)
        weakref.finalize(raw, self._unref, export_id)  # unmapped when the last view goes
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.frombuffer(raw, dtype=torch.uint8)[: handle.nbytes]

    def release(self, handle: CudaIpcHandle) -> None:
        self.released.append(handle.storage_handle)
        self._unref(handle.ref_counter_offset)

    def _unref(self, export_id: int) -> None:
        self.references[export_id] -= 1
        if self.references[export_id] < 0:
            self.errors.append(f"export {export_id} given back twice")

    def outstanding(self) -> dict[int, int]:
        gc.collect()
        return {export_id: count for export_id, count in self.references.items() if count}

    def assert_balanced(self) -> None:
        release_ipc_endpoint()
        assert self.outstanding() == {} and self.errors == []


@pytest.fixture
def cpu_ipc(monkeypatch):
    """Make export/import/release a FakeIpc and let 'CUDA' be the CPU."""
    fake = FakeIpc()
    monkeypatch.setattr(cuda_ipc_handles, "export_handle", fake.export)
    monkeypatch.setattr(cuda_ipc_handles, "import_handle", fake.import_)
    monkeypatch.setattr(cuda_ipc_handles, "release_handle", fake.release)
    monkeypatch.setattr(cuda_ipc_handles, "resolve_cuda_device", lambda device: torch.device("cpu"))
    yield fake
    release_ipc_endpoint()
    assert fake.errors == []


def _serve(receiver: CudaIpcReceiver, engine: FakeEngine, outcomes: list) -> None:
    try:
        outcomes.append(receiver.serve_once(lambda stream: engine.update_weights(stream, full=True)))
    except Exception as error:
        outcomes.append(error)


def _serving(receiver: CudaIpcReceiver, engine: FakeEngine) -> tuple[threading.Thread, list]:
    outcomes: list = []
    thread = threading.Thread(target=_serve, args=(receiver, engine, outcomes))
    thread.start()
    return thread, outcomes


def _endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def _model(seed: int) -> list[tuple[str, torch.Tensor]]:
    """A small mixed-dtype state dict, different per seed."""
    generator = torch.Generator().manual_seed(seed)
    weights = [(f"layers.{i}.weight", torch.randn(16, 8, generator=generator)) for i in range(6)]
    weights.append(("norm.weight", torch.randn(7, generator=generator).bfloat16()))
    weights.append(("step", torch.tensor(seed)))
    return weights
