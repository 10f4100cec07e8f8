"""The kernel micro-benchmarks of benchmarks/kernels/ run end to end on CPU (tiny shapes, the
kernels under the Triton interpreter), so the commands BENCHMARKS.md names keep running."""

from __future__ import annotations

import pytest

from module_run import run_main


def test_bench_batch_invariant_smoke_on_cpu(capsys) -> None:
    """The matmul bench on tiny shapes under the interpreter: every path it times (pointer,
    split, TMA, the "before" kernel, the CPU BLAS in cuBLAS's column) runs and the sums print."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the Triton kernels under TRITON_INTERPRET=1 (tests/conftest.py sets it on CPU)")
    # chunks of 256: the tiny shapes' K (576, 832) then spans several, so the split path runs
    text = run_main("benchmarks.kernels.batch_invariant", "--device", "cpu", "--rows", "1", "40", "--k-chunk", "256",
                    capsys=capsys, interpreted=True)
    sums = [line for line in text.splitlines() if line.startswith("rows ")]
    assert len(sums) == 2 and all("shipped" in line and "before" in line for line in sums), text[-2000:]
    assert "16x64x128x4x3/split" in text and "64x128x64x4x4/tma" in text, text[-2000:]


def test_sgmv_bench_tables_smoke_on_cpu(capsys) -> None:
    """Both tables of python -m benchmarks.kernels.sgmv on the tiny shape, the kernels under the
    interpreter: per projection, and the decode step in the four launch modes."""
    # one layer: the tables, not the walk
    text = run_main("benchmarks.kernels.sgmv", "--device", "cpu", "--layers", "1", capsys=capsys, interpreted=True)
    assert sum(line.startswith(("qkv ", "o ", "gate_up ", "down ")) for line in text.splitlines()) == 4 * 6, text
    steps = [line.split() for line in text.splitlines() if line[:1].isdigit()]
    assert [row[:2] for row in steps] == [["1", "1"], ["4", "1"], ["4", "2"]], text[-1500:]
    assert all(len(row) == 3 + 4 + 4 for row in steps[1:]), "base, four modes, four added columns"
    assert "in order ms" in text and "side+pdl ms" in text and "deferred ms" in text
    assert "PDL available here: False" in text


def test_finite_check_sweep_smoke_on_cpu(capsys) -> None:
    """python -m benchmarks.kernels.finite on the tiny shape under the interpreter: the
    model's tensors, the copy and read peers, one swept variant (checked, then timed)."""
    text = run_main("benchmarks.kernels.finite", "--device", "cpu", capsys=capsys, interpreted=True)
    assert "tiny: 21 tensors" in text and "copy (read + write)" in text and "flat amax (read)" in text, text
    rows = [line.split() for line in text.splitlines() if line.strip()[:1].isdigit()]
    assert [row[:3] for row in rows] == [["4096", "1024", "4"]], text
    assert "best: CHUNK=4096 BLOCK=1024 warps=4" in text


def test_skinny_matmul_sweep_smoke_on_cpu(capsys) -> None:
    """python -m benchmarks.kernels.skinny on the tiny shape under the interpreter: each
    projection against F.linear (checked, then timed) and the step's total."""
    text = run_main("benchmarks.kernels.skinny", "--device", "cpu", capsys=capsys, interpreted=True)
    names = [line.split()[0] for line in text.splitlines() if "cuBLAS" in line and "N=" in line]
    assert names == ["qkv", "o", "gate_up", "down", "lm_head"], text
    assert "a step's projections: cuBLAS" in text, text


def test_bench_gemm_smoke_on_cpu(capsys) -> None:
    """python -m benchmarks.kernels.gemm on the tiny shape: every projection at each row count
    through each variant, the stream-K kernel's two included (checked against fp32, then timed),
    and the step sums."""
    text = run_main("benchmarks.kernels.gemm", "--device", "cpu", capsys=capsys, interpreted=True)
    rows = [line.split() for line in text.splitlines() if line.split()[:1] in (["qkv"], ["o"], ["gate_up"], ["down"],
                                                                               ["lm_head"])]
    assert [(r[0], r[3]) for r in rows] == [(p, m) for p in ("qkv", "o", "gate_up", "down", "lm_head")
                                            for m in ("4", "16")], text
    assert all(r.count("us") == 6 for r in rows), text
    assert "a step's projections at M=16: cublas" in text and "tiles 16x32x32 w4 s2" in text, text


def test_bench_decode_smoke_on_cpu(capsys) -> None:
    """The decode-attention bench on its tiny CPU shape: the Triton rows run (under the
    interpreter) and match the fp32 reference (FlashInfer's rows need a GPU)."""
    text = run_main("benchmarks.kernels.decode_attention", "--device", "cpu", capsys=capsys, interpreted=True)
    rows = [line.split("|") for line in text.splitlines() if line.startswith("| 3 | 40 | triton")]
    assert len(rows) == 2 and all(float(r[-2]) < 1e-3 for r in rows), text[-1500:]
