"""The main job on the default model: a batch of chat prompts, n samples each, through the
engine on CPU; prints the completions, tokens/s and the prefix-cache hit rate.

    python -m scripts.demo [--n 4] [--max-new-tokens 48] [--temperature 0.7]
"""

from __future__ import annotations

import argparse
import time

QUESTIONS = [
    "What is the capital of France?",
    "Give me two tips for writing clean Python code.",
    "What is 12 times 7? Answer with the number.",
    "Write a one-line poem about autumn.",
    "Name three planets of the solar system.",
    "What does a CPU do, in one sentence?",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt (GRPO-style group)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="HF checkpoint dir (default: SmolLM2-135M-Instruct, fetched once)")
    args = parser.parse_args()

    from rollout import Engine, EngineConfig, SamplingParams
    from rollout.model.fetch import fetch_default_model

    path = args.model or str(fetch_default_model())
    print(f"loading {path}", flush=True)
    engine = Engine(EngineConfig(model=path, dtype="float32", device="cpu", page_size=16))
    tok = engine.tokenizer
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in QUESTIONS
    ]
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                            n=args.n, seed=args.seed)
    print(f"generating {len(prompts)} prompts x {args.n} samples ...", flush=True)
    start = time.perf_counter()
    outs = engine.generate(prompts=prompts, sampling_params=params, progress=True)
    elapsed = time.perf_counter() - start

    for out in outs:
        if out.sample_index == 0:
            print(f"\n### {QUESTIONS[out.prompt_index]}")
        mean_lp = sum(out.logprobs) / max(1, len(out.logprobs))
        text = (out.text or "").strip().replace("\n", " ")
        print(f"  [{out.sample_index}] ({len(out.token_ids)} tok, {out.finish_reason}, mean logprob {mean_lp:.2f}) {text}")

    stats = engine.stats()
    generated = sum(len(o.token_ids) for o in outs)
    print(f"\n{len(outs)} samples, {generated} tokens in {elapsed:.1f} s: {generated / elapsed:.1f} tok/s")
    print(f"prefix-cache hit rate {stats.prefix_cache_hit_rate:.1%} "
          f"({stats.counters['cached_prompt_tokens']} of {stats.counters['prompt_tokens']} prompt tokens), "
          f"weight version {stats.weight_version}")


if __name__ == "__main__":
    main()
