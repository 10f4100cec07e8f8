"""What the torchrun launchers share on their command lines: the common options, and what
is built from them (model dir, backend, engine), plus the debug hook the failure tests
drive (--die-at-step). argparse only; no collectives here."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

from rollout.config import EngineConfig
from rollout.distributed.group import DistContext
from rollout.engine import Engine

# --dtype (the engine's) and the trainer's dtype, by name
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def int_at_least(low: int):
    """argparse type: an int >= low (argparse names the flag in its error)."""
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    parse.__name__ = "int"
    return parse


def finite_float(low: float | None = None, high: float | None = None, *, above: bool = False):
    """argparse type: a finite float in [low, high] ((low, high] with above=True)."""
    def parse(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be finite, got {text}")
        if low is not None and (value <= low if above else value < low):
            raise argparse.ArgumentTypeError(f"must be {'>' if above else '>='} {low}, got {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high}, got {value}")
        return value
    parse.__name__ = "float"
    return parse


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="HF checkpoint dir, or a built-in shape name (llama8b, qwen06b) for random weights")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: each rank uses cuda:LOCAL_RANK")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default=None, help="default: nccl with --device cuda, else gloo")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--timeout-s", type=finite_float(0.0, above=True), default=300.0, help="every collective group's timeout")
    parser.add_argument("--num-threads", type=int_at_least(1), default=None, help="torch threads per rank on CPU")
    parser.add_argument("--page-size", type=int_at_least(1), default=16)
    parser.add_argument("--max-total-tokens", type=int_at_least(1), default=None, help="KV budget per engine (tokens)")
    parser.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                        help="dummy: random weights of the checkpoint's shapes (benchmarks)")
    parser.add_argument("--die-at-step", type=int, default=None, help="debug (failure tests): make --die-rank die at this step")
    parser.add_argument("--die-rank", type=int, default=1, help="debug: which rank dies")
    parser.add_argument("--die-mode", choices=("exit", "hang"), default="hang", help="debug: exit silently (code 0) or hang")


def resolve_model(spec: str, load_format: str) -> tuple[str, str]:
    """A checkpoint dir as given, or a built-in benchmark shape (rollout.model.shapes)
    written as a config.json into a temp dir, with random ("dummy") weights."""
    if os.path.isdir(spec):
        return spec, load_format
    from rollout.model.shapes import SHAPES, write_shape_dir

    if spec not in SHAPES:
        raise ValueError(f"--model {spec!r} is neither a directory nor a built-in shape {sorted(SHAPES)}")
    return write_shape_dir(spec), "dummy"


def resolve_backend(args: argparse.Namespace) -> str:
    return args.backend or ("nccl" if args.device == "cuda" else "gloo")


def build_engine(args: argparse.Namespace, device: torch.device, seed: int = 0, tensor_parallel_size: int = 1) -> Engine:
    """One engine on `device` from the common options (--model, --dtype, --page-size, ...).
    With tensor_parallel_size > 1 every rank of the world calls this at once (TP groups of
    consecutive ranks, rollout/distributed/tp.py)."""
    model_dir, load_format = resolve_model(args.model, args.load_format)
    return Engine(EngineConfig(model=model_dir, dtype=args.dtype, device=str(device), page_size=args.page_size,
                               max_total_tokens=args.max_total_tokens, load_format=load_format, seed=seed,
                               num_threads=args.num_threads, tensor_parallel_size=tensor_parallel_size))


def maybe_die(ctx: DistContext, args: argparse.Namespace, step: int) -> None:
    """Debug hook (--die-at-step / --die-rank / --die-mode) for the failure tests.
    exit: leave with code 0, which torchrun does not treat as a failure, so the peers
    must notice on their own; hang: stay alive and silent, which only a timeout catches."""
    if args.die_at_step is None or step != args.die_at_step or ctx.rank != args.die_rank:
        return
    # No phase entry: a real dead rank would not announce it; peers must work it out.
    print(f"[rank {ctx.rank}] --die-at-step {step}: simulating a dead rank ({args.die_mode})", file=sys.stderr, flush=True)
    if args.die_mode == "exit":
        os._exit(0)
    while True:
        time.sleep(3600)
