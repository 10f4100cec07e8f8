"""The profiling programs of benchmarks/diagnostics/ run end to end on CPU (tiny shape)."""

from __future__ import annotations

from module_run import run_main


def test_profile_step_smoke_on_cpu(tmp_path, capsys) -> None:
    trace = tmp_path / "trace.json"
    text = run_main("benchmarks.diagnostics.profile_step", "--shape", "tiny", "--device", "cpu", "--batch", "4", "--steps", "2",
                "--top", "3", "--trace", str(trace), capsys=capsys)
    assert "ms per decode step" in text and trace.stat().st_size > 0


def test_profile_step_with_adapters_smoke_on_cpu(capsys) -> None:
    """--lora N: the batch's requests run N random adapters (the step's LoRA path profiled)."""
    text = run_main("benchmarks.diagnostics.profile_step", "--shape", "tiny", "--device", "cpu", "--batch", "3", "--steps", "2",
                "--top", "3", "--lora", "2", capsys=capsys)
    assert "LoRA adapters 2 (3 of 3 running requests under one)" in text and "ms per decode step" in text, text[-1500:]


def test_profile_step_prefill_smoke_on_cpu(capsys) -> None:
    """--prefill times the steps that prefill the batch: 3 prompts of 40 in chunks of 64 rows."""
    text = run_main("benchmarks.diagnostics.profile_step", "--shape", "tiny", "--device", "cpu", "--prefill", "--batch", "3",
                "--input-len", "40", "--max-prefill-tokens", "64", "--top", "3", capsys=capsys)
    assert "prefill of 3 x 40 tokens in 2 steps (chunks of 64)" in text and "tok/s" in text, text[-1500:]


def test_profile_run_smoke_on_cpu(capsys) -> None:
    text = run_main("benchmarks.diagnostics.profile_run", "--shape", "tiny", "--device", "cpu", "--batch", "4", "--input-len", "8",
                "--output-len", "12", "--first-steps", "3", capsys=capsys)
    assert "median decode step" in text and "steps    0-  31: median" in text
    first = next(line for line in text.splitlines() if line.startswith("first 3 steps"))
    assert [part.split(":")[0] for part in first.split("): ")[1].split(", ")] == ["0", "1", "2"], first


def test_profile_run_summarizes_kernels_by_kind() -> None:
    from benchmarks.diagnostics.profile_run import busy_time, kind_of

    assert busy_time([(0, 4), (2, 6), (10, 11)]) == 7  # overlapping spans count once
    assert [kind_of(n) for n in ("nvjet_sm90_tst_256x128", "void flashinfer::BatchPrefillWithPagedKVCacheKernel",
                                 "_rms_norm_kernel", "Memcpy HtoD", "cudnn_generated_fort_native_sdpa_sm90_flash_fprop")] == [
                                     "gemm", "attention", "other", "copy", "attention"]
