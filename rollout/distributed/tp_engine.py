"""A tensor-parallel engine from one process: this process is TP rank 0 and spawns ranks
1..T-1 as workers (`python -m rollout.distributed.tp_engine`, the config as JSON on the
command line), each an Engine on its own device holding its shard.

Every call on TPEngine is a command: rank 0 broadcasts it over the TP group as msgpack
bytes in a uint8 tensor (tensors of a weight update follow as raw broadcasts), then every
rank runs the same Engine method on the same inputs (SPMD: same scheduler, same steps,
same collectives). Per API call, not per step, so the step loop has no extra traffic. After
each command every rank reports [ok, weight version, outputs checksum]; rank 0 checks that
they agree, so a worker that failed or diverged is an error here, not a silent skew.

Under torchrun there is nothing to spawn: every rank builds Engine(config) itself.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import zlib
from collections.abc import Iterable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rollout.config import EngineConfig
from rollout.distributed.ports import free_port
from rollout.distributed.tp import TensorParallel, nonblocking_nccl
from rollout.engine import Engine
from rollout.metrics import EngineStats
from rollout.model.config import ModelConfig
from rollout.model.parallel import check_tp_size
from rollout.request import RolloutOutput, SamplingParams
from rollout.server.codec import TENSOR_DTYPES, from_plain, pack, to_plain, unpack
from rollout.validate import named_tensor_list, token_ids

log = logging.getLogger("rollout")
_DTYPE_NAMES = {dtype: name for name, dtype in TENSOR_DTYPES.items()}
_MAX_COMMAND_BYTES = 1 << 30
# Engine methods a command may name, with plain (msgpack) arguments only
_CALLS = ("sleep", "wake", "flush_cache", "update_weights_from_disk", "init_weight_sync_group",
          "update_weights_from_distributed", "destroy_weight_sync_group", "load_lora_adapter", "unload_lora_adapter",
          "list_lora_adapters", "pause_generation", "continue_generation")
# Engine methods whose `named_tensors` travel as raw broadcasts after the command
_TENSOR_CALLS = ("update_weights", "update_lora_adapter")
# Public Engine methods TPEngine does not carry, and why (tests/distributed/test_tp_api.py
# checks that every other one is a TPEngine method, a _CALLS or a _TENSOR_CALLS name).
NOT_CARRIED: dict[str, str] = {
    "add_request": "TPEngine carries whole generate() calls, one command each; the step-level API would "
                   "be a command per step on every rank. Under torchrun every rank's Engine has it",
    "step": "as add_request: the ranks step in lockstep inside one generate() command",
    "has_unfinished": "as add_request: nothing is left unfinished between TPEngine's commands",
    "abort": "as add_request: a generate() command returns every request it took",
    "update_weights_from_ipc": "CUDA IPC handles are per process and device: each rank maps its own "
                               "trainer's; under torchrun every rank's Engine takes them",
    "update_lora_adapters": "several adapters in one command: send each with update_lora_adapter "
                            "(atomic on every rank), or call it on every rank's Engine under torchrun",
}


def rank_device(device: str, rank: int) -> str:
    """TP rank r's device: cpu, or the r-th GPU counted from the configured one."""
    if device == "cpu":
        return device
    first = torch.device(device).index or 0
    return f"cuda:{first + rank}"


