"""Shared by the torchrun launchers: process-group set-up with timeouts, a per-rank phase
log in the rendezvous store (so a failure names the peer that is missing and where it
was), prompt splitting, and byte-buffer gather/broadcast over torch.distributed.

Every collective group gets `timeout_s`. With gloo a collective whose peer died or hangs
raises after that long (or at once, on a closed connection). With NCCL we set
TORCH_NCCL_BLOCKING_WAIT=1 before the group exists, so a timed-out collective raises in
the calling thread too (instead of the watchdog aborting the process before we can say
which peer was missing). Either way `fail()` prints one clear report and leaves with
exit code 1 without running destructors that could block on a dead peer.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from rollout.distributed.ports import free_port

_PEER_QUERY_TIMEOUT_S = 5.0  # bounded look-ups while reporting a failure


@dataclass(frozen=True)
class DistContext:
    """This process's place in the default group, and where collectives' tensors live."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device  # engine / model device (cuda:LOCAL_RANK or cpu)
    comm_device: torch.device  # where tensors must be to cross the default group
    timeout_s: float
    tracker: PhaseTracker


class PhaseTracker:
    """Each rank writes the phase it is entering to the rendezvous store, so a rank whose
    collective fails can say which peers never got there and what they were doing. Under
    torchrun the store lives in the agent, so it outlives any worker."""

    def __init__(self, store: Any, rank: int, world_size: int, role_of: Callable[[int], str]) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.role_of = role_of
        self.phase = "start"
        self.since = time.time()

    def enter(self, phase: str) -> None:
        self.phase, self.since = phase, time.time()
        self.store.set(f"phase/{self.rank}", json.dumps({"phase": phase, "t": self.since}))

    def describe_peers(self) -> str:
        """One line per peer not in our phase: where it last said it was, and how long ago."""
        try:
            self.store.set_timeout(timedelta(seconds=_PEER_QUERY_TIMEOUT_S))
        except Exception:
            pass
        lines = []
        now = time.time()
        for peer in range(self.world_size):
            if peer == self.rank:
                continue
            key = f"phase/{peer}"
            try:
                if not self.store.check([key]):
                    lines.append(f"rank {peer} ({self.role_of(peer)}): never reported a phase")
                    continue
                info = json.loads(self.store.get(key))
            except Exception as error:  # the store itself is gone (its host died)
                return f"(peer phases unavailable: the rendezvous store is unreachable: {error})"
            if info["phase"] != self.phase:
                lines.append(f"rank {peer} ({self.role_of(peer)}): last at {info['phase']!r}, {now - info['t']:.1f} s ago")
        if not lines:
            return "every peer reported reaching this phase (one may have died inside it)"
        return "; ".join(lines)


@contextmanager
def phase(ctx: DistContext, name: str) -> Iterator[None]:
    """Announce a phase; any exception inside it becomes fail() with the peers' phases."""
    ctx.tracker.enter(name)
    try:
        yield
    except Exception as error:
        fail(ctx, name, error)


