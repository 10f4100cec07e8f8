"""A per-rank phase log in the rendezvous store, so that a rank whose collective fails can
say which peer is missing and where that peer last was; and `fail()`, which prints that
report and leaves with exit code 1.

Knows the store and the ranks' roles (a name per rank), not what the phases do.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, NoReturn, Protocol

_PEER_QUERY_TIMEOUT_S = 5.0  # bounded look-ups while reporting a failure


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


class PhaseContext(Protocol):
    """What a phase report reads of this process's place in the group (group.py's DistContext)."""

    @property
    def rank(self) -> int: ...

    @property
    def backend(self) -> str: ...

    @property
    def timeout_s(self) -> float: ...

    @property
    def tracker(self) -> PhaseTracker: ...


@contextmanager
def phase(ctx: PhaseContext, name: str) -> Iterator[None]:
    """Announce a phase; any exception inside it becomes fail() with the peers' phases."""
    ctx.tracker.enter(name)
    try:
        yield
    except Exception as error:
        fail(ctx, name, error)


def fail(ctx: PhaseContext, where: str, error: BaseException) -> NoReturn:
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
