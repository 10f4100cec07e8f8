"""The benchmark and diagnosis scripts run end to end on CPU (tiny shape), so a change to the
engine cannot silently break the commands BENCHMARKS.md and README name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: int = 300) -> str:
    out = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


def test_bench_host_prints_its_phases() -> None:
    text = _run("scripts.bench_host", "--batch", "16", "--input-len", "64", "--steps", "10")
    for phase in ("schedule", "prepare", "read_back", "total"):
        assert phase in text


def test_bench_rollout_runs_each_config_on_cpu() -> None:
    text = _run("scripts.bench_rollout", "--shape", "tiny", "--device", "cpu", "--attention", "torch",
                "--overlap", "on", "off", "--workloads", "b", "--prefill-rows", "on", "off", "--peer")
    rows = [line for line in text.splitlines() if line.startswith("b: batch 1") and "|" in line]  # the table
    assert len(rows) == 4 and "[torch, overlap]" in rows[0] and "[torch]" in rows[1], text[-1500:]
    assert "compiled peer (b):" in text and all(float(r.rsplit("|", 1)[1]) > 0 for r in rows), text[-1500:]  # peer ms
    assert "[torch, overlap, eager prefill]" in rows[2] and "[torch, eager prefill]" in rows[3], text[-1500:]


def test_bench_batch_invariant_smoke_on_cpu() -> None:
    """The matmul bench on tiny shapes under the interpreter: every path it times (pointer,
    split, TMA, the "before" kernel, the CPU BLAS in cuBLAS's column) runs and the sums print."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the Triton kernels under TRITON_INTERPRET=1 (tests/conftest.py sets it on CPU)")
    # chunks of 512: the tiny shapes' K (1088, 1600) then spans several, so the split path runs
    text = _run("scripts.bench_batch_invariant", "--device", "cpu", "--rows", "1", "40", "--k-chunk", "512")
    sums = [line for line in text.splitlines() if line.startswith("rows ")]
    assert len(sums) == 2 and all("shipped" in line and "before" in line for line in sums), text[-2000:]
    assert "16x64x128x4x3/split" in text and "64x128x64x4x4/tma" in text, text[-2000:]


def test_profile_step_smoke_on_cpu(tmp_path) -> None:
    trace = tmp_path / "trace.json"
    text = _run("scripts.profile_step", "--shape", "tiny", "--device", "cpu", "--batch", "4", "--steps", "2",
                "--top", "3", "--trace", str(trace))
    assert "ms per decode step" in text and trace.stat().st_size > 0


def test_profile_step_with_adapters_smoke_on_cpu() -> None:
    """--lora N: the batch's requests run N random adapters (the step's LoRA path profiled)."""
    text = _run("scripts.profile_step", "--shape", "tiny", "--device", "cpu", "--batch", "3", "--steps", "2",
                "--top", "3", "--lora", "2")
    assert "LoRA adapters 2 (3 of 3 running requests under one)" in text and "ms per decode step" in text, text[-1500:]


def test_profile_step_prefill_smoke_on_cpu() -> None:
    """--prefill times the steps that prefill the batch: 3 prompts of 40 in chunks of 64 rows."""
    text = _run("scripts.profile_step", "--shape", "tiny", "--device", "cpu", "--prefill", "--batch", "3",
                "--input-len", "40", "--max-prefill-tokens", "64", "--top", "3")
    assert "prefill of 3 x 40 tokens in 2 steps (chunks of 64)" in text and "tok/s" in text, text[-1500:]


def test_bench_rollout_runs_modes_in_the_order_given_on_cpu() -> None:
    """--deterministic off on off: three runs, in that order (each mode early and late in a call)."""
    text = _run("scripts.bench_rollout", "--shape", "tiny", "--device", "cpu", "--workloads", "b",
                "--deterministic", "off", "on", "off")
    rows = [line for line in text.splitlines() if line.startswith("b: batch 1") and "|" in line]
    assert len(rows) == 3 and "deterministic" in rows[1] and "deterministic" not in rows[0] + rows[2], text[-1500:]


def test_profile_run_smoke_on_cpu() -> None:
    text = _run("scripts.profile_run", "--shape", "tiny", "--device", "cpu", "--batch", "4", "--input-len", "8",
                "--output-len", "12", "--first-steps", "3")
    assert "median decode step" in text and "steps    0-  31: median" in text
    first = next(line for line in text.splitlines() if line.startswith("first 3 steps"))
    assert [part.split(":")[0] for part in first.split("): ")[1].split(", ")] == ["0", "1", "2"], first


def test_profile_run_summarizes_kernels_by_kind() -> None:
    from scripts.profile_run import busy_time, kind_of

    assert busy_time([(0, 4), (2, 6), (10, 11)]) == 7  # overlapping spans count once
    assert [kind_of(n) for n in ("nvjet_sm90_tst_256x128", "void flashinfer::BatchPrefillWithPagedKVCacheKernel",
                                 "_rms_norm_kernel", "Memcpy HtoD", "cudnn_generated_fort_native_sdpa_sm90_flash_fprop")] == [
                                     "gemm", "attention", "other", "copy", "attention"]


def test_bench_lora_gpu_rows_smoke_on_cpu() -> None:
    text = _run("scripts.bench_lora", "--device", "cpu", "--shape", "tiny", "--split")
    for row in ("a [no LoRA] base requests", "a [LoRA on] 8 adapters, uniform", "b [LoRA on] 1 adapter",
                "s: LoRA-only sync, 8 adapters", "a [LoRA on] 8 adapters, uniform, warm-up run: ",
                "a [LoRA on] 8 adapters, uniform, step by step: graph steps 0; eager steps "):  # CPU: no graphs
        assert row in text, text[-1500:]
    table = text[text.index("| goal"):]
    for way in ("by name x8", "by name x1", "flat x1", "flat+pack x1"):  # each sync path, in the table
        assert f"s: LoRA-only sync, 8 adapters, {way} " in table and "<= 5 ms" in table, table


def test_bench_lora_prefill_rows_variants_smoke_on_cpu() -> None:
    """--prefill-rows on off: each (b) variant both ways, each compared with its own base."""
    text = _run("scripts.bench_lora", "--device", "cpu", "--shape", "tiny", "--workloads", "b", "--prefill-rows",
                "on", "off")
    table = text[text.index("| goal"):]
    for row in ("b [no LoRA] base ", "b [no LoRA] base, eager prefill ", "b [LoRA on] 1 adapter ",
                "b [LoRA on] 1 adapter, eager prefill "):
        assert row in table, table
    assert table.count("vs this engine's base") == 2, table


def test_sgmv_bench_tables_smoke_on_cpu() -> None:
    """Both tables of python -m lora.kernels.bench on the tiny shape, the kernels under the
    interpreter: per projection, and the decode step in the four launch modes."""
    text = _run("lora.kernels.bench", "--device", "cpu", "--layers", "1")  # one layer: the tables, not the walk
    assert sum(line.startswith(("qkv ", "o ", "gate_up ", "down ")) for line in text.splitlines()) == 4 * 6, text
    steps = [line.split() for line in text.splitlines() if line[:1].isdigit()]
    assert [row[:2] for row in steps] == [["1", "1"], ["4", "1"], ["4", "2"]], text[-1500:]
    assert all(len(row) == 3 + 4 + 4 for row in steps[1:]), "base, four modes, four added columns"
    assert "in order ms" in text and "side+pdl ms" in text and "deferred ms" in text
    assert "PDL available here: False" in text


def test_finite_check_sweep_smoke_on_cpu() -> None:
    """python -m rollout.kernels.bench_finite on the tiny shape under the interpreter: the
    model's tensors, the copy and read peers, one swept variant (checked, then timed)."""
    text = _run("rollout.kernels.bench_finite", "--device", "cpu")
    assert "tiny: 21 tensors" in text and "copy (read + write)" in text and "flat amax (read)" in text, text
    rows = [line.split() for line in text.splitlines() if line.strip()[:1].isdigit()]
    assert [row[:3] for row in rows] == [["4096", "1024", "4"]], text
    assert "best: CHUNK=4096 BLOCK=1024 warps=4" in text


def test_skinny_matmul_sweep_smoke_on_cpu() -> None:
    """python -m rollout.kernels.bench_skinny on the tiny shape under the interpreter: each
    projection against F.linear (checked, then timed) and the step's total."""
    text = _run("rollout.kernels.bench_skinny", "--device", "cpu")
    names = [line.split()[0] for line in text.splitlines() if "cuBLAS" in line and "N=" in line]
    assert names == ["qkv", "o", "gate_up", "down", "lm_head"], text
    assert "a step's projections: cuBLAS" in text, text


def test_bench_batch1_smoke_on_cpu() -> None:
    """python -m scripts.bench_batch1 on the tiny shape: two variants, each its own engine, in one table."""
    text = _run("scripts.bench_batch1", "--device", "cpu", "--shape", "tiny", "--steps", "4",
                "--variants", "auto:skinny:pdl", "torch:cublas:pdl-mm:store:nosilu")
    rows = [line.split("|") for line in text.splitlines() if line.startswith(("auto:", "torch:")) and "|" in line]
    assert [r[0].split()[0] for r in rows] == ["auto:skinny:pdl", "torch:cublas:pdl-mm:store:nosilu"], text
    assert all(float(r[1]) > 0 for r in rows), text


def test_bench_sleep_smoke_on_cpu() -> None:
    text = _run("scripts.bench_sleep", "--device", "cpu", "--shape", "tiny", "--cycles", "2")
    assert "2 sleep(1)/wake cycles, outputs equal after each" in text and "wake kv+graphs s" in text


def test_bench_spec_gpu_table_smoke_on_cpu() -> None:
    text = _run("scripts.bench_spec", "--gpu", "--device", "cpu", "--shape", "tiny", "--draft-shape", "tiny",
                "--batches", "1", "2", "--context", "16", "--new-gpu", "6")
    for line in ("verify k=4", "speedup over plain decoding", "draft + verify"):
        assert line in text, text[-1500:]


def test_bench_spec_host_cost_smoke() -> None:
    text = _run("scripts.bench_spec", "--host-only", "--host-steps", "2")
    rows = [line for line in text.splitlines() if line.startswith(("ngram", "suffix")) and "|" in line]
    assert [r.split("|")[0].strip() for r in rows] == ["ngram point", "ngram coupled", "suffix point", "suffix coupled"]


def test_bench_client_smoke_on_cpu() -> None:
    text = _run("scripts.bench_client", "--device", "cpu", "--shape", "tiny", "--batches", "1", "4",
                "--input-len", "16", "--output-len", "8", "--repeats", "2")
    rows = [line.split("|") for line in text.splitlines() if line.strip()[:1].isdigit() and "|" in line]
    assert [int(r[0]) for r in rows] == [1, 4], text[-1500:]
    assert all(r[-1].strip() == "yes" for r in rows), "the client's tokens differ from in-process"


def test_bench_structured_smoke_on_cpu() -> None:
    """The CPU run, and the --gpu path on the tiny shape (SmolLM2's tokenizer over its 512 ids)."""
    from rollout.model.fetch import fetch_default_model

    small = ("--batch", "2", "--steps", "2", "--prompt-len", "8", "--repeats", "1")
    for extra in ((), ("--gpu", "--shape", "tiny", "--device", "cpu", "--tokenizer", str(fetch_default_model()))):
        text = _run("scripts.bench_structured", *small, *extra)
        rows = [line for line in text.splitlines() if line.startswith(("unconstrained", "half JSON")) and "|" in line]
        assert len(rows) == 2 and "compile JSON schema" in text, text[-1500:]


def test_bench_first_step_smoke_on_cpu() -> None:
    """python -m scripts.bench_first_step on the tiny shape: each run's steps, then the first step alone."""
    text = _run("scripts.bench_first_step", "--device", "cpu", "--shape", "tiny", "--new", "6", "--repeats", "1",
                "--cprofile", "3", "--input-len", "8", "24", "--prefill-rows", "on", "off")
    assert "in 24, prefill rows off, run 0:" in text and "6 steps: first" in text, text
    table = [line.split("|") for line in text.splitlines() if line.count("|") == 4][1:]  # after the header
    assert [(row[0].strip(), row[1].strip()) for row in table] == [("8", "on"), ("8", "off"), ("24", "on"),
                                                                    ("24", "off")], text
    assert text.count("first step:") == 1 and "first step (profiled): host" in text, text
    assert "Ordered by: internal time" in text and "Ordered by: cumulative time" in text, text[-1500:]


def test_bench_gemm_smoke_on_cpu() -> None:
    """python -m rollout.kernels.bench_gemm on the tiny shape: every projection at each row count
    through each variant, the stream-K kernel's two included (checked against fp32, then timed),
    and the step sums."""
    text = _run("rollout.kernels.bench_gemm", "--device", "cpu")
    rows = [line.split() for line in text.splitlines() if line.split()[:1] in (["qkv"], ["o"], ["gate_up"], ["down"],
                                                                               ["lm_head"])]
    assert [(r[0], r[3]) for r in rows] == [(p, m) for p in ("qkv", "o", "gate_up", "down", "lm_head")
                                            for m in ("4", "16")], text
    assert all(r.count("us") == 6 for r in rows), text
    assert "a step's projections at M=16: cublas" in text and "tiles 16x32x32 w4 s2" in text, text


def test_bench_decode_smoke_on_cpu() -> None:
    """The decode-attention bench on its tiny CPU shape: the Triton rows run (under the
    interpreter) and match the fp32 reference (FlashInfer's rows need a GPU)."""
    text = _run("rollout.attention.bench_decode", "--device", "cpu")
    rows = [line.split("|") for line in text.splitlines() if line.startswith("| 3 | 40 | triton")]
    assert len(rows) == 2 and all(float(r[-2]) < 1e-3 for r in rows), text[-1500:]
