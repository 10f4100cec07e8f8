"""KVPool.copy_slots, the torch form against the one-launch kernel (rollout/kernels/kv_copy.py),
on a Llama-3.1-8B-shaped pool (32 layers, 8 KV heads x 128, bf16, page 16): what a draft
tree's accepted-path move (speculative/verify.py `_compact_path`) and a fork's partial-page copy
cost the host and the device, in one run.

    python -m benchmarks.kernels.kv_copy [--moves 1 3 8 15] [--layers 32] [--tokens 65536]

Per variant and move count: the host's time in the call (what a verify step's read back pays
before the next step launches) and the wall time to the copies' end (a sync after each call),
medians of --repeats calls.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rollout.cache.kv_pool import KVPool
from rollout.kernels.options import KernelOptions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--moves", type=int, nargs="+", default=[1, 3, 8, 15])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # two pools of the same shape: the torch copies (fused False: on the GPU too) and the kernel
    pools = {fused: KVPool(args.layers, 8, 128, args.tokens, 16, dtype, device, KernelOptions(fused=None if fused else False))
             for fused in (False, True)}
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"KVPool.copy_slots, {args.layers} layers x 8 x 128 {dtype}, {name}: ms a call (host / to the copies' end)")
    print(f"{'moves':>5} | {'torch (before)':>16} | {'one launch':>16}")
    for n in args.moves:
        src = torch.arange(1000, 1000 + n)  # a path's moves: each slot read before a later move writes it
        dst = src - 1
        cells = []
        for fused in (False, True):
            pool = pools[fused]
            host, wall = [], []
            for _ in range(args.repeats + 3):
                sync()
                t0 = time.perf_counter()
                pool.copy_slots(src, dst)
                t1 = time.perf_counter()
                sync()
                t2 = time.perf_counter()
                host.append(t1 - t0)
                wall.append(t2 - t0)
            cells.append(f"{1e3 * statistics.median(host[3:]):.3f} / {1e3 * statistics.median(wall[3:]):.3f}")
        print(f"{n:>5} | {cells[0]:>16} | {cells[1]:>16}")


if __name__ == "__main__":
    main()
