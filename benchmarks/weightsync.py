"""Weight-sync benchmark: time a full update end to end (pause -> validate -> apply -> flush
-> resume), as GB/s beside the device copy bandwidth measured in the same run.

GPU (default): random bf16 weights shaped like Llama-3.1-8B; (1) in-process from a trainer
model in the same process (idle engine, and 32 requests running), (2) colocated CUDA IPC from
a trainer process on the same GPU: flat zero-copy (the default), flat packed, and with
--bucketed bucketed. The first update of each row is shown apart (the trainer's clock starts
once its model is built, so the first update is what an RL run pays on step 1).
CPU (--cpu): SmolLM2-135M over a gloo broadcast from a trainer process.

    python -m benchmarks.weightsync [--cpu] [--repeats 3] [--bucket-mb 512] [--bucketed]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from rollout.distributed.ports import free_port
from rollout.hf_trainer import random_trainer_model
from rollout.model.shapes import write_shape_dir


def copy_bandwidth(device: torch.device) -> float:
    src = torch.randn(1024**3, dtype=torch.bfloat16, device=device)  # 2 GiB
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * 2 * 10 / (time.perf_counter() - start)


def ipc_trainer(model_dir: str, endpoint: str, repeats: int, bucket_bytes: int, result_file: str, flat: bool,
                zero_copy: bool, ready) -> None:
    from weightsync.trainer import iter_hf_weights
    from weightsync.transports.cuda_ipc import CudaIpcSender

    from benchmarks.common.steady import PhaseTimer
    from weightsync.transports import cuda_ipc_sender

    model = random_trainer_model(model_dir, "cuda", torch.bfloat16, seed=1)
    sender = CudaIpcSender(endpoint, bucket_bytes=bucket_bytes, flat=flat, zero_copy=zero_copy)
    timer = PhaseTimer()  # the trainer's side of a flat send: the walk (inside the pack), send, the wait
    timer.add(cuda_ipc_sender, "pack_flat", "walk + pack")
    timer.add(CudaIpcSender, "_send_request", "send")
    timer.add(CudaIpcSender, "_receive_reply", "wait for the answer")
    torch.cuda.synchronize()
    ready.set()  # the engine starts its clock for the first update here, not at our start-up
    times = []
    for _ in range(repeats + 1):  # the first one pays exports, mappings, allocator warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        stats = sender.send(iter_hf_weights(model))
        times.append(time.perf_counter() - start)
    reserved = sender.reserved_bytes
    timer.restore()
    sender.close()
    Path(result_file).write_text(json.dumps({"times": times, "bytes": stats.total_bytes, "buffers": stats.num_buckets,
                                             "reserved": reserved, "phases": timer.samples}))


def _timed_updates(engine, trainer, repeats: int, running: int) -> list[float]:
    """In-process full updates from the trainer model (after `running` requests were added
    and stepped, so pause -> retract -> resume is part of what is timed)."""
    from rollout import SamplingParams
    from weightsync.trainer import iter_hf_weights

    prompts = torch.randint(100, 100000, (running, 256)).tolist()
    times = []
    for _ in range(repeats + 1):
        for p in prompts:
            engine.add_request(p, SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True))
        for _ in range(3 if running else 0):
            engine.step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.update_weights(iter_hf_weights(trainer), full=True, pause_mode="retract")
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        while engine.has_unfinished():
            engine.step()
    return times


def _ipc_row(engine, model_dir: str, args, flat: bool, zero_copy: bool) -> tuple[str, list[float], list[float], dict]:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    result_file = os.path.join(model_dir, f"ipc-{flat}-{zero_copy}.json")
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=ipc_trainer, args=(model_dir, endpoint, args.repeats, args.bucket_mb << 20, result_file,
                                                 flat, zero_copy, ready))
    proc.start()
    if not ready.wait(timeout=600):
        raise RuntimeError("the IPC trainer process did not start")
    engine_side = []
    for _ in range(args.repeats + 1):
        start = time.perf_counter()
        engine.update_weights_from_ipc(endpoint, full=True, timeout_s=600)
        engine_side.append(time.perf_counter() - start)
    proc.join(timeout=600)
    res = json.loads(Path(result_file).read_text())
    mode = ("flat, zero-copy" if zero_copy else "flat, packed") if flat else f"bucketed, {args.bucket_mb} MB"
    name = f"CUDA IPC colocated ({mode}: {res['buffers']} buffers, trainer keeps {res['reserved'] / 1e9:.1f} GB)"
    return name, res["times"], engine_side, res


def gpu(args) -> None:
    from rollout import Engine, EngineConfig
    from benchmarks.common.steady import PhaseTimer
    import rollout.engine as engine_module

    device = torch.device("cuda")
    model_dir = write_shape_dir("llama8b", prefix="ws-8b-")
    bw = copy_bandwidth(device)
    engine = Engine(EngineConfig(model=model_dir, dtype="bfloat16", device="cuda", load_format="dummy",
                                 max_total_tokens=65536, page_size=16))
    nbytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    print(f"engine ready: {nbytes / 1e9:.2f} GB of weights; device copy {bw / 1e9:.0f} GB/s "
          f"-> copy floor {nbytes * 2 / bw * 1e3:.1f} ms (read + write once), "
          f"+ finiteness read {nbytes / bw * 1e3:.1f} ms", flush=True)

    trainer = random_trainer_model(model_dir, "cuda", torch.bfloat16, seed=0)
    rows = []  # (name, [first, steady...] seconds)
    rows.append(("in-process, idle engine", _timed_updates(engine, trainer, args.repeats, running=0)))
    rows.append(("in-process, 32 running (retract, resume)", _timed_updates(engine, trainer, args.repeats, running=32)))
    # where an idle in-process update's time goes: validation (names, shapes, finiteness:
    # one sync) and the writes (queued copies + the final sync)
    timer = PhaseTimer()
    timer.add(engine_module, "plan_writes", "validate")
    timer.add(engine_module, "apply_writes", "write", after=torch.cuda.synchronize)
    _timed_updates(engine, trainer, args.repeats, running=0)
    timer.restore()
    phases = {k: v / (args.repeats + 1) for k, v in timer.seconds.items()}
    del trainer
    torch.cuda.empty_cache()

    ipc = []
    for flat, zero_copy in [(True, True), (True, False)] + ([(False, False)] if args.bucketed else []):
        name, trainer_side, engine_side, res = _ipc_row(engine, model_dir, args, flat, zero_copy)
        rows.append((name, trainer_side))
        ipc.append((name, engine_side))
    # where a zero-copy CUDA IPC update's engine side goes, steady updates only: waiting for
    # the request (the trainer's walk and send) and decoding it, mapping (cached after the
    # first), validation, the writes (+ sync), and the answer (a sync, then the reply)
    from weightsync.transports.cuda_ipc_receiver import CudaIpcReceiver

    timer = PhaseTimer()
    timer.add(CudaIpcReceiver, "_receive_request", "wait + decode request")
    timer.add(CudaIpcReceiver, "_map_flat", "map")
    timer.add(engine_module, "plan_writes", "validate")
    timer.add(engine_module, "apply_writes", "write", after=torch.cuda.synchronize)
    timer.add(CudaIpcReceiver, "finish", "answer")
    _, ipc_trainer_side, ipc_engine_side, ipc_res = _ipc_row(engine, model_dir, args, True, True)
    timer.restore()
    ipc_phases = {k: statistics.median(v[1:]) for k, v in timer.samples.items() if len(v) > 1}
    trainer_phases = {k: statistics.median(v[1:]) for k, v in ipc_res.get("phases", {}).items() if len(v) > 1}

    print(f"\nLlama-3.1-8B shape, bf16, {nbytes / 1e9:.2f} GB, {torch.cuda.get_device_name()}, "
          f"device copy {bw / 1e9:.0f} GB/s, median of {args.repeats} after the first; the first timed apart")
    print(f"{'transport':<76} | {'first ms':>9} | {'ms':>7} | {'GB/s':>6} | {'of copy bw':>10}")
    for name, times in rows:
        t = statistics.median(times[1:])
        print(f"{name:<76} | {times[0] * 1e3:>9.1f} | {t * 1e3:>7.1f} | {nbytes / t / 1e9:>6.0f} | {nbytes / t / bw:>9.1%}")
    print("idle in-process split: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in phases.items()))
    print(f"zero-copy CUDA IPC split (engine side, median; this pass {statistics.median(ipc_engine_side[1:]) * 1e3:.1f} ms "
          f"engine / {statistics.median(ipc_trainer_side[1:]) * 1e3:.1f} ms trainer): "
          + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in ipc_phases.items()))
    print("  its trainer side: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in trainer_phases.items()))
    for name, times in rows:
        print(f"  {name}: {[round(x * 1e3, 1) for x in times]} ms")
    for name, times in ipc:
        print(f"  engine side of {name}: {[round(x * 1e3, 1) for x in times]} ms")


def gloo_trainer(model_dir: str, port: int, repeats: int, bucket_bytes: int) -> None:
    from transformers import AutoModelForCausalLM

    from weightsync.trainer import iter_hf_weights
    from weightsync.transports.broadcast import BroadcastSender
    from weightsync.transports.group import close_group, open_group

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    group = open_group("127.0.0.1", port, 0, 2, backend="gloo", timeout_s=300)
    sender = BroadcastSender(group, bucket_bytes=bucket_bytes)
    for _ in range(repeats + 1):
        sender.send(iter_hf_weights(model))
    close_group(group)


def cpu(args) -> None:
    from rollout import Engine, EngineConfig
    from rollout.model.fetch import fetch_default_model

    path = str(fetch_default_model())
    engine = Engine(EngineConfig(model=path))
    nbytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    port = free_port()
    proc = mp.get_context("spawn").Process(target=gloo_trainer, args=(path, port, args.repeats, args.bucket_mb << 20))
    proc.start()
    engine.init_weight_sync_group("127.0.0.1", port, 1, 2, backend="gloo", timeout_s=300)
    times = []
    for _ in range(args.repeats + 1):
        start = time.perf_counter()
        engine.update_weights_from_distributed(full=True)
        times.append(time.perf_counter() - start)
    engine.destroy_weight_sync_group()
    proc.join(timeout=300)
    src = torch.randn(64 * 1024**2)
    start = time.perf_counter()
    for _ in range(5):
        src.clone()
    copy = 2 * src.numel() * 4 * 5 / (time.perf_counter() - start)
    t = statistics.median(times[1:])
    print(f"\nSmolLM2-135M fp32 ({nbytes / 1e6:.0f} MB), gloo broadcast from a trainer process, CPU, "
          f"median of {args.repeats}: {t * 1e3:.0f} ms, {nbytes / t / 1e9:.2f} GB/s (host copy {copy / 1e9:.1f} GB/s); "
          f"all: {[round(x * 1e3) for x in times]} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--bucketed", action="store_true", help="also time bucketed CUDA IPC (flat=False)")
    args = parser.parse_args()
    cpu(args) if args.cpu else gpu(args)


if __name__ == "__main__":
    main()
