"""The GRPO loop end to end on a tiny Llama (CPU, float32, a token-level task):

- colocated (one process), two steps: JSONL and an offline W&B run with the expected keys,
  versions 0 -> 1 -> 2 with zero lag, mismatch ~0 at both steps (so the sync carried the
  update: step 2's tokens come from the updated weights);
- the update itself moves the policy (a check that the mismatch test above can fail);
- LoRA: adapter-only sync into the engine's multi-LoRA path; mini-batches (the clip path);
- a random-weight benchmark shape: one sync before step 1;
- torchrun, two gloo processes (DDP, an engine per rank): the same step 1 as one process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _wandb_reader import read_history
from conftest import TinyModel
from rollout import Engine, EngineConfig
from rollout.distributed.ports import free_port
from rollout.rl import EvenTokenTask, GRPOConfig, GRPOTrainer, LossConfig, load_policy
from rollout.rl.batch import build_batch
from rollout.rl.scoring import response_logprobs
from scripts import grpo as grpo_script

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--task", "even-tokens", "--steps", "2", "--prompts", "4", "--samples", "4", "--max-new-tokens", "6",
        "--temperature", "1.0", "--lr", "0.02", "--seed", "3"]
EXPECTED_KEYS = {
    "critic/rewards/mean", "critic/rewards/std", "response_length/mean", "rollout/tokens_per_s",
    "rollout/prefix_cache_hit_rate", "weight_sync/ms", "rollout/weight_version_lag_mean",
    "rollout/weight_version_lag_max", "training/rollout_probs_diff_mean", "training/rollout_probs_diff_max",
    "training/rollout_logprobs_abs_diff_mean", "training/rollout_logprobs_abs_diff_max", "rollout_corr/k3_kl",
    "rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_min", "rollout_corr/rollout_is_max",
    "rollout_corr/rollout_is_ratio_fraction_high", "actor/pg_loss", "actor/grad_norm", "timing_s/step",
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyModel:
    return TinyModel("llama", tmp_path_factory.mktemp("grpo_tiny"))


@pytest.fixture(scope="module")
def colocated(tiny: TinyModel, tmp_path_factory) -> tuple[list[dict], Path]:
    run_dir = tmp_path_factory.mktemp("grpo_colocated")
    env = {"WANDB_SILENT": "true", "WANDB_DIR": str(run_dir), "WANDB_CACHE_DIR": str(run_dir / "cache"),
           "WANDB_CONFIG_DIR": str(run_dir / "config"), "WANDB_DATA_DIR": str(run_dir / "data")}
    saved = {k: os.environ.get(k) for k in (*env, "WANDB_MODE")}
    os.environ.update(env)
    os.environ.pop("WANDB_MODE", None)  # offline must be the default
    try:
        records = grpo_script.main(["--model", tiny.path, *ARGS, "--run-dir", str(run_dir)])
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    return records, run_dir


def _assert_step_invariants(records: list[dict]) -> None:
    assert [r["weight_sync/version"] for r in records] == [1, 2]
    assert [r["rollout/weight_version"] for r in records] == [0, 1]
    for r in records:
        assert r["rollout/weight_version_lag_max"] == 0
        assert r["training/rollout_logprobs_abs_diff_max"] < 1e-4, r["training/rollout_logprobs_abs_diff_max"]
        assert abs(r["rollout_corr/k3_kl"]) < 1e-8
        assert r["actor/grad_norm"] > 0 and r["rollout/tokens"] == 4 * 4 * 6


def test_colocated_two_steps_jsonl_and_wandb(colocated) -> None:
    records, run_dir = colocated
    _assert_step_invariants(records)
    lines = [json.loads(line) for line in (run_dir / "grpo.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        assert EXPECTED_KEYS <= line.keys(), EXPECTED_KEYS - line.keys()
        hist = line["response_length/hist"]
        assert sum(hist["counts"]) == 16 and len(hist["edges"]) == len(hist["counts"]) + 1
    assert [s["prompt"] for s in lines[0]["samples"]][:1] and "samples" not in lines[1]  # samples at step 1 (then every 5)
    (wandb_run,) = (run_dir / "wandb").glob("offline-run-*")
    history = read_history(wandb_run)
    assert [h["_step"] for h in history] == [1, 2]
    for h, line in zip(history, lines):
        assert EXPECTED_KEYS <= h.keys(), EXPECTED_KEYS - h.keys()
        assert h["critic/rewards/mean"] == pytest.approx(line["critic/rewards/mean"])
        assert h["response_length/hist/_type"] == "histogram"
    assert history[0]["samples/_type"] == "table-file"


def test_an_update_moves_the_policy_and_the_sync_carries_it(tiny: TinyModel) -> None:
    engine = Engine(EngineConfig(model=tiny.path, page_size=16))
    policy = load_policy(tiny.path)
    config = GRPOConfig(prompts_per_step=2, samples_per_prompt=4, max_new_tokens=6, lr=0.02, seed=1)
    trainer = GRPOTrainer(engine, policy, EvenTokenTask(tiny.vocab_size), config)
    captured = {}
    original = trainer._train

    def train_and_keep(batch):
        captured["batch"] = batch
        return original(batch)

    trainer._train = train_and_keep
    first = trainer.step(1)
    batch = captured["batch"]
    with torch.no_grad():
        moved = response_logprobs(policy, batch, config.temperature)
    drift = ((moved - batch.rollout_logprobs).abs() * batch.response_mask).max()
    assert drift > 1e-3, "the optimizer step must change the policy (else the mismatch checks prove nothing)"
    second = trainer.step(2)
    assert first["training/rollout_logprobs_abs_diff_max"] < 1e-4
    assert second["training/rollout_logprobs_abs_diff_max"] < 1e-4  # the engine serves the updated weights
    assert engine.weight_version == 2


def test_lora_adapter_sync_and_mini_batches(tiny: TinyModel, tmp_path: Path) -> None:
    records = grpo_script.main(["--model", tiny.path, *ARGS, "--lora", "--lora-rank", "4", "--lr", "0.05",
                                "--mini-batches", "2", "--layout", "rows", "--micro-batch-size", "4",
                                "--run-dir", str(tmp_path), "--wandb-mode", "disabled"])
    _assert_step_invariants(records)
    assert all(r["weight_sync/lora_only"] == 1 for r in records)
    # the second mini-batch is scored by a policy one optimizer step newer than "old"
    assert all(r["actor/ppo_kl"] != 0 for r in records)


def test_epochs_with_speculation_keep_the_trainer_exact(tiny: TinyModel, tmp_path: Path) -> None:
    """A dataset of 4 problems walked epoch after epoch with the suffix drafter: the same
    prompts come back under the updated policy; speculation reports what it did each step
    and changes nothing the trainer sees: the run equals the one without it (the same seeded
    tokens, so the same rewards and updates), log-probs the trainer's to 1e-4."""
    def run(spec: str) -> list[dict]:
        return grpo_script.main(["--model", tiny.path, *ARGS, "--steps", "3", "--dataset-size", "4",
                                 "--speculative", spec, "--run-dir", str(tmp_path / spec), "--wandb-mode", "disabled"])

    records, plain = run("suffix"), run("none")
    assert [r["weight_sync/version"] for r in records] == [1, 2, 3]
    for r, p in zip(records, plain, strict=True):
        assert r["training/rollout_logprobs_abs_diff_max"] < 1e-4
        for key in ("rollout/tokens", "critic/rewards/mean", "response_length/mean"):
            assert r[key] == p[key], key
        assert r["actor/grad_norm"] == pytest.approx(p["actor/grad_norm"], rel=1e-4)
        assert 0 <= r["rollout/spec_accepted_tokens"] <= r["rollout/spec_drafted_tokens"]
        if r["rollout/spec_drafted_tokens"]:
            assert r["rollout/spec_acceptance_rate"] == r["rollout/spec_accepted_tokens"] / r["rollout/spec_drafted_tokens"]
        assert "rollout/spec_drafted_tokens" not in p
    assert sum(r["rollout/spec_drafted_tokens"] for r in records[1:]) > 0, "later epochs draft from earlier ones"


