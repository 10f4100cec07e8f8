"""Sleep / wake benchmark (issue #13): what stays resident on the device after sleep, how
long each wake stage takes, and whether device and host memory come back to baseline over
many cycles.

Goals (H200, Llama-3.1-8B shape, bf16): resident GPU memory after sleep level 1 and 2
<= 1 GiB; wake (level 1, graphs included) <= 2 s; GPU and host memory after N cycles within
1% of the first cycle's.

    python -m benchmarks.sleep [--shape llama8b] [--cycles 10]
    python -m benchmarks.sleep --device cpu --shape tiny --cycles 3      # smoke run
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch


def host_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def device_used_bytes(device: torch.device) -> int:
    """Memory in use on the device by anyone (driver view), or 0 on CPU."""
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cycles", type=int, default=10)
    parser.add_argument("--mem-fraction", type=float, default=0.6)
    parser.add_argument("--track", type=int, default=0, help="print memory every N cycles")
    args = parser.parse_args(argv)

    from rollout import Engine, EngineConfig, SamplingParams
    from rollout.model.loader import iter_hf_views
    from rollout.model.shapes import SHAPES, write_shape_dir

    device = torch.device(args.device)
    gib = 2**30
    empty = device_used_bytes(device)  # the CUDA context and nothing else
    engine = Engine(EngineConfig(model=write_shape_dir(args.shape), dtype="bfloat16" if device.type == "cuda" else "float32",
                                 device=args.device, load_format="dummy", page_size=16,
                                 gpu_memory_fraction=args.mem_fraction,
                                 max_total_tokens=None if device.type == "cuda" else 4096))
    vocab = SHAPES[args.shape]["vocab_size"]
    prompts = torch.randint(100, vocab - 100, (8, 64), generator=torch.Generator().manual_seed(0)).tolist()
    greedy = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    reference = [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=greedy)]
    awake = device_used_bytes(device)
    print(f"{args.shape} on {args.device}: context only {empty / gib:.2f} GiB, engine awake {awake / gib:.2f} GiB", flush=True)

    rows = []
    for level in (1, 2):
        start = time.perf_counter()
        engine.sleep(level=level)
        sleep_s = time.perf_counter() - start
        resident = device_used_bytes(device) - empty
        start = time.perf_counter()
        engine.wake(["weights"])
        weights_s = time.perf_counter() - start
        if level == 2:  # the trainer's sync refills the discarded weights: here, from a random state
            start = time.perf_counter()
            engine.update_weights(((n, torch.randn_like(p) * 0.02) for n, p in iter_hf_views(engine.model)), full=True)
            weights_s += time.perf_counter() - start
        start = time.perf_counter()
        engine.wake(["kv_cache"])
        kv_s = time.perf_counter() - start
        rows.append((level, sleep_s, resident, weights_s, kv_s))
        print(f"level {level}: sleep {sleep_s:.2f} s, resident after sleep {resident / gib:.2f} GiB (beyond the context), "
              f"wake weights {weights_s:.2f} s{' incl. a full sync' if level == 2 else ''}, wake kv_cache + graphs {kv_s:.2f} s",
              flush=True)
    engine.update_weights(((n, torch.randn_like(p) * 0.02) for n, p in iter_hf_views(engine.model)), full=True)
    reference = [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=greedy)]

    first_dev = first_host = None
    cycle_s = []
    for i in range(args.cycles):
        start = time.perf_counter()
        engine.sleep(level=1)
        engine.wake()
        cycle_s.append(time.perf_counter() - start)
        outs = [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=greedy)]
        assert outs == reference, f"cycle {i}: outputs changed after wake"
        dev, host = device_used_bytes(device), host_rss_bytes()
        torch_reserved = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
        if first_dev is None:
            first_dev, first_host, first_reserved = dev, host, torch_reserved
        if args.track and (i + 1) % args.track == 0:  # where growth sits: torch's allocator or outside it
            print(f"cycle {i + 1}: device in use {dev / gib:.3f} GiB, torch reserved {torch_reserved / gib:.3f} GiB, "
                  f"outside torch {(dev - torch_reserved) / gib:.3f} GiB, host RSS {host / gib:.3f} GiB", flush=True)
    print(f"\n{args.shape}, {args.device}: {args.cycles} sleep(1)/wake cycles, outputs equal after each")
    print(f"{'':<34} | {'first cycle':>12} | {'last cycle':>12} | change")
    print(f"{'device memory in use (GiB)':<34} | {first_dev / gib:>12.3f} | {dev / gib:>12.3f} | "
          f"{(dev - first_dev) / max(first_dev, 1):+.2%}")
    print(f"{'  of it torch reserved (GiB)':<34} | {first_reserved / gib:>12.3f} | {torch_reserved / gib:>12.3f} | "
          f"{(torch_reserved - first_reserved) / max(first_reserved, 1):+.2%}")
    print(f"{'host RSS (GiB)':<34} | {first_host / gib:>12.3f} | {host / gib:>12.3f} | {(host - first_host) / max(first_host, 1):+.2%}")
    print(f"cycle time: median {sorted(cycle_s)[len(cycle_s) // 2]:.2f} s")
    print(f"\n{'level':>5} | {'sleep s':>7} | {'resident GiB':>12} | {'wake weights s':>14} | {'wake kv+graphs s':>16} | goals: <= 1 GiB, <= 2 s")
    for level, sleep_s, resident, weights_s, kv_s in rows:
        print(f"{level:>5} | {sleep_s:>7.2f} | {resident / gib:>12.2f} | {weights_s:>14.2f} | {kv_s:>16.2f}")


if __name__ == "__main__":
    main()
