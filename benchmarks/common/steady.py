"""Steady-state decode for the step-level diagnosis scripts (profile_step, benchmarks.diagnostics.host_time,
benchmarks.host): bring an engine to steady decode, and time named engine methods in place.
Knows the engine's scheduler queues; times whatever methods it is handed. `split_steps`
runs an engine's queued work to the end and splits its wall time by kind of step."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field


def run_to_decode(engine, warm_steps: int = 0) -> None:
    """Step until every queued request has its first token (prefill done), then a few more."""
    while engine.scheduler.waiting or any(not r.output_ids for r in engine.scheduler.running):
        engine.step()
    for _ in range(warm_steps):
        engine.step()


class PhaseTimer:
    """Wraps methods (`add(obj, "schedule")`) to add their wall time to `seconds[key]`;
    `after` (a device sync, say) runs inside the timed span. `restore()` unwraps them all."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {}  # each call's seconds, in order
        self._originals: list[tuple[object, str, Callable]] = []

    @property
    def seconds(self) -> dict[str, float]:
        """Total seconds per key."""
        return {key: sum(times) for key, times in self.samples.items()}

    def add(self, obj: object, name: str, key: str | None = None, after: Callable[[], None] | None = None) -> None:
        fn, key = getattr(obj, name), key or name
        self.samples.setdefault(key, [])

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            if after is not None:
                after()
            self.samples[key].append(time.perf_counter() - start)
            return out

        setattr(obj, name, wrapper)
        self._originals.append((obj, name, fn))

    def restore(self) -> None:
        for obj, name, fn in reversed(self._originals):
            setattr(obj, name, fn)
        self._originals.clear()


@dataclass
class StepSplit:
    """A run's steps by kind: those that replayed a decode CUDA graph, and the rest (prefill
    chunks, mixed prefill + decode steps, eager decode), with each one's wall seconds."""

    graph: list[float] = field(default_factory=list)
    eager: list[float] = field(default_factory=list)

    def summary(self) -> str:
        def part(name: str, secs: list[float]) -> str:
            if not secs:
                return f"{name} steps 0"
            return (f"{name} steps {len(secs)}: {sum(secs):.2f} s (median {1e3 * statistics.median(secs):.2f} ms)")

        return f"{part('graph', self.graph)}; {part('eager', self.eager)}"


def split_steps(engine) -> StepSplit:
    """Step `engine` until it has nothing left, timing each step and noting whether it replayed
    a decode graph. With overlap scheduling a step's wall time includes reading back the step
    before it: the split is of the run's own clock, as generate() sees it."""
    graphs = engine.runner.graphs
    split = StepSplit()
    while engine.has_unfinished():
        replays = graphs.num_replays if graphs is not None else 0
        start = time.perf_counter()
        engine.step()
        secs = time.perf_counter() - start
        replayed = graphs is not None and graphs.num_replays > replays
        (split.graph if replayed else split.eager).append(secs)
    return split
