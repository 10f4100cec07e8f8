"""rollout.rl: the RL loop around the engine: a GRPO trainer (colocated or data-parallel
under torchrun), verifiable tasks, and the telemetry that watches train/rollout agreement.

    tasks.py rewards.py      problems with checkable answers; reward functions
    advantages.py loss.py    group-normalized advantages; clipped PG loss with TIS
    batch.py scoring.py      rollouts -> padded tensors; trainer log-probs of response tokens
    mismatch.py              train-vs-rollout log-prob telemetry (verl's metric names)
    policy.py                HF / PEFT policy; weight sync into the engine (full or LoRA-only)
    world.py                 rank / size / collectives (a world of one without torchrun)
    grpo.py                  GRPOConfig, GRPOTrainer.step(), run_grpo()
    telemetry.py console.py  JSONL and W&B sinks; the terminal table
"""

from rollout.rl.advantages import group_advantages
from rollout.rl.grpo import GRPOConfig, GRPOTrainer, run_grpo
from rollout.rl.loss import LossConfig, grpo_loss
from rollout.rl.mismatch import mismatch_metrics
from rollout.rl.policy import AdapterSync, FullSync, LoraSpec, load_policy, make_sync
from rollout.rl.tasks import ArithmeticTask, Epochs, EvenTokenTask, Problem, Task
from rollout.rl.world import World, init_world

__all__ = [
    "AdapterSync", "ArithmeticTask", "Epochs", "EvenTokenTask", "FullSync", "GRPOConfig", "GRPOTrainer", "LoraSpec",
    "LossConfig", "Problem", "Task", "World", "group_advantages", "grpo_loss", "init_world", "load_policy",
    "make_sync", "mismatch_metrics", "run_grpo",
]
