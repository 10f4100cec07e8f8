"""The batch-invariant matmul (deterministic mode) against cuBLAS on the GPU: ms per call for
the Llama-3.1-8B projections at decode and prefill row counts, for the shipped tile choice
(batch_invariant.config_for) and for candidate tile configs at the row counts they are meant
for; the sum over one decode step (32 layers x 4 projections + the lm_head) and over one
8192-token prefill chunk (the projections only: the lm_head sees one row per request); and
whether each config's row computed alone equals the shipped choice's row inside the largest
call (the property every config must keep; cuBLAS's own row in its largest call for cuBLAS).

    python -m scripts.bench_batch_invariant [--rows 1 16 64 256 512 8192]

Times are triton.testing.do_bench medians (L2 flushed between calls, as a decode step's
weights come from HBM).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

SHAPES_8B = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
             "lm_head": (4096, 128256)}
PER_STEP = {"qkv": 32, "o": 32, "gate_up": 32, "down": 32, "lm_head": 1}
# (block_m, block_n, block_k, num_warps, num_stages), and the row counts it is timed at
CANDIDATES = [
    ((16, 16, 64, 4, 8), 1, 16), ((16, 32, 64, 4, 6), 1, 16), ((16, 64, 64, 4, 4), 1, 16), ((16, 16, 64, 4, 4), 1, 16),
    ((64, 64, 64, 4, 4), 1, 512), ((64, 128, 64, 4, 3), 64, 8192), ((128, 128, 64, 8, 3), 64, 8192),
    ((128, 256, 64, 8, 3), 256, 8192),
]


def time_ms(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=5, rep=20))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256, 512, 8192])
    args = parser.parse_args()
    from rollout.kernels import batch_invariant as bi

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    top = max(args.rows)
    weights = {k: torch.randn(n, kk, device=dev, dtype=torch.bfloat16, generator=g) * 0.02 for k, (kk, n) in SHAPES_8B.items()}
    xs = {k: torch.randn(top, kk, device=dev, dtype=torch.bfloat16, generator=g) for k, (kk, _) in SHAPES_8B.items()}
    labels = ["cuBLAS", "shipped"] + ["x".join(map(str, c)) for c, _, _ in CANDIDATES]

    def run(label_index: int, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if label_index == 0:
            return F.linear(x, w)
        bi.config = bi.TileConfig(*CANDIDATES[label_index - 2][0]) if label_index >= 2 else None
        try:
            return bi.linear(x, w)
        finally:
            bi.config = None

    table: dict[tuple[str, int], dict[str, float]] = {}
    invariant = {label: True for label in labels}
    shipped_cfg: dict[tuple[str, int], str] = {}
    for name, w in weights.items():
        x = xs[name]
        shipped_full = run(1, x, w)
        invariant["cuBLAS"] &= torch.equal(run(0, x[:1], w)[0], run(0, x, w)[0])
        for i, label in enumerate(labels[1:], start=1):
            invariant[label] &= torch.equal(run(i, x[:1], w)[0], shipped_full[0])
        for m in args.rows:
            if name == "lm_head" and m > 512:
                continue  # prefill computes logits only for the rows that sample
            c = bi.config_for(m, w.shape[0])
            shipped_cfg[(name, m)] = f"{c.block_m}x{c.block_n}x{c.block_k}/{c.num_warps}w{c.num_stages}s"
            row = table.setdefault((name, m), {})
            for i, label in enumerate(labels):
                if i >= 2 and not CANDIDATES[i - 2][1] <= m <= CANDIDATES[i - 2][2]:
                    continue
                row[label] = time_ms(lambda: run(i, x[:m], w))
        print(f"{name}: done", flush=True)

    print("\nms per call (bf16; '-': not timed at that row count)")
    print(f"{'shape':<8} {'rows':>5} | {'shipped is':<16} | " + " | ".join(f"{l:>13}" for l in labels))
    for (name, m), row in table.items():
        cells = [f"{row[l]:>10.3f} ms" if l in row else f"{'-':>13}" for l in labels]
        print(f"{name:<8} {m:>5} | {shipped_cfg[(name, m)]:<16} | " + " | ".join(cells))

    print("\nsums (ms): a decode step = 32 x (qkv + o + gate_up + down) + lm_head; a prefill chunk = the same without the lm_head")
    def best(name: str, m: int) -> tuple[float, str]:
        return min((t, label) for label, t in table[(name, m)].items() if label != "cuBLAS")

    for m in args.rows:
        names = [n for n in SHAPES_8B if (n, m) in table]
        sums = {label: sum(table[(n, m)][label] * PER_STEP[n] for n in names) for label in ("cuBLAS", "shipped")}
        best_sum = sum(best(n, m)[0] * PER_STEP[n] for n in names)
        picks = ", ".join(f"{n} {best(n, m)[1]}" for n in names)
        print(f"rows {m:>5}: cuBLAS {sums['cuBLAS']:8.2f} | shipped {sums['shipped']:8.2f} "
              f"({sums['shipped'] / sums['cuBLAS']:.2f}x cuBLAS) | best per shape {best_sum:8.2f} ({picks})")
    print("row alone == the shipped row in the largest call: " + ", ".join(f"{l} {'yes' if v else 'NO'}"
                                                                        for l, v in invariant.items()))


if __name__ == "__main__":
    main()
