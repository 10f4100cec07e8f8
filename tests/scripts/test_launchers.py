"""The torchrun launchers on CPU with gloo and two processes, on a tiny Llama checkpoint.

- data-parallel rollout: rank 0's gathered results equal one engine's generate() on the
  same prompts, in the same order (n=2 sampled with a seed, split strided over two engines,
  and split contiguously over two engines of two TP ranks each);
- disaggregated loop: 2 trainer ranks (DDP) + 1 engine, 2 steps: the engine goes 0 -> 1 -> 2,
  rollouts carry the version that made them, and greedy output after each sync equals
  transformers with trainer rank 0's saved weights of that step;
- failures: a rank that hangs makes its peer fail by the timeout with a report naming it
  (with 1 trainer rank, after a whole step checked against transformers); a rank that
  leaves silently (exit code 0, which torchrun does not treat as a failure) makes its peer
  fail at once.

Each launch is a real `python -m torch.distributed.run` subprocess, started outside the
repo (cwd = a temp dir, no PYTHONPATH) to check that the launchers run from a clean clone.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import TinyModel, make_prompts
from rollout import Engine, EngineConfig, SamplingParams
from rollout.distributed.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
LENGTHS = [5, 9, 3, 12, 7, 4, 10]  # 7 prompts: an uneven split over 2 ranks


def torchrun(script: str, *args: str, cwd: Path, nproc: int = 2, timeout: float = 90) -> tuple[subprocess.CompletedProcess, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(ROOT / "scripts" / script), *args]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)  # the checkout under test, not whichever one the venv has installed
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - start


def _check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"launcher failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyModel:
    return TinyModel("llama", tmp_path_factory.mktemp("launch_tiny"))


@pytest.fixture(scope="module")
def prompts_file(tiny: TinyModel, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("launch_prompts") / "prompts.json"
    path.write_text(json.dumps(make_prompts(tiny.vocab_size, LENGTHS, seed=40)))
    return path


# ---- data-parallel rollout ---------------------------------------------------------------
def test_dp_rollout_equals_one_engine(tiny: TinyModel, prompts_file: Path, tmp_path: Path) -> None:
    """Sampled (a greedy run is the same machinery with --temperature 0); the contiguous split
    is test_dp_x_tp_rollout_equals_one_engine's. Each launch is mostly its processes starting."""
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=6, n=2, seed=7)
    out_file = tmp_path / "dp.json"
    args = ["--model", tiny.path, "--prompts", str(prompts_file), "--max-new-tokens", str(params.max_new_tokens),
            "--temperature", str(params.temperature), "--top-p", str(params.top_p), "--samples", str(params.n),
            "--seed", str(params.seed), "--split", "strided", "--output", str(out_file), "--timeout-s", "60"]
    proc, _ = torchrun("launch_dp_rollout.py", *args, cwd=tmp_path)
    _check_ok(proc)
    assert "aggregate" in proc.stdout and "tok/s" in proc.stdout
    doc = json.loads(out_file.read_text())
    got = doc["outputs"]
    prompts = json.loads(prompts_file.read_text())
    want = Engine(EngineConfig(model=tiny.path, page_size=16)).generate(input_ids=prompts, sampling_params=params)
    assert [(o["prompt_index"], o["sample_index"]) for o in got] == [(o.prompt_index, o.sample_index) for o in want]
    assert [o["token_ids"] for o in got] == [o.token_ids for o in want]
    assert [o["finish_reason"] for o in got] == [o.finish_reason for o in want]
    assert [o["prompt_ids"] for o in got] == [prompts[o.prompt_index] for o in want]
    for g, w in zip(got, want):
        assert g["logprobs"] == pytest.approx(w.logprobs, abs=1e-4)
        assert g["weight_version"] == 0
    summary = doc["summary"]
    assert summary["world_size"] == 2 and summary["samples"] == len(want)
    assert sum(summary["rank_prompts"]) == len(prompts) and min(summary["rank_prompts"]) >= 3
    # the n samples of a prompt differ (the seed is per sample)
    assert any(got[i]["token_ids"] != got[i + 1]["token_ids"] for i in range(0, len(got), 2))


def test_dp_x_tp_rollout_equals_one_engine(tiny: TinyModel, prompts_file: Path, tmp_path: Path) -> None:
    """4 ranks, --tp 2: two engines of two TP ranks each (ranks 0-1 and 2-3), the prompts split
    between the engines, every output equal to one unsharded engine's."""
    out_file = tmp_path / "dp_tp.json"
    params = SamplingParams(temperature=1.0, max_new_tokens=5, n=2, seed=3, ignore_eos=True)
    proc, _ = torchrun("launch_dp_rollout.py", "--model", tiny.path, "--prompts", str(prompts_file), "--tp", "2",
                       "--max-new-tokens", "5", "--temperature", "1", "--samples", "2", "--seed", "3", "--ignore-eos",
                       "--output", str(out_file), "--timeout-s", "60", cwd=tmp_path, nproc=4)
    _check_ok(proc)
    doc = json.loads(out_file.read_text())
    want = Engine(EngineConfig(model=tiny.path, page_size=16)).generate(
        input_ids=json.loads(prompts_file.read_text()), sampling_params=params)
    assert [o["token_ids"] for o in doc["outputs"]] == [o.token_ids for o in want]
    assert doc["summary"]["tensor_parallel_size"] == 2 and doc["summary"]["rank_prompts"] == [4, 3]


