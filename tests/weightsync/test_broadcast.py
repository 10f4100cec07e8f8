"""Broadcast transport over gloo: the trainer is this pytest process (rank 0), engines are
spawned processes. Children report through files (safetensors + JSON), never pickle."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _weightsync_helpers import FakeEngine, assert_same_tensors, tiny_llama
from rollout.distributed.ports import free_port

from weightsync.transports import BroadcastSender, WeightSyncError, close_group, open_group, receive
from weightsync.transports.disk import iter_safetensors_dir, save_safetensors_dir

SMALL_BUCKET = 4096  # forces many buckets, and the 16 KiB embedding into an oversized one


def _engine_main(port: int, out_dir: str, updates: int) -> None:
    """Engine rank 1: apply `updates` updates to a fake engine, record results and errors."""
    engine = FakeEngine()
    errors: list[str] = []
    group = open_group("127.0.0.1", port, 1, 2, timeout_s=20, join_timeout_s=120)
    for i in range(updates):
        try:
            engine.update_weights(receive(group), full=True)
            save_safetensors_dir(engine.last, Path(out_dir) / f"update{i}")
        except WeightSyncError as error:
            errors.append(str(error))
    close_group(group)
    (Path(out_dir) / "errors.json").write_text(json.dumps(errors))


def _silent_trainer_engine_main(port: int, out_dir: str) -> None:
    """Engine rank 1 whose trainer never sends: receive must fail by the timeout; then die."""
    group = open_group("127.0.0.1", port, 1, 2, timeout_s=2, join_timeout_s=60)
    started = time.monotonic()
    try:
        list(receive(group))
        outcome = {"error": None}
    except WeightSyncError as error:
        outcome = {"error": str(error)}
    outcome["elapsed"] = time.monotonic() - started
    (Path(out_dir) / "outcome.json").write_text(json.dumps(outcome))
    # Exit without close_group: to the trainer this engine simply died.


def _spawn(target, *args) -> mp.Process:
    process = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
    process.start()
    return process


def test_broadcast_tiny_llama_to_engine_process(tmp_path):
    port = free_port()
    engine = _spawn(_engine_main, port, str(tmp_path), 3)
    group = open_group("127.0.0.1", port, 0, 2, timeout_s=20, join_timeout_s=120)
    assert not dist.is_initialized(), "the weight-sync group must not create a default process group"
    sender = BroadcastSender(group, bucket_bytes=SMALL_BUCKET)

    fp32 = list(tiny_llama().named_parameters())
    stats = sender.send(iter(fp32))
    assert stats.num_tensors == len(fp32) and stats.num_buckets > 3

    def failing():
        yield fp32[0]
        raise RuntimeError("gather failed")

    with pytest.raises(RuntimeError, match="gather failed"):
        sender.send(failing())

    # The abort kept the group in step: the next update goes through.
    bf16 = list(tiny_llama(seed=1, dtype=torch.bfloat16).named_parameters())
    assert BroadcastSender(group).send(bf16).num_buckets == 1

    engine.join(timeout=60)
    close_group(group)
    assert engine.exitcode == 0
    errors = json.loads((tmp_path / "errors.json").read_text())
    assert len(errors) == 1 and "trainer aborted the transfer after 0 buckets" in errors[0]
    assert_same_tensors(list(iter_safetensors_dir(tmp_path / "update0")), fp32)
    assert_same_tensors(list(iter_safetensors_dir(tmp_path / "update2")), bf16)


def test_silent_trainer_and_dead_engine_fail_within_timeout(tmp_path):
    port = free_port()
    engine = _spawn(_silent_trainer_engine_main, port, str(tmp_path))
    # A short step timeout, but time enough for the child process to start.
    group = open_group("127.0.0.1", port, 0, 2, timeout_s=2, join_timeout_s=60)
    engine.join(timeout=30)
    assert engine.exitcode == 0
    outcome = json.loads((tmp_path / "outcome.json").read_text())
    assert outcome["error"] and "receiving the control of bucket 0 failed" in outcome["error"]
    assert outcome["elapsed"] < 6

    # The engine is gone now: sending must raise, not hang.
    started = time.monotonic()
    with pytest.raises(WeightSyncError, match="sending"):
        BroadcastSender(group, bucket_bytes=SMALL_BUCKET).send([("w", torch.zeros(1 << 16))])
    assert time.monotonic() - started < 6
    with pytest.raises(WeightSyncError, match="out of step"):
        BroadcastSender(group).send([("w", torch.zeros(4))])
    close_group(group)


@pytest.mark.parametrize(("rank", "message"), [(0, r"only 1/2 ranks joined.*missing ranks \[1\]"), (1, "no trainer")])
def test_open_group_without_peer_raises_within_timeout(rank, message):
    started = time.monotonic()
    with pytest.raises(WeightSyncError, match=message):
        open_group("127.0.0.1", free_port(), rank, 2, timeout_s=3)
    assert time.monotonic() - started < 5


def test_duplicate_rank_is_refused():
    port = free_port()
    groups = {}
    threads = [
        threading.Thread(target=lambda r=r: groups.__setitem__(r, open_group("127.0.0.1", port, r, 2, timeout_s=10)))
        for r in (0, 1)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        with pytest.raises(WeightSyncError, match="rank 1 .* already taken"):
            open_group("127.0.0.1", port, 1, 2, timeout_s=3)
    finally:
        for group in groups.values():
            close_group(group)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"backend": "mpi"}, "backend must be"),
        ({"rank": 2}, "rank must be in 0..1"),
        ({"timeout_s": 0}, "timeout_s must be > 0"),
        ({"master_port": 0}, "master_port"),
        ({"join_timeout_s": -1}, "join_timeout_s must be > 0"),
    ],
)
def test_open_group_rejects_bad_arguments(kwargs, message):
    arguments = {"master_addr": "127.0.0.1", "master_port": 1234, "rank": 0, "world_size": 2} | kwargs
    with pytest.raises(ValueError, match=message):
        open_group(**arguments)


def test_roles_are_enforced():
    group = open_group("127.0.0.1", free_port(), 0, 1, timeout_s=5)
    try:
        with pytest.raises(ValueError, match="rank 0 is the trainer"):
            next(receive(group))
        # world_size 1: a broadcast with no listeners still runs the whole protocol.
        assert BroadcastSender(group).send([("a", torch.ones(3))]).num_buckets == 1
    finally:
        close_group(group)
    with pytest.raises(WeightSyncError, match="closed"):
        BroadcastSender(group).send([])


# --- NCCL: needs CUDA; two ranks need two GPUs (NCCL refuses two ranks on one GPU) -----


def _nccl_engine_main(port: int, out_dir: str) -> None:
    engine = FakeEngine()
    group = open_group("127.0.0.1", port, 1, 2, backend="nccl", timeout_s=60, device="cuda:1")
    engine.update_weights(receive(group), full=True)
    close_group(group)
    assert all(tensor.device == torch.device("cuda", 1) for _, tensor in engine.last)
    save_safetensors_dir(engine.last, Path(out_dir) / "received")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not dist.is_nccl_available(), reason="NCCL needs CUDA")
def test_nccl_group_of_one_runs_the_protocol():
    group = open_group("127.0.0.1", free_port(), 0, 1, backend="nccl", timeout_s=30)
    try:
        assert group.device.type == "cuda" and not dist.is_initialized()
        weights = [(name, p.detach().cuda()) for name, p in tiny_llama(dtype=torch.bfloat16).named_parameters()]
        assert BroadcastSender(group, bucket_bytes=SMALL_BUCKET).send(weights).num_buckets > 3
    finally:
        close_group(group)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2 or not dist.is_nccl_available(), reason="needs 2 CUDA GPUs for NCCL")
def test_nccl_broadcast_between_two_gpus(tmp_path):
    port = free_port()
    engine = _spawn(_nccl_engine_main, port, str(tmp_path))
    group = open_group("127.0.0.1", port, 0, 2, backend="nccl", timeout_s=60, device="cuda:0")
    weights = [(name, p.detach().cuda(0)) for name, p in tiny_llama(dtype=torch.bfloat16).named_parameters()]
    weights.append(("extra.fp32", torch.randn(3, 5, device="cuda:0")))
    try:
        assert BroadcastSender(group, bucket_bytes=SMALL_BUCKET).send(weights).num_buckets > 3
    finally:
        close_group(group)
    engine.join(timeout=120)
    assert engine.exitcode == 0
    assert_same_tensors(list(iter_safetensors_dir(tmp_path / "received")), weights)
