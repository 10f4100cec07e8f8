"""Data-parallel rollout over the default group: the engine ranks each generate their share
of one prompt list, and rank 0 gets every output back in the original order (prompt-major,
then sample), as if one engine had run them all.

Seeds are per request (SamplingParams.seed, sample index), so a prompt's samples do not
depend on which rank runs it or what else is batched there. With tensor parallelism an
engine is a TP group of consecutive engine ranks (DP x TP): its ranks all generate the
same share (SPMD) and its TP rank 0 alone hands the outputs in. Knows the split, the engine's
generate() and the wire format; not where prompts come from or what rank 0 does next.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rollout.distributed.collectives import gather_bytes, gather_floats
from rollout.distributed.group import DistContext
from rollout.distributed.phases import phase
from rollout.engine import Engine
from rollout.request import RolloutOutput, SamplingParams
from rollout.wire import pack_outputs, unpack_outputs


@dataclass
class DPRollout:
    """What rank 0 gets back: every output in the original order, and per engine (in
    engine-rank order; with TP an engine is a TP group) its timing and share."""

    outputs: list[RolloutOutput]
    wall_seconds: float  # from this rank's start to the last engine's results on rank 0
    rank_seconds: list[float]  # each engine's own generate() time (its TP rank 0's)
    rank_tokens: list[int]  # generated tokens per engine
    rank_prompts: list[int]

    @property
    def tokens(self) -> int:
        return sum(self.rank_tokens)


def split_indices(num_items: int, rank: int, world_size: int, mode: str = "strided") -> list[int]:
    """This rank's share of items 0..num_items-1, deterministic and covering each once.
    strided (r, r+W, ...) balances inputs sorted by length; contiguous keeps neighbours
    (and their shared prefixes) on one rank."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside a world of {world_size}")
    if mode == "strided":
        return list(range(rank, num_items, world_size))
    if mode == "contiguous":
        return list(range(rank * num_items // world_size, (rank + 1) * num_items // world_size))
    raise ValueError(f"split mode must be strided or contiguous, got {mode!r}")


def run_dp_rollout(
    engine: Engine | None,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    ctx: DistContext,
    *,
    engine_ranks: Sequence[int] | None = None,
    split: str = "strided",
    label: str = "rollout",
    common_start: bool = True,
    expect_version: int | None = None,
) -> DPRollout | None:
    """Generate this rank's share of `prompts` and gather everything on rank 0; None off rank 0.

    Every rank of the default group calls it with the same prompts and params (one for all
    prompts, or one per prompt). `engine_ranks` (default: every rank) hold an engine and
    split the prompts; the other ranks pass engine=None and only take part in the gather.
    `common_start`: a barrier first, so that the timing counts the rollout only (engines
    load at different speeds). `expect_version`: every output must carry only this weight
    version (an on-policy check for an RL loop), else the rank fails naming the prompt.
    """
    ranks = list(range(ctx.world_size)) if engine_ranks is None else list(engine_ranks)
    if (engine is not None) != (ctx.rank in ranks):
        raise ValueError(f"rank {ctx.rank}: an engine is expected exactly on the engine ranks {ranks}")
    per_prompt = list(params) if not isinstance(params, SamplingParams) else [params] * len(prompts)
    if len(per_prompt) != len(prompts):
        raise ValueError(f"{len(per_prompt)} sampling params for {len(prompts)} prompts")
    tp = engine.tp if engine is not None else None
    share = []
    if engine is not None:  # one share per engine: TP groups are consecutive engine ranks
        share = split_indices(len(prompts), ranks.index(ctx.rank) // tp.size, len(ranks) // tp.size, split)
    if common_start:
        with phase(ctx, f"{label}: common start"):
            dist.barrier()
    start = time.perf_counter()
    local: list[RolloutOutput] = []
    if engine is not None:
        with phase(ctx, f"{label}: generate {len(share)} prompts"):
            if share:
                local = engine.generate(input_ids=[prompts[i] for i in share], sampling_params=[per_prompt[i] for i in share])
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
            for out in local:  # local prompt index -> global; request ids made unique across ranks
                out.prompt_index = share[out.prompt_index]
                out.request_id = f"rank{ctx.rank}/{out.request_id}"
            if expect_version is not None:
                _check_version(local, expect_version, label)
    seconds = time.perf_counter() - start
    leader = tp is None or tp.rank == 0  # a TP group's other ranks hold the same outputs
    if not leader:
        local, share = [], []
    with phase(ctx, f"{label}: gather on rank 0"):
        chunks = gather_bytes(pack_outputs(local), ctx, dst=0)
        stats = gather_floats([seconds, float(sum(len(o.token_ids) for o in local)), float(len(share)),
                               float(leader)], ctx)
    if chunks is None:
        return None
    wall = time.perf_counter() - start
    outputs = sorted((o for c in chunks for o in unpack_outputs(c)), key=lambda o: (o.prompt_index, o.sample_index))
    expected = sum(p.n for p in per_prompt)
    if len(outputs) != expected:
        raise RuntimeError(f"{label}: gathered {len(outputs)} outputs, expected {expected}")
    mine = [stats[r] for r in ranks if stats[r][3]]  # one entry per engine (its TP rank 0)
    return DPRollout(outputs, wall, [s[0] for s in mine], [int(s[1]) for s in mine], [int(s[2]) for s in mine])


def _check_version(outputs: list[RolloutOutput], version: int, label: str) -> None:
    for out in outputs:
        if out.weight_version != version or any(v != version for v, _, _ in out.weight_versions):
            raise RuntimeError(f"{label}: output of prompt {out.prompt_index} carries weight versions "
                               f"{out.weight_versions}, expected only version {version}")