class TPEngine:
    """Engine's API for a TP engine whose other ranks this process spawns and drives."""

    def __init__(self, config: EngineConfig, *, timeout_s: float = 300.0) -> None:
        size = config.tensor_parallel_size
        if size < 2:
            raise ValueError(f"TPEngine: EngineConfig.tensor_parallel_size={size}; use Engine for one rank")
        check_tp_size(ModelConfig.from_dir(config.model), size)  # refuse before spawning anything
        if dist.is_initialized():
            raise ValueError("TPEngine: this process already has a default process group; under torchrun build "
                             "Engine(config) on every rank instead (TP groups of consecutive ranks)")
        if config.device != "cpu" and torch.device(rank_device(config.device, size - 1)).index >= torch.cuda.device_count():
            raise ValueError(f"EngineConfig.device={config.device!r} with tensor_parallel_size={size}: needs {size} "
                             f"GPUs from there, {torch.cuda.device_count()} visible")
        backend = "gloo" if config.device == "cpu" else "nccl"
        port = free_port()
        root = str(Path(__file__).resolve().parents[2])  # the workers import this checkout
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        self._workers = []
        for rank in range(1, size):
            plain = dataclasses.asdict(dataclasses.replace(config, device=rank_device(config.device, rank)))
            args = [sys.executable, "-m", "rollout.distributed.tp_engine", json.dumps(plain), str(rank), str(port),
                    backend, str(timeout_s)]
            self._workers.append(subprocess.Popen(args, env=env))
        device = torch.device(rank_device(config.device, 0))
        try:
            self.tp = _join(0, size, port, backend, timeout_s, device)
            self.engine = Engine(dataclasses.replace(config, device=str(device)), tensor_parallel=self.tp)
        except BaseException:
            for worker in self._workers:  # they would wait for rank 0 until their timeout
                worker.kill()
            raise
        self.closed = False

    # ---- the API --------------------------------------------------------------------------
    def generate(self, input_ids: Sequence[Sequence[int]] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 prompts: Sequence[str] | None = None, lora_name: str | None | Sequence[str | None] = None,
                 ) -> list[RolloutOutput]:
        # checked here, before any rank sees it: a bad batch is refused with nothing sent
        items = self.engine.intake.batch(input_ids, prompts, sampling_params)
        adapters = self.engine.intake.lora_names(lora_name, len(items))
        ids = [token_ids(i, f"prompt {n}") for n, (i, _, _) in enumerate(items)] if input_ids is not None else None
        params = [p for _, _, p in items]
        self._send({"op": "generate", "input_ids": ids, "prompts": list(prompts) if prompts is not None else None,
                    "params": [to_plain(p) for p in params], "lora_name": adapters})
        return self._run(lambda: run_generate(self.engine, ids, prompts, params, adapters))

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, full: bool = False,
                       pause_mode: str = "retract") -> int:
        """The trainer's HF-named full tensors go to every rank; each keeps its shard, and
        the update is all-or-nothing across the ranks (Engine.update_weights agrees)."""
        return self._with_tensors("update_weights", named_tensors, full=full, pause_mode=pause_mode)

    def update_lora_adapter(self, name: str, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                            pause_mode: str = "retract") -> int:
        """An adapter's new tensors (PEFT names, whole; or a lora.FlatLoraAdapter, sent as
        its named views) to every rank; each keeps its part."""
        from lora.flat import FlatLoraAdapter

        if isinstance(named_tensors, FlatLoraAdapter):
            named_tensors = named_tensors.named_tensors()
        return self._with_tensors("update_lora_adapter", named_tensors, name=name, pause_mode=pause_mode)

    def _with_tensors(self, method: str, named_tensors: Iterable[tuple[str, torch.Tensor]], **kwargs: Any) -> Any:
        pairs = named_tensor_list(named_tensors)
        for name, tensor in pairs:
            if not isinstance(tensor, torch.Tensor) or tensor.dtype not in _DTYPE_NAMES:
                raise ValueError(f"{method}: parameter {name!r}: expected a tensor of one of "
                                 f"{sorted(TENSOR_DTYPES)}, got {getattr(tensor, 'dtype', type(tensor).__name__)}")
        meta = [{"name": n, "dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape)} for n, t in pairs]
        self._send({"op": "tensors", "name": method, "tensors": meta, "kwargs": kwargs})
        for _, tensor in pairs:
            dist.broadcast(tensor.detach().to(self.tp.device).contiguous(), src=0, group=self.tp.group)
        return self._run(lambda: getattr(self.engine, method)(named_tensors=pairs, **kwargs))

    def call(self, method: str, /, **kwargs: Any) -> Any:
        """One of Engine's plain-argument methods (_CALLS) on every rank, by keyword. For
        init_weight_sync_group, rank r joins as rank_offset + r (pass the world size that
        counts all TP ranks)."""
        if method not in _CALLS:
            raise ValueError(f"TPEngine.call: {method!r} is not one of {_CALLS}")
        self._send({"op": "call", "name": method, "kwargs": kwargs})
        return self._run(lambda: getattr(self.engine, method)(**kwargs))

    def stats(self) -> EngineStats:
        """Rank 0's (every rank holds the same requests and counts)."""
        return self.engine.stats()

    def close(self) -> None:
        if self.closed:
            return
        self._send({"op": "close"})
        self.closed = True
        dist.destroy_process_group()
        for rank, worker in enumerate(self._workers, start=1):
            try:
                if worker.wait(timeout=60):
                    log.warning("TP rank %d exited with code %d", rank, worker.returncode)
            except subprocess.TimeoutExpired:
                worker.kill()

    def __enter__(self) -> TPEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- rank 0's side of a command -------------------------------------------------------
    def _send(self, command: dict) -> None:
        if self.closed:
            raise RuntimeError("TPEngine is closed")
        self.tp.broadcast_bytes(pack(command))

    def _run(self, action):
        """Run rank 0's part, then check every rank's report against ours."""
        error, result = None, None
        try:
            result = action()
        except Exception as e:  # the workers report theirs; ours is raised after the check
            error = e
        reports = report(self.tp, error is None, self.engine.weight_version, _checksum(result))
        if any(r != reports[0] for r in reports):
            raise RuntimeError(f"TP ranks disagree after a command ([ok, weight version, outputs checksum] per rank: "
                               f"{reports}); a rank failed or diverged, see its log") from error
        if error is not None:
            raise error  # every rank failed the same way (a refused update, a bad argument)
        return result


def run_generate(engine: Engine, ids, prompts, params, adapters) -> list[RolloutOutput]:
    return engine.generate(input_ids=ids, sampling_params=params, prompts=prompts, lora_name=adapters)


def report(tp: TensorParallel, ok: bool, version: int, checksum: int) -> list[list[int]]:
    """Every rank's [ok, version, checksum], gathered (the same list on every rank)."""
    mine = torch.tensor([int(ok), version, checksum], dtype=torch.int64, device=tp.device)
    return tp.all_gather_flat(mine).reshape(tp.size, 3).tolist()


def _checksum(result: Any) -> int:
    """crc32 of a generate's token ids (0 for other commands): ranks that sampled differently disagree."""
    if not isinstance(result, list) or not all(isinstance(o, RolloutOutput) for o in result):
        return 0
    return zlib.crc32(np.array([t for o in result for t in [len(o.token_ids), *o.token_ids]], dtype=np.int64).tobytes())


def _join(rank: int, size: int, port: int, backend: str, timeout_s: float, device: torch.device) -> TensorParallel:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with nonblocking_nccl():
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout_s), device_id=device if backend == "nccl" else None)
    group = dist.group.WORLD
    return TensorParallel(rank, size, group, device if backend == "nccl" else torch.device("cpu"))


