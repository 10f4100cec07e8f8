"""FSDP2 (fully_shard) on CPU with gloo, two spawned ranks: every rank walks, rank 0 sends.

The model is a Llama-shaped stand-in (same names, tied lm_head): importing transformers
in each child would triple this test's time. Children report through files (safetensors
+ JSON), never pickle.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from _weightsync_helpers import assert_same_tensors, fsdp_unsupported_reason

from weightsync.transports import iter_safetensors_dir

WORLD_SIZE = 2


def _rank_main(rank: int, out_dir: str) -> None:
    import torch.distributed as dist
    from _weightsync_helpers import FakeEngine, tiny_hf_like
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from weightsync.trainer import WeightSyncSender, iter_hf_weights
    from weightsync.transports import InProcessSender, save_safetensors_dir

    # A file rendezvous: no port picked in the parent that another socket could take first.
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=WORLD_SIZE)
    report: dict[str, object] = {}
    try:
        model = tiny_hf_like()  # same seed on every rank: same full weights
        reference = [(name, parameter.detach().clone()) for name, parameter in model.named_parameters()]
        # An explicit CPU mesh: on a CUDA machine fully_shard would otherwise pick the GPU.
        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model(torch.tensor([[1, 2, 3]])).sum().backward()  # a real step's state
        report["sharded"] = all(isinstance(p, DTensor) for p in model.parameters())

        # Lazy: one gather per parameter, only when the consumer asks for the next one.
        gathers = 0
        original_full_tensor = DTensor.full_tensor

        def counting_full_tensor(self, *args, **kwargs):
            nonlocal gathers
            gathers += 1
            return original_full_tensor(self, *args, **kwargs)

        DTensor.full_tensor = counting_full_tensor
        walker = iter_hf_weights(model)
        next(walker)
        report["gathers_after_first"] = gathers
        for _ in walker:
            pass
        report["gathers_total"] = gathers
        DTensor.full_tensor = original_full_tensor

        engine = FakeEngine() if rank == 0 else None
        stats = WeightSyncSender(InProcessSender(engine) if engine else None).push(model)
        report["stats_is_none"] = stats is None
        if engine is not None:
            save_safetensors_dir(engine.last, Path(out_dir) / "received")
            save_safetensors_dir(reference, Path(out_dir) / "reference")

        # Rank 0's engine fails after 3 tensors: rank 0 raises, rank 1 must not hang.
        failing = InProcessSender(FakeEngine(fail_after=3)) if rank == 0 else None
        try:
            WeightSyncSender(failing).push(model)
            report["failure"] = None
        except ValueError as error:
            report["failure"] = str(error)
        check = torch.ones(1)
        dist.all_reduce(check)  # both ranks got here, in step
        report["in_step"] = check.item() == WORLD_SIZE
    finally:
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(report))
        # Tear down together: a gloo group destroyed while the peer is already gone can
        # abort the process ("terminate called without an active exception").
        dist.barrier()
        dist.destroy_process_group()
    # Leave without interpreter finalization: FSDP2 can still hold gloo work objects whose
    # tensors are freed during finalization, after the GIL is gone, and the process then
    # aborts ("terminate called without an active exception", ~1 run in 10 here; see
    # pytorch/pytorch#179291). Everything this test checks is in the report by now; an
    # exception above skips this line and still fails the rank.
    os._exit(0)


@pytest.mark.skipif(fsdp_unsupported_reason() is not None, reason=str(fsdp_unsupported_reason()))
def test_fsdp2_push_on_cpu_gloo(tmp_path):
    ranks = mp.start_processes(
        _rank_main, args=(str(tmp_path),), nprocs=WORLD_SIZE, start_method="spawn", join=False
    )
    deadline = time.monotonic() + 120
    while not ranks.join(timeout=1):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail("FSDP2 ranks did not finish within 120 s (a gather out of step?)")
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
    reference = list(iter_safetensors_dir(tmp_path / "reference"))
    for report in reports:
        assert report["sharded"] and report["in_step"]
        assert report["gathers_after_first"] == 1
        assert report["gathers_total"] == len(reference)  # tied lm_head gathered once
    assert reports[0]["stats_is_none"] is False and reports[1]["stats_is_none"] is True
    assert "fake engine rejects" in reports[0]["failure"] and reports[1]["failure"] is None
    received = list(iter_safetensors_dir(tmp_path / "received"))
    assert "lm_head.weight" not in dict(received)
    assert_same_tensors(received, reference)
