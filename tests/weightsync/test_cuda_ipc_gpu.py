"""CUDA IPC for real: trainer (this process) and engine (a spawned process) on one GPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from _weightsync_helpers import FakeEngine, assert_same_tensors
from rollout.distributed.ports import free_port

from weightsync.transports import WeightSyncError, cuda_ipc_handles
from weightsync.transports.cuda_ipc import CudaIpcReceiver, CudaIpcSender



# --- real CUDA IPC: two processes, one GPU -------------------------------------------


def _engine_main(endpoint: str, out_dir: str) -> None:
    from weightsync.transports import save_safetensors_dir

    imports: list[int] = []
    import_handle = cuda_ipc_handles.import_handle
    cuda_ipc_handles.import_handle = lambda handle: imports.append(handle.nbytes) or import_handle(handle)
    receiver = CudaIpcReceiver(endpoint, device="cuda:0", timeout_s=60)
    engine = FakeEngine()
    results = []
    # Updates 0-3 and 5 flat, 4 bucketed; update 2 is rejected.
    for step, fail_after in enumerate((None, None, 3, None, None, None)):
        engine.fail_after = fail_after
        staged: list[int] = []

        def apply(stream):
            before = torch.cuda.memory_allocated()
            tensors = list(stream)  # flat: views into the trainer's buffer; bucketed: copies
            staged.append(torch.cuda.memory_allocated() - before)
            return engine.update_weights(tensors, full=True)

        try:
            version = receiver.serve_once(apply)
            save_safetensors_dir(engine.last, Path(out_dir) / f"update{step}")
            results.append({"version": version, "imports": len(imports), "staged": staged[0]})
        except ValueError as error:
            results.append({"error": str(error), "imports": len(imports)})
        # An engine makes a receiver per update (Engine.update_weights_from_ipc).
        receiver.close()
        receiver = CudaIpcReceiver(endpoint, device="cuda:0", timeout_s=60)
    receiver.close()
    (Path(out_dir) / "results.json").write_text(json.dumps(results))
    # Leaves with update 5's buffer still mapped: unmapped at exit (see the trainer's check).


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a CUDA device (untestable on CPU)")
@pytest.mark.whole_gpu  # both processes' allocated bytes are checked to the byte
@pytest.mark.parametrize("zero_copy", [False, True], ids=["packed", "zero-copy"])
def test_cuda_ipc_between_processes(tmp_path, monkeypatch, zero_copy):
    from _weightsync_helpers import tiny_llama

    from weightsync.transports import iter_safetensors_dir

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    engine = mp.get_context("spawn").Process(target=_engine_main, args=(endpoint, str(tmp_path)), daemon=True)
    engine.start()
    model = tiny_llama(dtype=torch.bfloat16).cuda()
    params = [(name, parameter) for name, parameter in model.named_parameters()]
    extra = torch.randn(3, 5, device="cuda")

    def weights():
        return [(name, parameter.detach()) for name, parameter in params] + [("extra.fp32", extra)]

    def snapshot():
        return [(name, tensor.cpu()) for name, tensor in weights()]

    def step(change):
        with torch.no_grad():
            for _, parameter in params:
                change(parameter)

    exports: list[int] = []
    export_handle = cuda_ipc_handles.export_handle
    monkeypatch.setattr(
        cuda_ipc_handles, "export_handle", lambda buffer: exports.append(buffer.numel()) or export_handle(buffer)
    )
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    expected = {}
    # packed: one buffer (one handle) for the update; zero-copy: each tensor is exported where
    # it lies, the trainer keeps no buffer, and in-place steps are read in place again
    per_update = len(weights()) if zero_copy else 1
    sender = CudaIpcSender(endpoint, timeout_s=60, zero_copy=zero_copy)  # flat
    try:
        stats = sender.send(weights())
        assert stats.engine_version == 1 and stats.num_buckets == per_update and len(exports) == per_update
        assert sender.reserved_bytes == 0 if zero_copy else sender.reserved_bytes >= stats.total_bytes
        expected[0] = snapshot()
        step(lambda p: p.add_(1))  # same layout, new values: same buffers, same handles
        assert sender.send(weights()).engine_version == 2 and len(exports) == per_update
        expected[1] = snapshot()
        with pytest.raises(WeightSyncError, match="rejected the weight update: ValueError: fake engine rejects"):
            sender.send(weights())
        step(lambda p: p.mul_(0.5))  # after an error the handles are exported anew
        assert sender.send(weights()).engine_version == 3 and len(exports) == 2 * per_update
        expected[3] = snapshot()
        sender.close()
        bucketed = CudaIpcSender(endpoint, flat=False, bucket_bytes=4096, timeout_s=60)  # the 8 KiB embedding is oversized
        stats = bucketed.send(weights())
        assert stats.engine_version == 4 and stats.num_buckets > 3
        expected[4] = snapshot()
        bucketed.close()
        # The bucketed update made the engine unmap the closed flat sender's buffer: freed.
        torch.cuda.ipc_collect()
        assert torch.cuda.memory_allocated() == baseline
        again = CudaIpcSender(endpoint, timeout_s=60, zero_copy=zero_copy)
        step(lambda p: p.sub_(2))
        assert again.send(weights()).engine_version == 5
        expected[5] = snapshot()
        again.close()
    finally:
        sender.close()
    engine.join(timeout=120)
    assert engine.exitcode == 0
    # The engine exited with update 5's buffer mapped, and unmapped it on the way out.
    torch.cuda.ipc_collect()
    assert torch.cuda.memory_allocated() == baseline
    results = json.loads((tmp_path / "results.json").read_text())
    assert [result.get("version") for result in results] == [1, 2, None, 3, 4, 5]
    assert "fake engine rejects" in results[2]["error"]
    # Mapped once, reused by update 1 and the rejected 2, mapped anew for 3 (new export).
    assert [result["imports"] for result in results[:4]] == [per_update, per_update, per_update, 2 * per_update]
    assert results[5]["imports"] == results[4]["imports"] + per_update
    # Flat: the engine stages nothing; bucketed: it copies the whole update.
    assert results[0]["staged"] == results[1]["staged"] == results[5]["staged"] == 0
    assert results[4]["staged"] >= stats.total_bytes
    for index, want in expected.items():
        assert_same_tensors(list(iter_safetensors_dir(tmp_path / f"update{index}")), want)
