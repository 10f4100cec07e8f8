"""Structured-output benchmark (issue #18): steady decode throughput of a batch whose rows are
half JSON-constrained against the same batch unconstrained (goal on the GPU: <= 5% slower at
batch 256), and grammar compile times.

CPU (default): the real SmolLM2-135M-Instruct, fp32, batch 16.
GPU (--gpu): random bf16 weights shaped like Llama-3.1-8B (CUDA graphs and overlap scheduling
on, as the engine runs by default), batch 256, with SmolLM2's tokenizer (--tokenizer: a
directory holding its tokenizer files; its 49152 ids sit inside the 128256-wide vocabulary).

    python -m benchmarks.structured [--batch 16] [--steps 16]
    python -m benchmarks.structured --gpu --tokenizer DIR [--batch 256] [--steps 64]
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

from rollout import Engine, EngineConfig
from benchmarks.common.structured import compile_times, mixed_batch, steady_decode

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _engine(args) -> Engine:
    if not args.gpu:
        from rollout.model.fetch import fetch_default_model

        return Engine(EngineConfig(model=str(fetch_default_model()), page_size=16, max_running_requests=args.batch))
    from rollout.model.shapes import write_shape_dir

    model_dir = write_shape_dir(args.shape, prefix="bench-structured-")
    for name in TOKENIZER_FILES:
        if (Path(args.tokenizer) / name).is_file():
            shutil.copy(Path(args.tokenizer) / name, model_dir)
    cuda = args.device.startswith("cuda")
    return Engine(EngineConfig(model=model_dir, device=args.device, dtype="bfloat16" if cuda else "float32",
                               load_format="dummy", max_total_tokens=None if cuda else 65536,
                               max_running_requests=args.batch, page_size=16, max_prefill_tokens=8192,
                               gpu_memory_fraction=0.85))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", action="store_true", help="the Llama-3.1-8B shape on cuda (random weights)")
    parser.add_argument("--tokenizer", help="--gpu: a directory with SmolLM2's tokenizer files")
    parser.add_argument("--shape", default="llama8b", help="--gpu: the model shape (random weights)")
    parser.add_argument("--device", default="cuda", help="--gpu: cpu only for a smoke run with --shape tiny")
    parser.add_argument("--batch", type=int, default=None, help="rows (default 16 on CPU, 256 on the GPU)")
    parser.add_argument("--steps", type=int, default=None, help="timed decode steps (default 16 CPU, 64 GPU)")
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 32 CPU, 128 GPU)")
    parser.add_argument("--repeats", type=int, default=2, help="alternate the two batches this many times, keep the best")
    args = parser.parse_args(argv)
    if args.gpu and not args.tokenizer:
        parser.error("--gpu needs --tokenizer DIR (SmolLM2's tokenizer.json and tokenizer_config.json)")
    args.batch = args.batch or (256 if args.gpu else 16)
    args.steps = args.steps or (64 if args.gpu else 16)
    prompt_len = args.prompt_len or (128 if args.gpu else 32)

    engine = _engine(args)
    if engine.tokenizer is None:
        raise SystemExit("the engine has no tokenizer: structured output needs one")
    gen = torch.Generator().manual_seed(0)
    # ordinary text ids (the tokenizer's own range), so the prompts decode to something
    prompts = torch.randint(100, min(len(engine.tokenizer), engine.model_config.vocab_size), (args.batch, prompt_len),
                            generator=gen).tolist()
    plain, mixed = mixed_batch(prompts, max_new_tokens=args.steps * 4 + 64)
    best: dict[str, object] = {}
    for _ in range(args.repeats):
        for label, params in (("unconstrained", plain), ("half JSON-constrained", mixed)):
            result = steady_decode(engine, label, prompts, params, args.steps)
            if label not in best or result.tokens_per_s > best[label].tokens_per_s:  # type: ignore[attr-defined]
                best[label] = result

    device = torch.cuda.get_device_name() if engine.device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    model = f"{args.shape} shape, {engine.config.dtype}, random weights" if args.gpu else "SmolLM2-135M-Instruct, fp32"
    print(f"\n{model}, {device}; batch {args.batch}, prompt {prompt_len}, {args.steps} timed decode steps, "
          f"T=1, best of {args.repeats}")
    print(f"{'batch':<24} | {'tok/s':>9} | {'ms/step':>8} | {'rows running':>12} | {'vs unconstrained':>16}")
    base = best["unconstrained"].tokens_per_s  # type: ignore[attr-defined]
    for r in best.values():
        print(f"{r.label:<24} | {r.tokens_per_s:>9.1f} | {r.step_ms:>8.2f} | {r.rows_running:>12} | "  # type: ignore[attr-defined]
              f"{100 * (r.tokens_per_s / base - 1):>+15.1f}%")  # type: ignore[attr-defined]
    print(f"\ngrammar compile ({engine.model_config.vocab_size}-token vocabulary)")
    for label, seconds in compile_times(engine.tokenizer, engine.model_config.vocab_size, sorted(engine.eos_token_ids)):
        print(f"  {label:<40} {seconds * 1000:>9.2f} ms")


if __name__ == "__main__":
    main()
