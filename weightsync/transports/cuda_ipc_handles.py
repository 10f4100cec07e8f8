"""CUDA IPC handle utilities, shared by the trainer side and the engine side.

Exporting a buffer's handle (trainer), mapping one (engine), giving an unmapped handle's
reference back (either), plus the device checks and small helpers both sides use. The
protocol and its memory rules are described in cuda_ipc.py; the wire format in ipc_wire.py.

The sender and receiver modules call these through this module's attributes
(`ipc.export_handle(...)`), so replacing one here (tests fake CUDA that way) affects both.
"""

from __future__ import annotations

import torch
import zmq

from weightsync.transports.base import WeightSyncError
from weightsync.transports.ipc_wire import CudaIpcHandle


def export_handle(buffer: torch.Tensor) -> CudaIpcHandle:
    """CUDA IPC handle for a 1-D uint8 CUDA tensor (its bytes must be final: see send())."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    if buffer.device.type != "cuda" or buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError(f"export_handle needs a contiguous 1-D uint8 CUDA tensor, got {buffer.dtype} on {buffer.device}")
    rebuild, args = reduce_tensor(buffer)
    # reduce_tensor's argument tuple is positional; pin its shape so a torch change fails here.
    if rebuild is not rebuild_cuda_tensor or len(args) != 15:
        raise WeightSyncError("torch.multiprocessing.reductions.reduce_tensor changed shape; update export_handle")
    (_, _, _, tensor_offset, _, _, device_index, storage_handle, storage_size_bytes, storage_offset_bytes, _,
     ref_counter_handle, ref_counter_offset, event_handle, event_sync_required) = args  # fmt: skip
    return CudaIpcHandle(
        device_index=int(device_index),
        device_uuid=_device_uuid(int(device_index)),
        storage_handle=bytes(storage_handle),
        storage_size_bytes=int(storage_size_bytes),
        storage_offset_bytes=int(storage_offset_bytes),
        ref_counter_handle=bytes(ref_counter_handle),
        ref_counter_offset=int(ref_counter_offset),
        event_handle=bytes(event_handle) if event_handle is not None else None,
        event_sync_required=bool(event_sync_required),
        tensor_offset=int(tensor_offset),
        nbytes=buffer.numel(),
    )


def import_handle(handle: CudaIpcHandle) -> torch.Tensor:
    """Map the trainer's buffer into this process: a 1-D uint8 view of handle.nbytes.

    The mapping (and the reference it holds on the trainer's memory) lasts as long as the
    returned tensor or any view of it. torch reuses a mapping of the same storage that is
    still alive (and gives the new handle's reference back at once).
    """
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(
        torch.Tensor,
        (handle.nbytes,),
        (1,),
        handle.tensor_offset,
        torch.UntypedStorage,  # always: the peer does not get to choose a class
        torch.uint8,
        _local_device_index(handle),
        handle.storage_handle,
        handle.storage_size_bytes,
        handle.storage_offset_bytes,
        False,
        handle.ref_counter_handle,
        handle.ref_counter_offset,
        handle.event_handle,
        handle.event_sync_required,
    )


def release_handle(handle: CudaIpcHandle) -> None:
    """Give back the reference an exported handle holds on the trainer's memory, unmapped.

    Every export counts one reference that only the receiver can drop (torch keeps the
    trainer's block alive until then); a handle refused without being mapped must drop it
    here, or the trainer holds that memory until it exits. Works in either process, and
    needs no access to the trainer's GPU (torch ignores the device).
    """
    torch.UntypedStorage._release_ipc_counter(
        handle.ref_counter_handle, handle.ref_counter_offset, device=handle.device_index
    )


def check_flat_device(handle: CudaIpcHandle, device: torch.device) -> None:
    """Flat mode hands out views of the trainer's buffer: it must be on the engine's GPU."""
    if device.type != "cuda":
        return
    index = _local_device_index(handle)  # refuses a GPU this process cannot see
    if index != device.index:
        raise WeightSyncError(
            f"the trainer's buffer is on cuda:{index} of this process (uuid {handle.device_uuid or '?'}), the engine "
            f"on {device}: flat CUDA IPC reads it in place and needs both on one GPU"
        )


def release_quietly(handle: CudaIpcHandle) -> None:
    try:
        release_handle(handle)
    except Exception:  # best effort, as torch's own release: the trainer may be gone
        pass


def configure_socket(socket: zmq.Socket, timeout_s: float, endpoint: str) -> None:
    timeout_ms = max(int(timeout_s * 1000), 1)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVTIMEO, timeout_ms)
    socket.setsockopt(zmq.SNDTIMEO, timeout_ms)
    if endpoint.startswith("tcp://["):
        socket.setsockopt(zmq.IPV6, 1)


def resolve_cuda_device(device: torch.device | str | None) -> torch.device:
    if not torch.cuda.is_available():
        raise WeightSyncError("the CUDA IPC transport needs CUDA, and this process sees no CUDA device")
    resolved = torch.device(device) if device is not None else torch.device("cuda")
    if resolved.type != "cuda":
        raise ValueError(f"the CUDA IPC transport works on CUDA devices, got {resolved}")
    return torch.device("cuda", resolved.index if resolved.index is not None else torch.cuda.current_device())


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _device_uuid(index: int) -> str:
    return str(getattr(torch.cuda.get_device_properties(index), "uuid", ""))


def _local_device_index(handle: CudaIpcHandle) -> int:
    # The trainer and the engine may see the GPU under different indices
    # (CUDA_VISIBLE_DEVICES); the UUID names the physical device.
    if handle.device_uuid:
        for index in range(torch.cuda.device_count()):
            if _device_uuid(index) == handle.device_uuid:
                return index
        raise WeightSyncError(
            f"the trainer's GPU (uuid {handle.device_uuid}) is not visible to this engine process; "
            "CUDA IPC needs both on the same GPU (check CUDA_VISIBLE_DEVICES)"
        )
    return handle.device_index
