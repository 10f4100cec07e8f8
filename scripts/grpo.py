"""GRPO on the engine: a policy from any HF checkpoint trains on a task it generates itself
(arithmetic with a checkable answer), with the engine colocated and synced every step.

    python -m scripts.grpo [--steps 12] [--output run.jsonl] [--lora]               # one process
    torchrun --nproc-per-node 2 scripts/grpo.py [--steps 12] [--output run.jsonl]   # data parallel

Each step: the engine samples n completions per prompt (the prompt's KV is shared by its
n samples), the task scores them, advantages are normalized within each group, the trainer
takes one clipped policy-gradient step with truncated importance sampling against the
engine's log-probs, and the new weights go into the engine in process (every weight, or
with --lora only the adapter). Under torchrun every rank is a trainer replica (DDP over
gloo on CPU, NCCL on GPU) with its own engine and its share of the prompts.

Per step: a table row in the terminal, one JSON object in --output, and a W&B run
(offline unless --wandb-mode online or WANDB_MODE says otherwise; `wandb sync DIR` uploads
an offline run later). Metric names follow verl (see rollout/rl/mismatch.py). By default
both land in a fresh directory under ~/.cache/rollout-engine/runs/ ($ROLLOUT_CACHE_DIR).
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from collections.abc import Sequence
from pathlib import Path

# Before torch loads OpenMP: idle intra-op workers sleep instead of spinning. On 2 cores
# with one other busy process, spinning workers made a demo step 92 s instead of 14-16 s
# (measured); on a lightly loaded machine sleeping costs ~5-10% a step (within the noise
# of those runs). Set OMP_WAIT_POLICY yourself to choose otherwise.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from rollout.distributed.launch_args import DTYPES, finite_float, int_at_least  # noqa: E402


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="HF checkpoint dir (default: SmolLM2-135M-Instruct, fetched once), or a benchmark shape "
                        "(qwen06b, llama8b, tiny) with random weights")
    p.add_argument("--task", choices=("auto", "arithmetic", "even-tokens"), default="auto",
                   help="auto: arithmetic when the checkpoint has a tokenizer, else even-tokens (token-level)")
    p.add_argument("--steps", type=int_at_least(1), default=12)
    p.add_argument("--prompts", type=int_at_least(1), default=8, help="prompts per step, over all ranks")
    p.add_argument("--samples", type=int_at_least(1), default=8, help="samples per prompt (the group size n)")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=8)
    p.add_argument("--temperature", type=finite_float(0.0), default=0.7)
    p.add_argument("--lr", type=finite_float(0.0), default=1e-5)
    p.add_argument("--max-grad-norm", type=finite_float(0.0, above=True), default=1.0)
    p.add_argument("--mini-batches", type=int_at_least(1), default=1, help="optimizer steps per rollout batch")
    p.add_argument("--micro-batch-size", type=int_at_least(0), default=0, help="samples per forward/backward; 0: all")
    p.add_argument("--layout", choices=("packed", "rows"), default="packed",
                   help="trainer input: a group's prompt once (packed) or a row per sample")
    p.add_argument("--clip", type=finite_float(0.0), default=0.2, help="PPO clip epsilon (low)")
    p.add_argument("--clip-high", type=finite_float(0.0), default=None, help="upper clip epsilon (default: --clip)")
    p.add_argument("--tis-cap", type=finite_float(), default=2.0, help="truncate the IS ratio at this; <= 0 turns TIS off")
    p.add_argument("--lora", action="store_true", help="train a PEFT LoRA adapter instead of every weight")
    p.add_argument("--lora-rank", type=int_at_least(1), default=16)
    p.add_argument("--lora-alpha", type=finite_float(0.0, above=True), default=32.0)
    p.add_argument("--sync", choices=("auto", "adapter", "full"), default="auto",
                   help="auto: LoRA-only sync for --lora, every weight otherwise")
    p.add_argument("--dataset-size", type=int_at_least(0), default=0,
                   help="a fixed dataset of N problems walked epoch after epoch (0: fresh problems every step)")
    p.add_argument("--speculative", choices=("none", "ngram", "suffix"), default="none",
                   help="speculative decoding in the engine; suffix drafts from earlier rollouts of the same prompt "
                        "(kept across weight updates), which a multi-epoch --dataset-size brings back")
    p.add_argument("--max-operand", type=int_at_least(1), default=9, help="arithmetic: operands in 1..N")
    p.add_argument("--system-prompt", default="Answer briefly.",
                   help="arithmetic: the system turn ('default': the chat template's own, longer)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="JSONL, one object per step (rank 0); default: RUN_DIR/grpo.jsonl")
    p.add_argument("--run-dir", default=None, help="default: ~/.cache/rollout-engine/runs/grpo-<time>")
    p.add_argument("--wandb-mode", choices=("offline", "online", "disabled"), default=None,
                   help="default: $WANDB_MODE, else offline")
    p.add_argument("--wandb-project", default="rollout-grpo")
    p.add_argument("--samples-every", type=int_at_least(1), default=5, help="a samples table every K steps (and step 1)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: each rank uses cuda:LOCAL_RANK")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    p.add_argument("--kv-memory-fraction", type=finite_float(0.0, 1.0, above=True), default=0.3,
                   help="GPU: share of the memory left after the engine's weights that its KV cache takes; "
                        "the trainer (colocated) needs the rest for its weights, optimizer and activations")
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None, help="default: nccl on cuda, else gloo")
    p.add_argument("--timeout-s", type=finite_float(0.0, above=True), default=300.0, help="collective timeout under torchrun")
    p.add_argument("--num-threads", type=int_at_least(1), default=None, help="torch threads per process on CPU")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    from rollout import Engine, EngineConfig
    from rollout.model.fetch import CACHE_ROOT, fetch_default_model
    from rollout.model.shapes import SHAPES, write_shape_dir
    from rollout.rl import (ArithmeticTask, Epochs, EvenTokenTask, GRPOConfig, GRPOTrainer, LoraSpec, LossConfig,
                            init_world, load_policy, run_grpo)
    from rollout.rl.console import ConsoleTable
    from rollout.rl.telemetry import JsonlSink, WandbSink, resolve_wandb_mode
    from rollout.rl.world import close_world

    started = time.perf_counter()
    world = init_world(args.backend or ("nccl" if args.device == "cuda" else "gloo"), args.device, args.timeout_s)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if args.device == "cuda" else torch.device("cpu")
    model_dir = args.model
    random_weights = model_dir in SHAPES and not os.path.isdir(model_dir)
    if random_weights:  # config.json only: the engine loads dummy weights, the policy random ones, then one sync
        model_dir = write_shape_dir(model_dir)
    if model_dir is None:
        with world.phase("fetch the default model"):
            if world.is_main:  # one download; the other ranks wait, then find it cached
                model_dir = str(fetch_default_model())
            world.barrier()
            model_dir = model_dir or str(fetch_default_model())

    config = GRPOConfig(
        prompts_per_step=args.prompts, samples_per_prompt=args.samples, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, lr=args.lr, max_grad_norm=args.max_grad_norm, mini_batches=args.mini_batches,
        micro_batch_size=args.micro_batch_size, layout=args.layout, seed=args.seed, samples_every=args.samples_every,
        loss=LossConfig(clip_low=args.clip, clip_high=args.clip_high if args.clip_high is not None else args.clip,
                        tis_cap=args.tis_cap if args.tis_cap > 0 else None),
    )
    lora = LoraSpec(rank=args.lora_rank, alpha=args.lora_alpha) if args.lora else None
    adapter_sync = args.lora and args.sync != "full"
    with world.phase("build engine and policy"):
        engine = Engine(EngineConfig(model=model_dir, dtype=args.dtype, device=str(device), page_size=16,
                                     seed=args.seed, enable_lora=adapter_sync, max_loras_per_batch=1,
                                     gpu_memory_fraction=args.kv_memory_fraction,
                                     max_lora_rank=args.lora_rank, load_format="dummy" if random_weights else "auto",
                                     speculative=None if args.speculative == "none" else args.speculative))
        policy = load_policy(model_dir, dtype=DTYPES[args.dtype], device=device, lora=lora,
                             random_seed=args.seed if random_weights else None)
        task_name = args.task if args.task != "auto" else "arithmetic" if engine.tokenizer is not None else "even-tokens"
        if task_name == "arithmetic":
            system = None if args.system_prompt == "default" else args.system_prompt
            task = ArithmeticTask(max_operand=args.max_operand, seed=args.seed, system_prompt=system)
        else:
            task = EvenTokenTask(vocab_size=engine.model_config.vocab_size, seed=args.seed)
        if args.dataset_size:
            task = Epochs(task, args.dataset_size)
        trainer = GRPOTrainer(engine, policy, task, config, world, sync=args.sync, initial_sync=random_weights)

    console = ConsoleTable()
    sinks: list = []
    wandb_sink = None
    if world.is_main:
        run_dir = Path(args.run_dir or CACHE_ROOT / "runs" / time.strftime("grpo-%Y%m%d-%H%M%S"))
        output = Path(args.output) if args.output else run_dir / "grpo.jsonl"
        sinks = [console, JsonlSink(output)]
        mode = resolve_wandb_mode(args.wandb_mode)
        if mode != "disabled":
            run_config = {**config.as_dict(), "model": model_dir, "task": task.name, "lora": args.lora,
                          "speculative": args.speculative,
                          "sync": "lora-only" if trainer.sync.lora_name else "full", "world_size": world.size,
                          "device": args.device, "dtype": args.dtype}
            try:
                wandb_sink = WandbSink(project=args.wandb_project, mode=mode, directory=run_dir, config=run_config)
                sinks.append(wandb_sink)
            except ImportError:
                print("wandb is not installed (pip install wandb, or the [rl] extra): logging to JSONL only")
        trainable = sum(p.numel() for p in trainer.params)
        what = f"LoRA r={args.lora_rank}" if args.lora else "full fine-tuning"
        sync = "LoRA-only" if trainer.sync.lora_name else "full-weight"
        print(f"GRPO: {Path(model_dir).name}, {what} ({trainable / 1e6:.1f}M trainable, {sync} sync every step), "
              f"task {task.name}; {world.size} rank(s) on {args.device}; {args.steps} steps x {args.prompts} prompts "
              f"x {args.samples} samples; ready in {time.perf_counter() - started:.0f} s")
        print(f"  JSONL, one object per step: {output.resolve()}")
        if wandb_sink is not None:
            print(f"  W&B {wandb_sink.mode} run: {wandb_sink.run_dir}")
        print(flush=True)

    records = run_grpo(trainer, args.steps, sinks, progress=console.progress if world.is_main else lambda _: None)

    if world.is_main:
        for sink in sinks:
            sink.close()
        rewards = [r["critic/rewards/mean"] for r in records]
        third = max(1, len(rewards) // 3)
        print(f"reward mean {rewards[0]:.3f} at step 1 -> {rewards[-1]:.3f} at step {len(rewards)} "
              f"(first {third} steps {sum(rewards[:third]) / third:.3f}, last {third} {sum(rewards[-third:]) / third:.3f}); "
              f"{time.perf_counter() - started:.0f} s in all")
        print(f"JSONL: {output.resolve()}")
        if wandb_sink is not None:
            hint = f"  (upload: wandb sync {wandb_sink.run_dir})" if wandb_sink.mode == "offline" else ""
            print(f"W&B {wandb_sink.mode} run: {wandb_sink.run_dir}{hint}")
    # The DDP wrapper holds the process group: drop it (and the engine) first, so the group's
    # gloo threads are joined by destroy_process_group while the interpreter is whole. CI once
    # saw rank 0 abort at exit ("terminate called without an active exception") after a
    # finished run, with the trainer still alive past the group's destruction.
    del trainer, engine, policy
    gc.collect()
    close_world(world)
    return records


if __name__ == "__main__":
    main()
