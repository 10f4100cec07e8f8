"""The sampler with its race on the Triton kernel (kernels/race.py) against the torch race,
one table: ms of `sampling.sample` for a sampled batch (temperature 1, no filters) and of the
race alone, at a few row counts and a Llama-3 vocabulary, with the tokens checked equal.

    python -m benchmarks.kernels.race [--rows 1 64 512] [--vocab 128256]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common.kernel_device import kernel_ms
from rollout.request import Req, SamplingParams
from rollout.sampling import SamplingBatch, race, sample


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 512])
    ap.add_argument("--vocab", type=int, default=128256)
    args = ap.parse_args()
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, vocab {args.vocab}, temperature 1")
    print("| rows | sample, torch race ms | sample, kernel ms | race torch ms | race kernel ms | tokens equal |")
    print("|---:|---:|---:|---:|---:|---|")
    for rows in args.rows:
        g = torch.Generator().manual_seed(rows)
        logits = (3 * torch.randn(rows, args.vocab, generator=g)).to(device)
        reqs = [Req(rid=str(i), prompt_ids=[1, 2, 3], params=SamplingParams(temperature=1.0), seed=1000 + i)
                for i in range(rows)]
        sb = SamplingBatch.from_reqs(reqs, args.vocab, device)
        processed = torch.log_softmax(logits, dim=-1)
        times, tokens = {}, {}
        for fused in (False, True):
            on = None if fused else False  # False: the torch ops on the GPU
            tokens[fused] = sample(logits.clone(), sb, fused=on).token_ids
            times["sample", fused] = kernel_ms(lambda: sample(logits, sb, fused=on), device)
            times["race", fused] = kernel_ms(lambda: race(processed, sb.seeds, sb.positions, on), device)
        print(f"| {rows} | {times['sample', False]:.3f} | {times['sample', True]:.3f} | {times['race', False]:.3f} | "
              f"{times['race', True]:.3f} | {bool(torch.equal(tokens[False], tokens[True]))} |")


if __name__ == "__main__":
    main()
