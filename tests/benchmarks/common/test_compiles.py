"""The compile counter the benchmarks print (benchmarks/common/compiles.py): it sees Triton's
cache-miss and post-compile hooks while active, chains to hooks already installed, and puts
them back after."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.common.compiles import triton_compiles

knobs = pytest.importorskip("triton").knobs


def test_counts_compiles_and_restores_the_hooks() -> None:
    seen = []
    runtime = knobs.runtime
    outer_miss, outer_done = (lambda **kw: seen.append("miss")), (lambda **kw: seen.append("done"))
    runtime.jit_cache_hook, runtime.jit_post_compile_hook = outer_miss, outer_done
    try:
        with triton_compiles() as record:
            for name in ("matmul_kernel", "matmul_kernel", "_tiled_rows_kernel"):
                # what JITFunction._do_compile calls around a compile; a truthy cache hook would skip it
                assert not runtime.jit_cache_hook(key=name, fn=SimpleNamespace(name=name))
                runtime.jit_post_compile_hook(key=name, fn=SimpleNamespace(name=name))
        assert record.names == ["matmul_kernel", "matmul_kernel", "_tiled_rows_kernel"]
        assert record.seconds >= 0.0
        assert record.summary().startswith("3 Triton compiles") and "matmul_kernel x2" in record.summary()
        assert seen == ["miss", "done"] * 3  # the hooks already there still ran
        assert runtime.jit_cache_hook is outer_miss and runtime.jit_post_compile_hook is outer_done
    finally:
        runtime.jit_cache_hook = runtime.jit_post_compile_hook = None


def test_nothing_compiled_says_so() -> None:
    with triton_compiles() as record:
        pass
    assert record.names == [] and record.summary() == "no Triton compiles"