@pytest.mark.parametrize("lora", [False, True])
def test_random_weight_shape_gets_an_initial_sync(tmp_path: Path, lora: bool) -> None:
    """A benchmark shape (config.json only): the engine loads dummy weights, the policy its
    own random ones, and one sync before step 1 makes them agree: with --lora the base
    weights too, not only the adapter (on the H200 an adapter-only first sync left KL 0.8)."""
    records = grpo_script.main(["--model", "tiny", "--steps", "1", "--prompts", "2", "--samples", "2",
                                "--run-dir", str(tmp_path), "--wandb-mode", "disabled", *(["--lora"] if lora else [])])
    (record,) = records
    if not lora:
        assert record["weight_sync/version"] == 2 and record["rollout/weight_version"] == 1
    assert record["training/rollout_logprobs_abs_diff_max"] < 1e-4


def test_torchrun_two_ranks_match_one_process(tiny: TinyModel, colocated, tmp_path: Path) -> None:
    records, _ = colocated
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(ROOT / "scripts" / "grpo.py"), "--model", tiny.path, *ARGS,
           "--run-dir", str(tmp_path), "--wandb-mode", "disabled", "--timeout-s", "60"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"torchrun failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "2 rank(s)" in proc.stdout
    dp = [json.loads(line) for line in (tmp_path / "grpo.jsonl").read_text().splitlines()]
    assert [r["perf/world_size"] for r in dp] == [2, 2]
    _assert_step_invariants(dp)
    # Same prompts, same per-prompt seeds, same starting weights: step 1 samples the same
    # tokens, and DDP's average of the per-rank token-mean shares is the global token mean.
    one, two = records[0], dp[0]
    for key in ("critic/rewards/mean", "critic/rewards/std", "rollout/tokens", "response_length/mean"):
        assert two[key] == one[key], key
    for key in ("actor/pg_loss", "actor/grad_norm"):
        assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key
