"""Deterministic mode on the GPU (issue #14): batch invariance, and the distance of the engine's
log-probs to an fp32 recompute, for the default engine and for EngineConfig(deterministic=True).

Random bf16 weights of a shape (rollout/model/shapes.py), the engine's GPU defaults otherwise
(FlashInfer or Triton attention, CUDA graphs, overlap). For each mode:
- 16 probe prompts generated alone, then among 64 other prompts, then among them with prefill
  chunks of 256 and the radix cache off: how many of the 16 give identical tokens, and how
  many identical tokens AND bitwise-identical log-probs, greedy and seeded sampling;
- mean / max |raw log-prob - recompute| over the probes' sampled tokens, the recompute by
  transformers in float32 from the engine's own weights; and in deterministic mode the
  OnPolicyScorer (the engine's kernels, the trainer's side) on the same device and dtype:
  how many of the 16 it reproduces bit for bit.

    python -m scripts.check_deterministic [--shape llama8b] [--new 64]
    python -m scripts.check_deterministic --modes deterministic --no-distance   # the invariance only
    python -m scripts.check_deterministic --shape tiny --device cpu --new 8      # smoke run
"""

from __future__ import annotations

import argparse
import gc

import torch

from rollout.model.shapes import SHAPES, write_shape_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama8b", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--new", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--mem-fraction", type=float, default=0.3)
    parser.add_argument("--modes", nargs="+", default=["default", "deterministic"], choices=["default", "deterministic"])
    parser.add_argument("--no-distance", action="store_true",
                        help="skip the fp32 transformers recompute (the invariance checks and the scorer still run)")
    args = parser.parse_args()

    from rollout import Engine, EngineConfig, SamplingParams
    from rollout.model.loader import iter_hf_views
    from rollout.rl.onpolicy import OnPolicyScorer

    vocab = SHAPES[args.shape]["vocab_size"]
    model_dir = write_shape_dir(args.shape, prefix=f"det-{args.shape}-")
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(32, 400, (80,), generator=g).tolist()
    prompts = [torch.randint(100, vocab - 100, (n,), generator=g).tolist() for n in lengths]
    probes, others = prompts[:16], prompts[16:]
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    greedy = SamplingParams(temperature=0, max_new_tokens=args.new, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, max_new_tokens=args.new, seed=7, ignore_eos=True, logprobs_mode="raw")
    rows = []
    hf_distance: dict[str, tuple[float, float]] = {}
    scorer_equal = None
    for deterministic in [m == "deterministic" for m in args.modes]:
        mode = "deterministic" if deterministic else "default"

        def make(**extra):
            return Engine(EngineConfig(model=model_dir, dtype=dtype, device=args.device, load_format="dummy",
                                       page_size=16, gpu_memory_fraction=args.mem_fraction,
                                       deterministic=deterministic, **extra))

        engine = make()
        for params, kind in ((greedy, "greedy"), (sampled, "sampled")):
            def run(eng, batch):
                """(tokens, log-probs) of each probe, in probe order."""
                outs = eng.generate(input_ids=batch, sampling_params=params)
                return [(outs[batch.index(p)].token_ids, outs[batch.index(p)].logprobs) for p in probes if p in batch]

            engine.flush_cache()
            alone = [run(engine, [p])[0] for p in probes]
            engine.flush_cache()
            mixed = run(engine, others[:30] + probes + others[30:])
            chunked_engine = make(max_prefill_tokens=256, enable_radix_cache=False)
            chunked = run(chunked_engine, others + probes)
            del chunked_engine
            _free()
            for name, got in (("among 64 others", mixed), ("chunks of 256, radix off", chunked)):
                same_tokens = sum(a[0] == b[0] for a, b in zip(alone, got))
                same_all = sum(a == b for a, b in zip(alone, got))
                rows.append((mode, kind, name, same_tokens, same_all))
                print(f"{mode}, {kind}, {name}: same tokens {same_tokens}/16, same tokens + log-probs {same_all}/16",
                      flush=True)
            if kind == "sampled":
                if not args.no_distance:
                    hf_distance[mode] = _distance_to_fp32(engine, probes, alone)
                    print(f"{mode}: |log-prob - fp32 recompute| mean {hf_distance[mode][0]:.2e}, "
                          f"max {hf_distance[mode][1]:.2e}", flush=True)
                if deterministic:
                    scorer = OnPolicyScorer(model_dir, dtype=engine.config.torch_dtype, device=args.device)
                    scorer.load(iter_hf_views(engine.model))
                    scored = scorer.score(probes, [t for t, _ in alone], temperature=1.0)
                    scorer_equal = sum(s.raw == lp for s, (_, lp) in zip(scored, alone))
                    del scorer
        del engine
        _free()

    print(f"\n{args.shape}, {dtype}, {args.device}: 16 probe prompts x {args.new} tokens, alone vs batched")
    print(f"{'mode':<14} | {'sampling':<8} | {'batched':<26} | {'same tokens':>11} | {'same tokens + log-probs':>23}")
    for mode, kind, name, same_tokens, same_all in rows:
        print(f"{mode:<14} | {kind:<8} | {name:<26} | {same_tokens:>8}/16 | {same_all:>20}/16")
    if hf_distance:
        print("\n|raw log-prob - fp32 transformers recompute| over the sampled probe tokens")
        for mode, (mean, worst) in hf_distance.items():
            print(f"{mode:<14} | mean {mean:.2e} | max {worst:.2e}")
    if scorer_equal is not None:
        print(f"OnPolicyScorer (deterministic, {dtype}): {scorer_equal}/16 sequences bitwise equal to the engine")


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _distance_to_fp32(engine, probes, outs) -> tuple[float, float]:
    """Mean / max |engine raw log-prob - transformers fp32| with the engine's weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rollout.model.loader import iter_hf_views

    config = AutoConfig.from_pretrained(engine.config.model)
    with torch.device(engine.device):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    params = dict(hf.named_parameters())
    with torch.no_grad():
        for name, tensor in iter_hf_views(engine.model):  # one tensor at a time: no second fp32 copy
            params[name].copy_(tensor)
    diffs = []
    with torch.no_grad():
        for prompt, (tokens, logprobs) in zip(probes, outs):
            ids = torch.tensor([prompt + tokens], device=engine.device)
            logits = hf(ids).logits[0, len(prompt) - 1 : -1].float()
            want = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None])[:, 0]
            diffs.append((torch.tensor(logprobs, device=want.device) - want).abs())
    del hf
    d = torch.cat(diffs)
    return d.mean().item(), d.max().item()


if __name__ == "__main__":
    main()
