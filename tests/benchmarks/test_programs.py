"""The benchmark programs of benchmarks/ run end to end on CPU (tiny shape), so a change to the
engine cannot silently break the commands BENCHMARKS.md names."""

from __future__ import annotations

from module_run import run_main


def test_bench_host_prints_its_phases(capsys) -> None:
    text = run_main("benchmarks.host", "--batch", "16", "--input-len", "64", "--steps", "10", capsys=capsys)
    for phase in ("schedule", "prepare", "read_back", "total"):
        assert phase in text


# (b) with 16 new tokens, not 256: its decode steps (a dozen, past the warm-up's) are what the
# rollout runs cost on CPU, and a few give each run its decode-step figure
ROLLOUT_SMOKE = ("--shape", "tiny", "--device", "cpu", "--workloads", "b", "--output-len", "16")


def test_bench_rollout_runs_each_config_on_cpu(capsys) -> None:
    text = run_main("benchmarks.rollout", *ROLLOUT_SMOKE, "--attention", "torch", "--overlap", "on", "off",
                    "--prefill-rows", "on", "off", "--peer", capsys=capsys)
    rows = [line for line in text.splitlines() if line.startswith("b: batch 1") and "|" in line]  # the table
    assert len(rows) == 4 and "[torch, overlap]" in rows[0] and "[torch]" in rows[1], text[-1500:]
    assert "compiled peer (b):" in text and all(float(r.rsplit("|", 1)[1]) > 0 for r in rows), text[-1500:]  # peer ms
    assert "[torch, overlap, eager prefill]" in rows[2] and "[torch, eager prefill]" in rows[3], text[-1500:]


def test_bench_rollout_runs_modes_in_the_order_given_on_cpu(capsys) -> None:
    """--deterministic off on off: three runs, in that order (each mode early and late in a call)."""
    text = run_main("benchmarks.rollout", *ROLLOUT_SMOKE, "--deterministic", "off", "on", "off", capsys=capsys)
    rows = [line for line in text.splitlines() if line.startswith("b: batch 1") and "|" in line]
    assert len(rows) == 3 and "deterministic" in rows[1] and "deterministic" not in rows[0] + rows[2], text[-1500:]


def test_bench_lora_gpu_rows_smoke_on_cpu(capsys) -> None:
    text = run_main("benchmarks.lora", "--device", "cpu", "--shape", "tiny", "--split", capsys=capsys)
    for row in ("a [no LoRA] base requests", "a [LoRA on] 8 adapters, uniform", "b [LoRA on] 1 adapter",
                "s: LoRA-only sync, 8 adapters", "a [LoRA on] 8 adapters, uniform, warm-up run: ",
                "a [LoRA on] 8 adapters, uniform, step by step: graph steps 0; eager steps "):  # CPU: no graphs
        assert row in text, text[-1500:]
    table = text[text.index("| goal"):]
    for way in ("by name x8", "by name x1", "flat x1", "flat+pack x1"):  # each sync path, in the table
        assert f"s: LoRA-only sync, 8 adapters, {way} " in table and "<= 5 ms" in table, table


def test_bench_lora_prefill_rows_variants_smoke_on_cpu(capsys) -> None:
    """--prefill-rows on off: each (b) variant both ways, each compared with its own base."""
    text = run_main("benchmarks.lora", "--device", "cpu", "--shape", "tiny", "--workloads", "b", "--prefill-rows",
                "on", "off", capsys=capsys)
    table = text[text.index("| goal"):]
    for row in ("b [no LoRA] base ", "b [no LoRA] base, eager prefill ", "b [LoRA on] 1 adapter ",
                "b [LoRA on] 1 adapter, eager prefill "):
        assert row in table, table
    assert table.count("vs this engine's base") == 2, table


