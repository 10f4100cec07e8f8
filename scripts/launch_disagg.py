"""Disaggregated RL loop under torchrun: trainer ranks 0..T-1 hold an HF model, engine ranks
T..T+E-1 each hold an Engine; after every training step the trainer's rank 0 broadcasts
the new weights to every engine over a private weight-sync group (NCCL on GPU, gloo on CPU).

    torchrun --nproc-per-node T+E scripts/launch_disagg.py --model DIR --trainer-ranks T \\
        [--device cpu|cuda] [--backend gloo|nccl] [--steps 2] [--samples 2] [--temperature 1] \\
        [--probe | --verify] [--save-dir DIR] [--output run.json] [--timeout-s 300]

One step: engines generate rollouts for their share of the prompts (strided) -> gathered on
rank 0 over the default group (and broadcast to the other trainer ranks) -> each trainer
rank takes an SGD step on the NLL of its share of the rollouts (with T > 1 the model is
wrapped in DDP over the trainer ranks, so the replicas stay identical and only rank 0
needs to send) -> rank 0 broadcasts the weights into the engines (weight-sync group of
world 1 + E: trainer rank 0 + engines; the other trainer ranks are not in it) -> every
engine checks that its version went up by one, and the next rollouts (and the --probe
greedy rollouts) must carry the new version. --verify also checks, on rank 0, that the
engines' greedy probe equals transformers' greedy with the trainer's weights (float32).

Every group (default, trainer DDP, weight sync) has --timeout-s: a rank that dies or hangs
makes the others fail with a report of which peer was where, not hang.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from rollout import Engine, SamplingParams
from rollout.distributed.collectives import broadcast_bytes, broadcast_int, gather_bytes
from rollout.distributed.dp_rollout import run_dp_rollout
from rollout.distributed.group import DistContext, init_distributed, shutdown
from rollout.distributed.launch_args import (DTYPES, add_common_args, build_engine, finite_float, int_at_least, maybe_die,
                                             resolve_backend, resolve_model)
from rollout.distributed.phases import phase
from rollout.distributed.ports import free_port
from rollout.distributed.prompts import load_prompts
from rollout.hf_trainer import hf_greedy, load_trainer_model, toy_train_step
from rollout.model.config import ModelConfig
from rollout.request import RolloutOutput
from rollout.wire import pack_outputs, unpack_outputs

@dataclass(frozen=True)
class Roles:
    """Ranks 0..T-1 train, T..world-1 generate. The weight-sync group is trainer rank 0
    (its rank 0) plus every engine (engine e is its rank 1 + e)."""

    trainer_ranks: int
    world_size: int

    def __post_init__(self) -> None:
        if self.trainer_ranks < 1:
            raise ValueError(f"--trainer-ranks must be >= 1, got {self.trainer_ranks}")
        if self.num_engines < 1:
            raise ValueError(f"world size {self.world_size} leaves no engine rank after {self.trainer_ranks} trainer ranks")

    @property
    def num_engines(self) -> int:
        return self.world_size - self.trainer_ranks

    def is_trainer(self, rank: int) -> bool:
        return rank < self.trainer_ranks

    def engine_index(self, rank: int) -> int:
        return rank - self.trainer_ranks

    @property
    def engine_ranks(self) -> range:
        return range(self.trainer_ranks, self.world_size)

    def in_sync_group(self, rank: int) -> bool:
        return rank == 0 or not self.is_trainer(rank)

    def role_of(self, rank: int) -> str:
        return f"trainer {rank}" if self.is_trainer(rank) else f"engine {self.engine_index(rank)}"


@dataclass
class StepRecord:
    step: int
    loss: float = float("nan")
    rollout_versions: list[int] = field(default_factory=list)  # versions seen in this step's rollouts
    engine_versions_after_sync: list[int] = field(default_factory=list)
    probe_versions: list[int] = field(default_factory=list)
    probe_tokens: list[list[int]] = field(default_factory=list)
    verified: bool | None = None
    sync_bytes: int = 0
    seconds: dict[str, float] = field(default_factory=dict)


def rollouts_on_rank0(ctx: DistContext, roles: Roles, engine: Engine | None, prompts: Sequence[Sequence[int]],
                      params: SamplingParams, label: str, expect_version: int) -> list[RolloutOutput] | None:
    """Engines generate their share; everything is gathered, in order, on rank 0."""
    run = run_dp_rollout(engine, prompts, params, ctx, engine_ranks=roles.engine_ranks,
                         label=label, common_start=False, expect_version=expect_version)
    return run.outputs if run is not None else None


def run_loop(args: argparse.Namespace, ctx: DistContext, roles: Roles) -> list[StepRecord]:
    rank, T = ctx.rank, roles.trainer_ranks
    model_dir, load_format = resolve_model(args.model, args.load_format)
    with phase(ctx, "trainer DDP group"):
        # new_group is collective over the whole default group, engines included.
        trainer_group = dist.new_group(list(range(T)), timeout=timedelta(seconds=args.timeout_s)) if T > 1 else None
    engine = model = optimizer = None
    with phase(ctx, "load model"):
        if roles.is_trainer(rank):
            torch.manual_seed(args.seed)
            model = load_trainer_model(model_dir, load_format, DTYPES[args.trainer_dtype], ctx.device, args.seed)
            optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
            if trainer_group is not None:
                from torch.nn.parallel import DistributedDataParallel as DDP

                ids = [ctx.device.index] if ctx.device.type == "cuda" else None
                model = DDP(model, device_ids=ids, process_group=trainer_group)
        else:
            engine = build_engine(args, ctx.device, seed=args.seed)
    hf_model = model.module if hasattr(model, "module") else model
    with phase(ctx, "agree on the weight-sync port"):
        port = broadcast_int(args.sync_port or (free_port(args.sync_addr) if rank == 0 else None), ctx)
    sender = None
    with phase(ctx, "join the weight-sync group"):
        world = 1 + roles.num_engines
        if rank == 0:
            from weightsync.transports.broadcast import BroadcastSender
            from weightsync.transports.group import open_group

            group = open_group(args.sync_addr, port, 0, world, backend=ctx.backend, timeout_s=args.timeout_s,
                               device=ctx.device if ctx.backend == "nccl" else None)
            sender = BroadcastSender(group, bucket_bytes=args.bucket_mb << 20)
        elif engine is not None:
            engine.init_weight_sync_group(args.sync_addr, port, 1 + roles.engine_index(rank), world, backend=ctx.backend,
                                          timeout_s=args.timeout_s)
    prompts = load_prompts(args.prompts, vocab_size=ModelConfig.from_dir(model_dir).vocab_size,
                           num_prompts=args.num_prompts, prompt_len=args.prompt_len, seed=args.seed)
    probe_params = SamplingParams(temperature=0, max_new_tokens=args.probe_tokens, ignore_eos=True)
    records = []
    for step in range(1, args.steps + 1):
        maybe_die(ctx, args, step)
        rec = StepRecord(step)
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                                n=args.samples, seed=args.seed + step, ignore_eos=args.ignore_eos, logprobs_mode="raw")
        t0 = time.perf_counter()
        rollouts = rollouts_on_rank0(ctx, roles, engine, prompts, params, f"step {step} rollouts", step - 1)
        rec.seconds["rollout"] = time.perf_counter() - t0
        if roles.is_trainer(rank):
            t0 = time.perf_counter()
            with phase(ctx, f"step {step}: rollouts to trainer ranks"):
                if trainer_group is not None:
                    buf = broadcast_bytes(pack_outputs(rollouts) if rank == 0 else None, ctx, src=0, group=trainer_group)
                    rollouts = unpack_outputs(buf)
            assert rollouts is not None
            if rank == 0:
                rec.rollout_versions = sorted({o.weight_version for o in rollouts})
            mine = rollouts[rank::T]
            if not mine:
                raise ValueError(f"step {step}: {len(rollouts)} rollouts cannot feed {T} trainer ranks")
            with phase(ctx, f"step {step}: train"):
                rec.loss = toy_train_step(model, optimizer, mine, ctx.device)
            rec.seconds["train"] = time.perf_counter() - t0
            if rank == 0 and args.save_dir:
                hf_model.save_pretrained(Path(args.save_dir) / f"step_{step}")
        t0 = time.perf_counter()
        with phase(ctx, f"step {step}: weight sync"):
            if sender is not None:
                rec.sync_bytes = sender.send(_weights(hf_model, args.dtype)).total_bytes
            elif engine is not None:
                version = engine.update_weights_from_distributed(full=True)
                if version != step:
                    raise RuntimeError(f"engine weight version is {version} after sync {step}, expected {step}")
        rec.seconds["sync"] = time.perf_counter() - t0
        with phase(ctx, f"step {step}: versions to rank 0"):
            versions = gather_bytes(_int_bytes(engine.weight_version if engine is not None else -1), ctx, dst=0)
        if versions is not None:
            rec.engine_versions_after_sync = [int(v.view(torch.int64)) for v in versions[T:]]
        if args.probe or args.verify:
            probe = rollouts_on_rank0(ctx, roles, engine, prompts, probe_params, f"step {step} probe", step)
            if probe is not None:
                rec.probe_versions = sorted({o.weight_version for o in probe})
                rec.probe_tokens = [o.token_ids for o in probe]
                if args.verify:
                    rec.verified = _verify(ctx, hf_model, prompts, probe, args.probe_tokens, step)
        if rank == 0:
            _print_step(rec, args)
        records.append(rec)
    with phase(ctx, "leave the weight-sync group"):
        if sender is not None:
            from weightsync.transports.group import close_group

            close_group(sender.group)
        elif engine is not None:
            engine.destroy_weight_sync_group()
    return records


def _weights(model: torch.nn.Module, engine_dtype: str):
    from weightsync.trainer import iter_hf_weights

    return iter_hf_weights(model, dtype=DTYPES[engine_dtype])  # send what the engine holds: bf16 halves the bytes


def _int_bytes(value: int) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int64).view(torch.uint8)


def _verify(ctx: DistContext, model: torch.nn.Module, prompts: Sequence[Sequence[int]], probe: list[RolloutOutput],
            max_new: int, step: int) -> bool:
    with phase(ctx, f"step {step}: verify probe against transformers"):
        for out in probe:
            want = hf_greedy(model, prompts[out.prompt_index], max_new, ctx.device)
            if out.token_ids != want:
                raise RuntimeError(f"step {step}: engine greedy for prompt {out.prompt_index} is {out.token_ids}, "
                                   f"transformers with the trainer's weights gives {want}")
    return True


def _print_step(rec: StepRecord, args: argparse.Namespace) -> None:
    secs = " ".join(f"{k} {v:.2f}s" for k, v in rec.seconds.items())
    rate = rec.sync_bytes / rec.seconds["sync"] / 1e9 if rec.sync_bytes and rec.seconds.get("sync") else 0.0
    extra = f", probe versions {rec.probe_versions}" if rec.probe_versions else ""
    extra += ", probe == transformers" if rec.verified else ""
    print(f"[disagg step {rec.step}/{args.steps}] loss {rec.loss:.4f}; rollouts made by versions {rec.rollout_versions}; "
          f"engines now at {rec.engine_versions_after_sync}{extra}; sync {rec.sync_bytes / 1e6:.1f} MB at {rate:.2f} GB/s; "
          f"{secs}", flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--trainer-ranks", type=int_at_least(1), default=1, help="ranks 0..T-1 train; the rest run engines")
    parser.add_argument("--trainer-dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--steps", type=int_at_least(1), default=2)
    parser.add_argument("--lr", type=finite_float(0.0), default=1e-2)
    parser.add_argument("--prompts", default=None, help="JSON list (or JSONL) of token-id lists (default: random)")
    parser.add_argument("--num-prompts", type=int_at_least(1), default=8)
    parser.add_argument("--prompt-len", type=int_at_least(1), default=32)
    parser.add_argument("--samples", type=int_at_least(1), default=2, help="samples per prompt (n)")
    parser.add_argument("--temperature", type=finite_float(0.0), default=1.0)
    parser.add_argument("--top-p", type=finite_float(0.0, 1.0, above=True), default=1.0)
    parser.add_argument("--max-new-tokens", type=int_at_least(1), default=32)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--seed", type=int, default=0, help="prompts, trainer init; step k samples with seed + k")
    parser.add_argument("--probe", action="store_true", help="greedy rollouts after every sync, recorded on rank 0")
    parser.add_argument("--verify", action="store_true", help="--probe, and check it equals transformers (float32)")
    parser.add_argument("--probe-tokens", type=int_at_least(1), default=8)
    parser.add_argument("--save-dir", default=None, help="rank 0 saves the trainer's weights after step k to step_k/")
    parser.add_argument("--output", default=None, help="rank 0 writes the step records here (JSON)")
    parser.add_argument("--sync-addr", default="127.0.0.1", help="the weight-sync store's host (trainer rank 0's)")
    parser.add_argument("--sync-port", type=int_at_least(0), default=0, help="0: rank 0 picks a free port")
    parser.add_argument("--bucket-mb", type=int_at_least(1), default=512)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    roles = Roles(args.trainer_ranks, int(os.environ.get("WORLD_SIZE", "1")))
    ctx = init_distributed(resolve_backend(args), args.device, args.timeout_s, roles.role_of)
    records = run_loop(args, ctx, roles)
    if ctx.rank == 0 and args.output:
        Path(args.output).write_text(json.dumps({"args": vars(args), "steps": [asdict(r) for r in records]}))
    shutdown(ctx)


if __name__ == "__main__":
    main()
