"""Triton JIT compiles inside a stretch of code (a benchmark's timed workload).

A Triton kernel compiles per constexpr set and per specialization of its integer and pointer
arguments, on its first launch in the process: 1-3 s each on a fresh machine. One first
launched inside a timed workload puts that compile in the figure (a first deterministic engine
ran workload (a) 13% slower than a second one in the same call). The benchmarks report the
count so a timing that paid for compiles says so."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class CompileRecord:
    names: list[str] = field(default_factory=list)  # one per compile, the kernel's name
    seconds: float = 0.0  # wall time from each cache miss to its compiled kernel

    def summary(self) -> str:
        if not self.names:
            return "no Triton compiles"
        counts: dict[str, int] = {}
        for n in self.names:
            counts[n] = counts.get(n, 0) + 1
        kernels = ", ".join(f"{n} x{c}" for n, c in sorted(counts.items()))
        return f"{len(self.names)} Triton compiles in {self.seconds:.1f} s ({kernels})"


@contextmanager
def triton_compiles() -> Iterator[CompileRecord]:
    """Records the compiles (in-process cache misses) made while active; a no-op record
    where Triton, or its runtime hooks (triton.knobs, 3.4+), are missing."""
    record = CompileRecord()
    try:
        from triton import knobs

        runtime = knobs.runtime
        before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    except (ImportError, AttributeError):
        yield record
        return
    started: list[float] = []

    def on_miss(*args, **kwargs):
        started.append(time.perf_counter())
        return before(*args, **kwargs) if before is not None else None  # truthy would skip the compile

    def on_compiled(*args, **kwargs):
        fn = kwargs.get("fn")
        record.names.append(getattr(fn, "name", "?"))
        if started:
            record.seconds += time.perf_counter() - started.pop()
        return after(*args, **kwargs) if after is not None else None

    runtime.jit_cache_hook, runtime.jit_post_compile_hook = on_miss, on_compiled
    try:
        yield record
    finally:
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = before, after
