"""Host cost of a steady decode step, without a GPU: the model's forward is replaced by
cached logits, so what is timed is the engine's own Python and tensor bookkeeping
(schedule, prepare, sampling launch, read-back) at a large batch. On a GPU this is the
work overlap scheduling must hide behind each device step.

    python -m benchmarks.host [--batch 256] [--input-len 512] [--steps 150]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--page-size", type=int, default=16)
    args = parser.parse_args(argv)

    from rollout import Engine, EngineConfig, SamplingParams
    from rollout.model.shapes import write_shape_dir
    from benchmarks.common.steady import PhaseTimer, run_to_decode

    model_dir = write_shape_dir("tiny", prefix="bench-host-")
    engine = Engine(EngineConfig(model=model_dir, load_format="dummy", page_size=args.page_size,
                                 max_running_requests=args.batch, max_prefill_tokens=8192,
                                 max_total_tokens=args.batch * (args.input_len + args.steps + 64) + 4096))
    g = torch.Generator().manual_seed(0)
    for p in torch.randint(100, 400, (args.batch, args.input_len), generator=g).tolist():
        engine.add_request(p, SamplingParams(temperature=0, max_new_tokens=args.steps + 50, ignore_eos=True))
    run_to_decode(engine)
    assert len(engine.scheduler.running) == args.batch, "the KV pool must hold the whole batch"

    cached: dict[int, torch.Tensor] = {}
    forward = engine.runner.forward

    def cached_forward(fb):  # the model's cost is not what this measures
        n = fb.logits_indices.numel()
        if n not in cached:
            cached[n] = forward(fb)
        return cached[n]

    engine.runner.forward = cached_forward
    timer = PhaseTimer()
    for obj, name in ((engine.scheduler, "schedule"), (engine.runner, "prepare"), (engine.loop, "read_back")):
        timer.add(obj, name)
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    total = time.perf_counter() - start
    print(f"host per decode step, batch {args.batch}, context ~{args.input_len}, page {args.page_size}, "
          f"torch threads {torch.get_num_threads()}")
    for name in ("schedule", "prepare", "read_back"):
        print(f"  {name:<22} {1e3 * timer.seconds[name] / args.steps:6.2f} ms")
    print(f"  {'rest (sample, pack)':<22} {1e3 * (total - sum(timer.seconds.values())) / args.steps:6.2f} ms")
    print(f"  {'total':<22} {1e3 * total / args.steps:6.2f} ms")


if __name__ == "__main__":
    main()