def fail(ctx: DistContext, where: str, error: BaseException) -> NoReturn:
    """Report and leave. os._exit: process-group destructors (and atexit hooks) can block
    forever on a peer that is gone, which is exactly the hang we are avoiding."""
    tracker = ctx.tracker
    waited = time.time() - tracker.since
    lines = [
        f"[rank {ctx.rank} {tracker.role_of(ctx.rank)}] FAILED in {where!r} after {waited:.1f} s "
        f"(collective timeout {ctx.timeout_s:g} s, backend {ctx.backend}): {type(error).__name__}: {error}",
        f"[rank {ctx.rank}] peers: {tracker.describe_peers()}",
    ]
    traceback.print_exception(error, file=sys.stderr)
    print("\n".join(lines), file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


def init_distributed(backend: str, device: str, timeout_s: float, role_of: Callable[[int], str]) -> DistContext:
    """Default group from torchrun's environment (or a world of one without torchrun).

    The rendezvous is done here rather than inside init_process_group so that we keep the
    store for the phase log; the group itself gets a "default_pg" prefix exactly as
    init_process_group would give it.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"--backend must be gloo or nccl, got {backend!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {device!r}")
    if backend == "nccl" and device != "cuda":
        raise ValueError("--backend nccl moves CUDA tensors: use it with --device cuda")
    if not timeout_s > 0:
        raise ValueError(f"--timeout-s must be > 0, got {timeout_s}")
    if "RANK" not in os.environ:  # plain `python launch_x.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda: this process sees no CUDA device")
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if backend == "nccl":
        # A timed-out NCCL collective then raises in our thread (see the module docstring).
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    dist.init_process_group(
        backend, store=dist.PrefixStore("default_pg", store), rank=rank, world_size=world_size, timeout=timeout,
        device_id=dev if backend == "nccl" else None,
    )
    tracker = PhaseTracker(dist.PrefixStore("launcher", store), rank, world_size, role_of)
    comm_device = dev if backend == "nccl" else torch.device("cpu")
    return DistContext(rank, world_size, local_rank, backend, dev, comm_device, timeout_s, tracker)


def shutdown(ctx: DistContext) -> None:
    with phase(ctx, "shutdown barrier"):
        dist.barrier()
    dist.destroy_process_group()


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


def gather_bytes(buf: torch.Tensor, ctx: DistContext, dst: int = 0) -> list[torch.Tensor] | None:
    """Gather one variable-length uint8 buffer per rank of the default group onto `dst`.
    Two collectives: the sizes (everyone needs the max, to pad), then the padded buffers."""
    device = ctx.comm_device
    size = torch.tensor([buf.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(ctx.world_size)]
    dist.all_gather(sizes, size)
    lengths = [int(s.item()) for s in sizes]
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[: buf.numel()] = buf.to(device)
    chunks = [torch.empty_like(padded) for _ in range(ctx.world_size)] if ctx.rank == dst else None
    dist.gather(padded, chunks, dst=dst)
    if chunks is None:
        return None
    return [chunk[:n].cpu() for chunk, n in zip(chunks, lengths)]


def broadcast_bytes(buf: torch.Tensor | None, ctx: DistContext, src: int, group: Any = None) -> torch.Tensor:
    """Broadcast a uint8 buffer from global rank `src` to the ranks of `group`."""
    device = ctx.comm_device
    size = torch.tensor([buf.numel() if buf is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    data = buf.to(device) if buf is not None else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=src, group=group)
    return data.cpu()


def broadcast_int(value: int | None, ctx: DistContext, src: int = 0) -> int:
    t = torch.tensor([value if value is not None else 0], dtype=torch.int64, device=ctx.comm_device)
    dist.broadcast(t, src=src)
    return int(t.item())


def gather_floats(values: list[float], ctx: DistContext) -> list[list[float]]:
    """all_gather a fixed-length float list from every rank (timings, counters)."""
    t = torch.tensor(values, dtype=torch.float64, device=ctx.comm_device)
    out = [torch.empty_like(t) for _ in range(ctx.world_size)]
    dist.all_gather(out, t)
    return [o.cpu().tolist() for o in out]


def maybe_die(ctx: DistContext, args: Any, step: int) -> None:
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


def add_common_args(parser: Any) -> None:
    parser.add_argument("--model", required=True,
                        help="HF checkpoint dir, or a built-in shape name (llama8b, qwen06b) for random weights")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: each rank uses cuda:LOCAL_RANK")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default=None, help="default: nccl with --device cuda, else gloo")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="every collective group's timeout")
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads per rank on CPU")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-total-tokens", type=int, default=None, help="KV budget per engine (tokens)")
    parser.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                        help="dummy: random weights of the checkpoint's shapes (benchmarks)")
    parser.add_argument("--die-at-step", type=int, default=None, help="debug (failure tests): make --die-rank die at this step")
    parser.add_argument("--die-rank", type=int, default=1, help="debug: which rank dies")
    parser.add_argument("--die-mode", choices=("exit", "hang"), default="hang", help="debug: exit silently (code 0) or hang")


def resolve_model(spec: str, load_format: str) -> tuple[str, str]:
    """A checkpoint dir as given, or a built-in benchmark shape (scripts.bench_rollout's
    SHAPES) written as a config.json into a temp dir, with random ("dummy") weights."""
    if os.path.isdir(spec):
        return spec, load_format
    from rollout.model.shapes import SHAPES, write_shape_dir

    if spec not in SHAPES:
        raise ValueError(f"--model {spec!r} is neither a directory nor a built-in shape {sorted(SHAPES)}")
    return write_shape_dir(spec), "dummy"


def resolve_backend(args: Any) -> str:
    return args.backend or ("nccl" if args.device == "cuda" else "gloo")
