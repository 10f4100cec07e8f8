"""How fast the trainer's weights reach every engine over the weight-sync group, against raw
broadcasts of the same bytes on the same ranks and GPUs, in the same run (the ranks as
scripts/launch_disagg.py lays them out: trainer rank 0, engines after the trainer ranks).

    torchrun --nproc-per-node 1+E -m benchmarks.broadcast --model llama8b \\
        --device cuda --dtype bfloat16 [--bucket-mb 512] [--repeats 3] [--output bench.json]

Rows (median over --bench-repeats after one warm-up; each timed from a common start to
the moment the LAST participating rank is done, so receivers count):
  torch.distributed.broadcast   one flat buffer of all the weight bytes, on a registered
                                subgroup of the same ranks (NCCL's own bandwidth: the bar)
  weight group, raw flat        the same buffer on the private weight-sync group
  weight group, raw buckets     the same bytes in --bucket-mb chunks, two in flight
  BroadcastSender -> receive    the real protocol, engines only consume the stream
  ... hold every bucket         the same, keeping every bucket alive (as update_weights does:
                                it validates all before it writes any)
  engine.update_weights, held   validate + apply of the held tensors alone (no transfer): with
                                the row above, where the end-to-end row's time goes
  BroadcastSender -> engine     end to end: the engine validates and applies the update
GB/s is bytes / seconds (for a broadcast, nccl-tests' algbw and busbw are the same).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rollout.distributed.collectives import broadcast_int, gather_floats
from rollout.distributed.group import DistContext, init_distributed, shutdown
from rollout.distributed.launch_args import DTYPES, add_common_args, int_at_least, resolve_backend, resolve_model
from rollout.distributed.phases import phase
from rollout.distributed.ports import free_port

def _sync(ctx: DistContext) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


def run_bench(args: argparse.Namespace, ctx: DistContext, roles: Any) -> dict:
    from rollout import Engine, EngineConfig
    from rollout.hf_trainer import load_trainer_model
    from weightsync.trainer import iter_hf_weights
    from weightsync.transports.broadcast import BroadcastSender, receive
    from weightsync.transports.group import close_group, open_group

    rank, dtype = ctx.rank, DTYPES[args.dtype]
    member = roles.in_sync_group(rank)
    model_dir, _ = resolve_model(args.model, "dummy")
    members = [0] + list(range(roles.trainer_ranks, ctx.world_size))
    with phase(ctx, "bench: build models and groups"):
        torch_group = dist.new_group(members, timeout=timedelta(seconds=args.timeout_s))
        model = engine = None
        if rank == 0:
            model = load_trainer_model(model_dir, "dummy", dtype, ctx.device)
        elif member:
            engine = Engine(EngineConfig(model=model_dir, dtype=args.dtype, device=str(ctx.device), load_format="dummy",
                                         max_total_tokens=args.max_total_tokens or 4096, page_size=args.page_size))
        port = broadcast_int(args.sync_port or (free_port(args.sync_addr) if rank == 0 else None), ctx)
        group = None
        if member:
            group = open_group(args.sync_addr, port, members.index(rank), len(members), backend=ctx.backend,
                               timeout_s=args.timeout_s, device=ctx.device if ctx.backend == "nccl" else None)
        nbytes = broadcast_int(sum(t.numel() * t.element_size() for _, t in iter_hf_weights(model)) if rank == 0 else None, ctx)
    bucket = args.bucket_mb << 20
    flat = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device) if member else None

    def torch_flat() -> None:
        dist.broadcast(flat, src=0, group=torch_group)

    def group_flat() -> None:
        group.broadcast(flat).wait()

    def group_buckets() -> None:
        works: list = []
        for chunk in flat.split(bucket):
            works.append(group.broadcast(chunk))
            if len(works) >= 2:
                works.pop(0).wait()
        for work in works:
            work.wait()

    def sender_to(consume: Callable[[Any], None]) -> Callable[[], None]:
        def run() -> None:
            if rank == 0:
                BroadcastSender(group, bucket_bytes=bucket).send(iter_hf_weights(model))
            else:
                consume(receive(group, device=ctx.device))
        return run

    held: list = []

    def hold(stream: Any) -> None:
        held[:] = list(stream)

    def apply_held() -> None:
        if rank != 0:
            engine.update_weights(held, full=True)

    rows = [
        ("torch.distributed.broadcast, flat", torch_flat),
        ("weight group, raw flat", group_flat),
        (f"weight group, raw {args.bucket_mb} MB buckets", group_buckets),
        ("BroadcastSender -> receive (discard)", sender_to(lambda stream: [None for _ in stream])),
        ("BroadcastSender -> receive, hold every bucket", sender_to(hold)),
        ("engine.update_weights of held tensors", apply_held),
        ("BroadcastSender -> engine.update_weights", sender_to(lambda stream: engine.update_weights(stream, full=True))),
    ]
    results = []
    for i, (name, fn) in enumerate(rows):
        if i == 3:
            flat = None  # free the raw buffer before the protocol rows allocate buckets
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()
        if i == len(rows) - 1:
            held.clear()  # the end-to-end row allocates its own buckets
        with phase(ctx, f"bench: {name}"):
            times = [_timed(ctx, group, fn if member else None) for _ in range(args.repeats + 1)][1:]
        results.append((name, statistics.median(times), times))
    if member:
        close_group(group)
    if rank == 0:
        _print_table(ctx, args, nbytes, results)
    return {"bench_broadcast": {"bytes": nbytes, "world": len(members), "backend": ctx.backend,
                                "rows": [{"name": n, "seconds": s, "all_seconds": t, "gb_s": nbytes / s / 1e9} for n, s, t in results]}}


def _timed(ctx: DistContext, group: Any, fn: Callable[[], None] | None) -> float:
    """Seconds from a common start until the last rank finished `fn` (non-members idle)."""
    if group is not None:
        group.broadcast(torch.zeros(1, device=group.device)).wait()  # line everyone up
        _sync(ctx)
    start = time.perf_counter()
    if fn is not None:
        fn()
        _sync(ctx)
    elapsed = time.perf_counter() - start if fn is not None else 0.0
    return max(row[0] for row in gather_floats([elapsed], ctx))


def _print_table(ctx: DistContext, args: argparse.Namespace, nbytes: int, results: list) -> None:
    bar = results[0][1]
    where = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "CPU"
    print(f"\nweight broadcast: {args.model} {args.dtype}, {nbytes / 1e9:.3f} GB, trainer rank 0 -> "
          f"{ctx.world_size - args.trainer_ranks} engine(s), {ctx.backend} on {where}, "
          f"median of {args.repeats} after one warm-up")
    print(f"{'':<44} | {'ms':>9} | {'GB/s':>7} | {'of torch bcast':>14}")
    for name, secs, times in results:
        print(f"{name:<44} | {secs * 1e3:>9.1f} | {nbytes / secs / 1e9:>7.2f} | {bar / secs:>13.1%}")
    print("all times (ms): " + "; ".join(f"{n}: {[round(t * 1e3, 1) for t in ts]}" for n, _, ts in results), flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--trainer-ranks", type=int_at_least(1), default=1, help="ranks 0..T-1 train; the rest run engines")
    parser.add_argument("--sync-addr", default="127.0.0.1", help="the weight-sync store's host (trainer rank 0's)")
    parser.add_argument("--sync-port", type=int_at_least(0), default=0, help="0: rank 0 picks a free port")
    parser.add_argument("--bucket-mb", type=int_at_least(1), default=512)
    parser.add_argument("--repeats", type=int_at_least(1), default=3)
    parser.add_argument("--output", default=None, help="rank 0 writes the rows here (JSON)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    from scripts.launch_disagg import Roles

    args = parse_args(argv)
    roles = Roles(args.trainer_ranks, int(os.environ.get("WORLD_SIZE", "1")))
    ctx = init_distributed(resolve_backend(args), args.device, args.timeout_s, roles.role_of)
    result = run_bench(args, ctx, roles)
    if ctx.rank == 0 and args.output:
        Path(args.output).write_text(json.dumps({"args": vars(args), **result}))
    shutdown(ctx)


if __name__ == "__main__":
    main()
