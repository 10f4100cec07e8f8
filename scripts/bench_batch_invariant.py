"""The batch-invariant matmul (deterministic mode) against cuBLAS on the GPU, per tile config:
ms per call for the Llama-3.1-8B projections at several row counts, the sum over one decode
step (32 layers x 4 projections + the lm_head), and whether a row computed alone equals the
same row inside the largest call (the property the config must keep).

    python -m scripts.bench_batch_invariant [--rows 1 64 256 2048]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

SHAPES_8B = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
             "lm_head": (4096, 128256)}
PER_STEP = {"qkv": 32, "o": 32, "gate_up": 32, "down": 32, "lm_head": 1}
CONFIGS = [  # (block_m, block_n, block_k, num_warps, num_stages); None: the shipped choice by shape
    None, (32, 64, 64, 4, 3), (64, 128, 64, 4, 3), (64, 64, 64, 4, 4), (128, 128, 64, 8, 3), (64, 256, 64, 8, 3),
]


def time_ms(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256, 2048])
    args = parser.parse_args()
    from rollout.kernels import batch_invariant as bi

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    weights = {k: torch.randn(n, kk, device=dev, dtype=torch.bfloat16, generator=g) * 0.02 for k, (kk, n) in SHAPES_8B.items()}
    xs = {k: torch.randn(max(args.rows), kk, device=dev, dtype=torch.bfloat16, generator=g) for k, (kk, _) in SHAPES_8B.items()}
    labels = ["cuBLAS"] + ["by shape" if c is None else "x".join(map(str, c)) for c in CONFIGS]
    table: dict[tuple[str, int], list[float]] = {}
    invariant: dict[str, bool] = {}
    for i, label in enumerate(labels):
        cfg = CONFIGS[i - 1] if i else None
        bi.config = bi.TileConfig(*cfg) if cfg is not None else None
        fn = bi.linear if i else (lambda x, w: F.linear(x, w))
        ok = True
        for name, w in weights.items():
            full = fn(xs[name], w)
            ok &= torch.equal(fn(xs[name][:1], w)[0], full[0])
            for m in args.rows:
                table.setdefault((name, m), []).append(time_ms(lambda: fn(xs[name][:m], w)))
        invariant[label] = ok
        print(f"{label}: row alone == row in {max(args.rows)} rows for every shape: {ok}", flush=True)
    print(f"\n{'shape':<8} {'rows':>5} | " + " | ".join(f"{l:>14}" for l in labels))
    for (name, m), times in table.items():
        print(f"{name:<8} {m:>5} | " + " | ".join(f"{t:>11.3f} ms" for t in times))
    print("\nper decode step (32 layers x qkv/o/gate_up/down + lm_head), ms:")
    for m in args.rows:
        sums = [sum(table[(n, m)][i] * PER_STEP[n] for n in SHAPES_8B) for i in range(len(labels))]
        print(f"rows {m:>5} | " + " | ".join(f"{l} {s:.2f}" for l, s in zip(labels, sums)))
    print("batch-invariant: " + ", ".join(f"{l} {'yes' if v else 'NO'}" for l, v in invariant.items()))


if __name__ == "__main__":
    main()