# ---- a worker rank ----------------------------------------------------------------------------
def worker_main(argv: list[str]) -> None:
    config_json, rank, port, backend, timeout_s = argv
    config = EngineConfig(**json.loads(config_json))
    tp = _join(int(rank), config.tensor_parallel_size, int(port), backend, float(timeout_s), torch.device(config.device))
    engine = Engine(config, tensor_parallel=tp)
    while True:
        command = unpack(tp.broadcast_bytes(None), "TP command", _MAX_COMMAND_BYTES)
        if command["op"] == "close":
            break
        error, result = None, None
        try:
            result = _execute(engine, tp, command)
        except Exception as e:  # rank 0 raises the same error (or names this rank's disagreement)
            error = e
            log.warning("TP rank %d: %s failed: %s", tp.rank, command["op"], e)
        report(tp, error is None, engine.weight_version, _checksum(result))
    dist.destroy_process_group()


def _execute(engine: Engine, tp: TensorParallel, command: dict) -> Any:
    op = command["op"]
    if op == "generate":
        params = [from_plain(SamplingParams, p, f"params[{i}]") for i, p in enumerate(command["params"])]
        return run_generate(engine, command["input_ids"], command["prompts"], params, command["lora_name"])
    if op == "tensors" and command["name"] in _TENSOR_CALLS:
        pairs = []
        for meta in command["tensors"]:  # every tensor is received, so the group stays in step
            tensor = torch.empty(meta["shape"], dtype=TENSOR_DTYPES[meta["dtype"]], device=tp.device)
            dist.broadcast(tensor, src=0, group=tp.group)
            pairs.append((meta["name"], tensor))
        return getattr(engine, command["name"])(named_tensors=pairs, **command["kwargs"])
    if op == "call" and command["name"] in _CALLS:
        kwargs = dict(command["kwargs"])
        if command["name"] == "init_weight_sync_group":
            kwargs["rank_offset"] += tp.rank
        return getattr(engine, command["name"])(**kwargs)
    raise ValueError(f"TP worker: unknown command {op!r}")


if __name__ == "__main__":
    worker_main(sys.argv[1:])
