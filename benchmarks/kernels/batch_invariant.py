"""The batch-invariant matmul (deterministic mode) against cuBLAS on the GPU: ms per call for
the Llama-3.1-8B projections at decode and prefill row counts, for the shipped tile choice
(batch_invariant.config_for) and for candidate tile configs at the row counts they are meant
for; the sum over one decode step (32 layers x 4 projections + the lm_head) and over one
8192-token prefill chunk (the projections only: the lm_head sees one row per request); and
whether each config's row computed alone equals the shipped choice's row inside the largest
call (the property every config must keep; cuBLAS's own row in its largest call for cuBLAS,
and the same for "before": the kernel with the whole K loop in one program, no chunks).

    python -m benchmarks.kernels.batch_invariant [--rows 1 16 64 256 512 8192]

Times are medians over CUDA graph replays, each call on its own copy of the weight (so the
weight comes from HBM, as in a decode step, and Python's launch cost is not timed).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from rollout.kernels.batch_invariant_tiles import K_CHUNK

SHAPES_8B = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
             "lm_head": (4096, 128256)}
# --device cpu: a smoke run of the whole script under TRITON_INTERPRET=1 (tests): K past two
# chunks of 256 (the test passes --k-chunk 256) so that the split and TMA paths run, the last
# chunk one 64-wide K block (half of a 128 one), a few candidates, host-timed, one weight copy.
# K is what a call costs under the interpreter (each K block is a step of the program's loop)
SHAPES_TINY = {"qkv": (576, 48), "o": (576, 32), "gate_up": (576, 80), "down": (832, 32), "lm_head": (576, 96)}
PER_STEP = {"qkv": 32, "o": 32, "gate_up": 32, "down": 32, "lm_head": 1}
# TileConfig fields in order (block_m, block_n, block_k, num_warps, num_stages[, split[,
# k_chunk, tma]]), and the row counts it is timed at
K = K_CHUNK  # short, for the tuples that name tma after it
CANDIDATES = [
    ((16, 16, 64, 4, 8), 1, 16), ((16, 32, 64, 4, 6), 1, 16), ((16, 32, 256, 4, 3), 1, 16),
    ((16, 64, 128, 4, 3, True), 1, 16), ((16, 32, 256, 4, 2, True), 1, 16),
    ((64, 64, 64, 4, 4), 1, 512), ((64, 64, 64, 4, 4, True), 1, 256), ((64, 64, 128, 4, 3), 32, 512),
    ((64, 128, 64, 4, 3), 32, 8192), ((64, 128, 128, 4, 3), 32, 512), ((128, 64, 128, 4, 3), 32, 512),
    ((128, 128, 64, 8, 3), 64, 8192), ((128, 128, 128, 8, 3), 64, 8192),
    ((128, 256, 64, 8, 3), 256, 8192), ((256, 128, 64, 8, 3), 512, 8192),
    # X and W tiles by TMA descriptors
    ((64, 64, 128, 4, 3, False, K, True), 32, 512), ((64, 128, 128, 4, 3, False, K, True), 32, 512),
    ((128, 64, 128, 4, 3, False, K, True), 64, 512), ((64, 128, 64, 4, 4, False, K, True), 32, 8192),
    ((128, 128, 64, 8, 4, False, K, True), 64, 8192), ((128, 128, 128, 8, 3, False, K, True), 64, 8192),
    ((128, 128, 128, 4, 3, False, K, True), 64, 8192), ((128, 256, 64, 8, 3, False, K, True), 256, 8192),
    ((256, 128, 64, 8, 3, False, K, True), 512, 8192), ((128, 256, 128, 8, 2, False, K, True), 256, 8192),
    # 257-1024 rows (a GRPO decode batch): narrower tiles against wave quantization
    ((64, 64, 64, 4, 4, False, K, True), 256, 1024), ((128, 64, 64, 4, 4, False, K, True), 256, 1024),
    ((64, 256, 64, 8, 3, False, K, True), 256, 1024), ((64, 128, 64, 4, 3, False, K, True), 256, 1024),
]
COPIES = 4  # distinct weights per timed graph: 4 x 33-1050 MB, more than the 50 MB L2


def label_of(c) -> str:
    return "x".join(map(str, (c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages))) + (
        "/split" if c.split else "") + ("/tma" if c.tma else "")


def host_time_ms(fn, copies: int) -> float:
    start = time.perf_counter()
    fn(0)
    return (time.perf_counter() - start) * 1e3


def time_ms(fn, copies: int) -> float:
    """ms per call, the calls replayed from one CUDA graph as in a decode step (launch cost
    from Python would otherwise hide a 20-60 us kernel), each call of the graph on its own
    copy of the weight (fn(i)) so that the weight streams from HBM, not L2."""
    for i in range(copies):
        fn(i)  # compile and warm outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(4):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / (4 * copies))
    return sorted(times)[len(times) // 2]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256, 512, 8192])
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run on tiny shapes (needs TRITON_INTERPRET=1)")
    parser.add_argument("--k-chunk", type=int, default=None,
                        help="time the shipped choice and the candidates with this K chunk instead (a what-if: "
                             "other bits, so 'row alone' compares against the shipped choice at that chunk)")
    args = parser.parse_args(argv)
    from rollout.kernels import batch_invariant as bi
    from rollout.kernels.options import KernelOptions

    dev = torch.device(args.device)
    cpu = dev.type == "cpu"
    if cpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--device cpu runs the Triton kernels under the interpreter: set TRITON_INTERPRET=1")
    shapes, copies, timer = (SHAPES_TINY, 1, host_time_ms) if cpu else (SHAPES_8B, COPIES, time_ms)
    candidates = [c for c in CANDIDATES if c[0] in ((16, 64, 128, 4, 3, True), (64, 128, 64, 4, 4, False, K, True))] if cpu else CANDIDATES
    shipped = KernelOptions(deterministic_triton=True if cpu else None)  # on CPU: the kernel, interpreted
    dtype = torch.float32 if cpu else torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    top = max(args.rows)
    weights = {k: [torch.randn(n, kk, device=dev, dtype=dtype, generator=g) * 0.02 for _ in range(copies)]
               for k, (kk, n) in shapes.items()}
    xs = {k: torch.randn(top, kk, device=dev, dtype=dtype, generator=g) for k, (kk, _) in shapes.items()}
    labels = ["cuBLAS", "shipped", "before"] + [
        label_of(bi.TileConfig(*c)) for c, _, _ in candidates]

    def before(m: int, n: int) -> "bi.TileConfig":
        # the kernel as it was until K was cut into chunks: the whole K loop in one program
        if m <= 16:
            c = bi.TileConfig(16, 16 if n <= 8192 else 32 if n <= 32768 else 64, 64, 4, 8 if n <= 8192 else 6 if n <= 32768 else 4)
        elif m <= 64 or (m <= 512 and n < 16384):
            c = bi.TileConfig(64, 64, 64, 4, 4)
        else:
            c = bi.TileConfig(128, 128, 64, 8, 3)
        return dataclasses.replace(c, k_chunk=1 << 30)

    def run(label_index: int, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if label_index == 0:
            return F.linear(x, w)
        if label_index == 2:
            tiles = before(x.shape[0], w.shape[0])
        else:
            tiles = bi.TileConfig(*candidates[label_index - 3][0]) if label_index >= 3 else None
            if args.k_chunk:
                c = tiles or bi.config_for(x.shape[0], w.shape[0], w.shape[1])
                tiles = dataclasses.replace(c, k_chunk=args.k_chunk)
        return bi.linear(x, w, options=dataclasses.replace(shipped, batch_invariant_tiles=tiles))

    table: dict[tuple[str, int], dict[str, float]] = {}
    invariant = {label: True for label in labels}
    shipped_cfg: dict[tuple[str, int], str] = {}
    for name, ws in weights.items():
        x, w = xs[name], ws[0]
        shipped_full = run(1, x, w)
        invariant["cuBLAS"] &= torch.equal(run(0, x[:1], w)[0], run(0, x, w)[0])
        invariant["before"] &= torch.equal(run(2, x[:1], w)[0], run(2, x, w)[0])
        for i, label in enumerate(labels[1:], start=1):
            if i != 2:
                invariant[label] &= torch.equal(run(i, x[:1], w)[0], shipped_full[0])
        for m in args.rows:
            if name == "lm_head" and m > 512:
                continue  # prefill computes logits only for the rows that sample
            c = bi.config_for(m, w.shape[0], w.shape[1])
            shipped_cfg[(name, m)] = label_of(c)
            row = table.setdefault((name, m), {})
            for i, label in enumerate(labels):
                if i >= 3 and not candidates[i - 3][1] <= m <= candidates[i - 3][2]:
                    continue
                try:
                    row[label] = timer(lambda j: run(i, x[:m], ws[j]), copies)
                except Exception as e:  # a candidate that does not compile is reported, not fatal
                    print(f"{name} {m} {label}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        print(f"{name}: done", flush=True)

    print(f"\nms per call ({str(dtype).removeprefix('torch.')}; '-': not timed at that row count"
          + (f"; K chunk {args.k_chunk} for all but cuBLAS and before)" if args.k_chunk else ")"))
    print(f"{'shape':<8} {'rows':>5} | {'shipped is':<16} | " + " | ".join(f"{l:>13}" for l in labels))
    for (name, m), row in table.items():
        cells = [f"{row[l]:>10.3f} ms" if l in row else f"{'-':>13}" for l in labels]
        print(f"{name:<8} {m:>5} | {shipped_cfg[(name, m)]:<16} | " + " | ".join(cells))

    print("\nsums (ms): a decode step = 32 x (qkv + o + gate_up + down) + lm_head; a prefill chunk = the same without the lm_head")
    def best(name: str, m: int) -> tuple[float, str]:
        return min((t, label) for label, t in table[(name, m)].items() if label not in ("cuBLAS", "before"))

    for m in args.rows:
        names = [n for n in shapes if (n, m) in table]
        sums = {label: sum(table[(n, m)][label] * PER_STEP[n] for n in names) for label in ("cuBLAS", "shipped", "before")}
        best_sum = sum(best(n, m)[0] * PER_STEP[n] for n in names)
        picks = ", ".join(f"{n} {best(n, m)[1]}" for n in names)
        print(f"rows {m:>5}: cuBLAS {sums['cuBLAS']:8.2f} | shipped {sums['shipped']:8.2f} "
              f"({sums['shipped'] / sums['cuBLAS']:.2f}x cuBLAS) | before {sums['before']:8.2f} "
              f"| best per shape {best_sum:8.2f} ({picks})")
    if cpu:  # tests/mma_dot.py says why
        print("(CPU smoke run: the interpreter's tl.dot is numpy's, which rounds a row by its position; "
              "the line below means something on the GPU only)")
    print("row alone == the shipped row in the largest call: " + ", ".join(f"{l} {'yes' if v else 'NO'}"
                                                                        for l, v in invariant.items()))


if __name__ == "__main__":
    main()