# ---- disaggregated loop ------------------------------------------------------------------
def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def test_disagg_two_ddp_trainer_ranks_sync_the_trainers_weights(tiny: TinyModel, prompts_file: Path,
                                                                tmp_path: Path) -> None:
    """T = 2: both trainer ranks get the rollouts, DDP keeps them identical, rank 0 alone
    sends; --verify checks the engine against rank 0's weights after each step, and the
    probes equal transformers with the weights rank 0 saved. One trainer rank (no DDP) runs
    its whole step, verified the same way, in test_hung_engine_rank_makes_the_trainer_fail_by_the_timeout."""
    from transformers import AutoModelForCausalLM

    out_file, save_dir = tmp_path / "run.json", tmp_path / "ckpt"
    proc, _ = torchrun("launch_disagg.py", "--model", tiny.path, "--trainer-ranks", "2", "--prompts", str(prompts_file),
                       "--steps", "2", "--samples", "2", "--max-new-tokens", "6", "--lr", "0.5", "--verify",
                       "--probe-tokens", "6", "--save-dir", str(save_dir), "--output", str(out_file), "--timeout-s", "60",
                       nproc=3, cwd=tmp_path)
    _check_ok(proc)
    steps = json.loads(out_file.read_text())["steps"]
    assert [s["rollout_versions"] for s in steps] == [[0], [1]], "rollouts carry the version that made them"
    assert [s["engine_versions_after_sync"] for s in steps] == [[1], [2]]
    assert [s["probe_versions"] for s in steps] == [[1], [2]]
    assert all(s["verified"] for s in steps) and all(s["sync_bytes"] > 0 for s in steps)
    prompts = json.loads(prompts_file.read_text())
    before = [tiny.greedy(p, 6) for p in prompts]
    for s in steps:
        trained = AutoModelForCausalLM.from_pretrained(save_dir / f"step_{s['step']}", dtype=torch.float32).eval()
        assert s["probe_tokens"] == [_hf_greedy(trained, p, 6) for p in prompts], f"step {s['step']}"
    assert steps[0]["probe_tokens"] != before, "the training step should change greedy outputs"
    assert steps[1]["probe_tokens"] != steps[0]["probe_tokens"]


# ---- failures ----------------------------------------------------------------------------
def test_hung_engine_rank_makes_the_trainer_fail_by_the_timeout(tiny: TinyModel, prompts_file: Path, tmp_path: Path) -> None:
    """One trainer rank: step 1 runs whole (trained, synced, the probe checked against
    transformers), then the engine hangs in step 2 and the trainer fails by the timeout.
    8 s: well above the ranks' start-up skew before step 1's first collective (the trainer
    imports transformers while the engine waits: up to 3.1 s beside a busy core on a 2-core
    VM, 2026-12-08, and a 3 s timeout failed there once), which the same timeout bounds; CI's
    2-core machine runs two test workers beside the ranks."""
    timeout_s = 8
    proc, elapsed = torchrun("launch_disagg.py", "--model", tiny.path, "--prompts", str(prompts_file), "--steps", "2",
                             "--max-new-tokens", "4", "--lr", "0.5", "--verify", "--probe-tokens", "4",
                             "--timeout-s", str(timeout_s), "--die-at-step", "2", "--die-rank", "1", "--die-mode", "hang",
                             cwd=tmp_path, timeout=120)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-3000:]
    assert elapsed < timeout_s + 40, f"took {elapsed:.0f} s"
    step1 = next((line for line in proc.stdout.splitlines() if line.startswith("[disagg step 1/2]")), "")
    assert "rollouts made by versions [0]; engines now at [1], probe versions [1], probe == transformers" in step1, \
        log[-3000:]
    failed = re.search(r"\[rank 0 trainer 0\] FAILED in 'step 2 rollouts: gather on rank 0' after ([0-9.]+) s "
                       rf"\(collective timeout {timeout_s} s", log)
    assert failed and float(failed[1]) >= timeout_s and "Timed out" in log, log[-3000:]
    assert "rank 1 (engine 0): last at" in log, log[-3000:]


def test_silently_exited_rank_makes_its_peer_fail_at_once(tiny: TinyModel, prompts_file: Path, tmp_path: Path) -> None:
    proc, elapsed = torchrun("launch_dp_rollout.py", "--model", tiny.path, "--prompts", str(prompts_file),
                             "--max-new-tokens", "4", "--timeout-s", "60", "--die-at-step", "1", "--die-rank", "1",
                             "--die-mode", "exit", cwd=tmp_path, timeout=120)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-3000:]
    assert elapsed < 40, f"took {elapsed:.0f} s: the closed connection should be noticed before the 60 s timeout"
    assert "[rank 0 rollout rank 0] FAILED in 'rollout 1:" in log, log[-3000:]
    assert "rank 1 (rollout rank 1): last at 'build engine'" in log, log[-3000:]
