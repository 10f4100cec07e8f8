"""Steady-state decode for the step-level diagnosis scripts (profile_step, diag_host,
bench_host): bring an engine to steady decode, and time named engine methods in place.
Knows the engine's scheduler queues; times whatever methods it is handed."""

from __future__ import annotations

import time
from collections.abc import Callable


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