def test_bench_batch1_smoke_on_cpu(capsys) -> None:
    """python -m benchmarks.batch1 on the tiny shape: two variants, each its own engine, in one table."""
    text = run_main("benchmarks.batch1", "--device", "cpu", "--shape", "tiny", "--steps", "4",
                "--variants", "auto:skinny:pdl", "torch:cublas:pdl-mm:store:nosilu", capsys=capsys)
    rows = [line.split("|") for line in text.splitlines() if line.startswith(("auto:", "torch:")) and "|" in line]
    assert [r[0].split()[0] for r in rows] == ["auto:skinny:pdl", "torch:cublas:pdl-mm:store:nosilu"], text
    assert all(float(r[1]) > 0 for r in rows), text


def test_bench_sleep_smoke_on_cpu(capsys) -> None:
    text = run_main("benchmarks.sleep", "--device", "cpu", "--shape", "tiny", "--cycles", "2", capsys=capsys)
    assert "2 sleep(1)/wake cycles, outputs equal after each" in text and "wake kv+graphs s" in text


def test_bench_spec_gpu_table_smoke_on_cpu(capsys) -> None:
    text = run_main("benchmarks.spec", "--gpu", "--device", "cpu", "--shape", "tiny", "--draft-shape", "tiny",
                "--batches", "1", "2", "--context", "16", "--new-gpu", "6", capsys=capsys)
    for line in ("verify k=4", "speedup over plain decoding", "draft + verify"):
        assert line in text, text[-1500:]


def test_bench_spec_host_cost_smoke(capsys) -> None:
    # 2 earlier responses a prompt, not 16: drawing them from the synthetic chain was most of the
    # run; the drafters still index finished responses and draft from them and the samples
    text = run_main("benchmarks.spec", "--host-only", "--host-steps", "2", "--host-history", "2", capsys=capsys)
    rows = [line for line in text.splitlines() if line.startswith(("ngram", "suffix")) and "|" in line]
    assert [r.split("|")[0].strip() for r in rows] == ["ngram point", "ngram coupled", "suffix point", "suffix coupled"]


def test_bench_client_smoke_on_cpu(capsys) -> None:
    text = run_main("benchmarks.client", "--device", "cpu", "--shape", "tiny", "--batches", "1", "4",
                "--input-len", "16", "--output-len", "8", "--repeats", "2", capsys=capsys)
    rows = [line.split("|") for line in text.splitlines() if line.strip()[:1].isdigit() and "|" in line]
    assert [int(r[0]) for r in rows] == [1, 4], text[-1500:]
    assert all(r[-1].strip() == "yes" for r in rows), "the client's tokens differ from in-process"


def test_bench_structured_smoke_on_cpu(capsys) -> None:
    """The CPU run, and the --gpu path on the tiny shape (SmolLM2's tokenizer over its 512 ids)."""
    from rollout.model.fetch import fetch_default_model

    small = ("--batch", "2", "--steps", "2", "--prompt-len", "8", "--repeats", "1")
    for extra in ((), ("--gpu", "--shape", "tiny", "--device", "cpu", "--tokenizer", str(fetch_default_model()))):
        text = run_main("benchmarks.structured", *small, *extra, capsys=capsys)
        rows = [line for line in text.splitlines() if line.startswith(("unconstrained", "half JSON")) and "|" in line]
        assert len(rows) == 2 and "compile JSON schema" in text, text[-1500:]


def test_bench_first_step_smoke_on_cpu(capsys) -> None:
    """python -m benchmarks.first_step on the tiny shape: each run's steps, then the first step alone."""
    text = run_main("benchmarks.first_step", "--device", "cpu", "--shape", "tiny", "--new", "6", "--repeats", "1",
                "--cprofile", "3", "--input-len", "8", "24", "--prefill-rows", "on", "off", capsys=capsys)
    assert "in 24, prefill rows off, run 0:" in text and "6 steps: first" in text, text
    table = [line.split("|") for line in text.splitlines() if line.count("|") == 4][1:]  # after the header
    assert [(row[0].strip(), row[1].strip()) for row in table] == [("8", "on"), ("8", "off"), ("24", "on"),
                                                                    ("24", "off")], text
    assert text.count("first step:") == 1 and "first step (profiled): host" in text, text
    assert "Ordered by: internal time" in text and "Ordered by: cumulative time" in text, text[-1500:]
