"""One GRPO step, the same code for a single process and for every data-parallel rank:

    problems -> engine.generate (n samples per prompt, prefix shared) -> rewards
    -> group-normalized advantages -> trainer log-probs -> clipped PG loss with TIS
    -> optimizer step (DDP averages gradients across ranks) -> weight sync into the engine
    -> metrics (gathered, identical on every rank; rank 0 writes them)

Each rank owns an engine and generates its share of the step's prompts (strided); a
prompt's n samples stay on one rank, so advantages need no communication. Everything that
crosses ranks goes through `World` (a world of one in a plain process).
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from rollout.request import RolloutOutput, SamplingParams
from rollout.rl.advantages import group_advantages
from rollout.rl.batch import LAYOUTS, TrainBatch, build_batch
from rollout.rl.loss import LossConfig, grpo_loss
from rollout.rl.mismatch import mismatch_metrics
from rollout.rl.policy import WeightSync, make_sync, trainable_parameters
from rollout.rl.scoring import response_logprobs
from rollout.rl.tasks import Problem, Task
from rollout.rl.telemetry import HIST_KEY, SAMPLES_KEY, histogram
from rollout.rl.world import World

Progress = Callable[[str], None]


@dataclass(frozen=True)
class GRPOConfig:
    prompts_per_step: int = 8  # global: split over the data-parallel ranks
    samples_per_prompt: int = 8  # n, the group size
    max_new_tokens: int = 16
    temperature: float = 1.0
    lr: float = 1e-5
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    mini_batches: int = 1  # optimizer steps per rollout batch; > 1 is where the PPO clip bites
    micro_batch_size: int = 0  # samples per forward/backward, in whole groups (accumulation); 0: a mini-batch
    layout: str = "packed"  # trainer input: "packed" (a group's prompt once) or "rows" (see batch.py)
    loss: LossConfig = field(default_factory=LossConfig)
    advantage_eps: float = 1e-6
    seed: int = 0
    samples_every: int = 5  # log a samples table every K steps (and at step 1); 0: never
    samples_logged: int = 8

    def __post_init__(self) -> None:
        for name in ("prompts_per_step", "max_new_tokens", "mini_batches", "samples_logged"):
            if getattr(self, name) < 1:
                raise ValueError(f"GRPOConfig.{name}={getattr(self, name)}: must be >= 1")
        if self.samples_per_prompt < 2:
            raise ValueError(f"GRPOConfig.samples_per_prompt={self.samples_per_prompt}: GRPO needs groups of >= 2")
        if not self.temperature > 0:
            raise ValueError(f"GRPOConfig.temperature={self.temperature}: must be > 0 (sampling, not greedy)")
        if not self.lr > 0:
            raise ValueError(f"GRPOConfig.lr={self.lr}: must be > 0")
        if self.micro_batch_size < 0 or self.samples_every < 0:
            raise ValueError("GRPOConfig.micro_batch_size and samples_every must be >= 0")
        if self.layout not in LAYOUTS:
            raise ValueError(f"GRPOConfig.layout={self.layout!r}: expected one of {LAYOUTS}")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def sample_seed(seed: int, step: int, prompt_index: int) -> int:
    """Each prompt of each step its own sampling seed (the engine derives one per sample from
    it): samples never share noise across prompts, and a prompt's samples do not depend on
    which rank generates them."""
    digest = hashlib.blake2b(f"grpo:{seed}:{step}:{prompt_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def _quiet(_: str) -> None:
    pass


class GRPOTrainer:
    """Owns the policy (DDP-wrapped when the world has several ranks), its optimizer and the
    colocated engine it keeps in sync. `step()` runs one GRPO step and returns its metrics.

    sync: "auto" (LoRA-only for a PEFT policy when the engine has LoRA on, else every
    weight), "adapter", "full", or a ready WeightSync (policy.py). initial_sync: push the
    policy once before the first step, for an engine that did not load the same weights
    (random benchmark weights, another checkpoint)."""

    def __init__(self, engine: Any, policy: nn.Module, task: Task, config: GRPOConfig, world: World | None = None,
                 optimizer: torch.optim.Optimizer | None = None, sync: str | WeightSync = "auto",
                 initial_sync: bool = False) -> None:
        self.world = world or World()
        if config.prompts_per_step % self.world.size:
            raise ValueError(f"prompts_per_step={config.prompts_per_step} must divide evenly over "
                             f"{self.world.size} ranks (every rank runs the same number of backward passes)")
        self.engine = engine
        self.task = task
        self.config = config
        self.policy = policy
        self.model = self.world.wrap(policy)
        self.params = trainable_parameters(policy)
        self.optimizer = optimizer or torch.optim.AdamW(self.params, lr=config.lr, weight_decay=config.weight_decay)
        self.device = next(policy.parameters()).device
        self.sync = make_sync(engine, self.model, sync) if isinstance(sync, str) else sync
        if initial_sync:
            self.sync.push_all()
        # Both sides now hold the same weights; from here on the trainer's version is the
        # engine's version (of the base weights, or of the adapter) after the last sync.
        self.version = self.sync.version

    # ---- one step ---------------------------------------------------------------------
    def step(self, step: int, progress: Progress = _quiet) -> dict[str, Any]:
        cfg, world = self.config, self.world
        start = time.perf_counter()
        problems = self.task.problems(step, cfg.prompts_per_step)
        share = list(range(world.rank, len(problems), world.size))
        local = [problems[i] for i in share]

        progress(f"rollout: {len(local)} prompts x {cfg.samples_per_prompt} samples")
        with world.phase(f"step {step}: rollout"):
            outputs, rollout = self._rollout(step, share, local)
        rewards = torch.tensor([self.task.reward(local[o.prompt_index], o) for o in outputs], dtype=torch.float32)
        advantages = group_advantages(rewards.view(len(local), cfg.samples_per_prompt), cfg.advantage_eps).reshape(-1)
        batch = build_batch(outputs, advantages, cfg.samples_per_prompt, cfg.layout,
                            versions=[self.sync.token_versions(o) for o in outputs],
                            mask_dtype=next(self.policy.parameters()).dtype).to(self.device)

        progress(f"train: {batch.num_samples} samples, {int(batch.response_mask.sum())} response tokens")
        train_start = time.perf_counter()
        trained_version = self.version
        with world.phase(f"step {step}: train"):
            train = self._train(batch)
        train_seconds = time.perf_counter() - train_start

        progress("weight sync")
        with world.phase(f"step {step}: weight sync"):
            sync = self.sync.push()
            if sync.version != self.version + 1:
                raise RuntimeError(f"engine version {sync.version} after sync, expected {self.version + 1}")
        self.version = sync.version

        with world.phase(f"step {step}: metrics"):
            record = self._metrics(step, batch, rewards, advantages, outputs, local, rollout, train, trained_version)
            record.update({
                "weight_sync/ms": world.max(sync.seconds * 1e3),
                "weight_sync/version": sync.version,
                "weight_sync/lora_only": int(self.sync.lora_name is not None),
                "timing_s/gen": rollout["seconds"],
                "timing_s/update_actor": world.max(train_seconds),
                "timing_s/update_weights": world.max(sync.seconds),
                "timing_s/step": world.max(time.perf_counter() - start),
            })
        return record

    # ---- rollout ----------------------------------------------------------------------
    def _rollout(self, step: int, share: list[int], local: list[Problem]) -> tuple[list[RolloutOutput], dict[str, float]]:
        cfg = self.config
        tokenizer = getattr(self.engine, "tokenizer", None)
        prompt_ids = [self.task.prompt_ids(p, tokenizer) for p in local]
        params = [SamplingParams(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                                 n=cfg.samples_per_prompt, seed=sample_seed(cfg.seed, step, i)) for i in share]
        counters = self.engine.counters
        prompt_before, cached_before = counters.prompt_tokens, counters.cached_prompt_tokens
        spec_before = counters.drafted_tokens, counters.accepted_tokens, counters.verify_steps
        start = time.perf_counter()
        outputs = self.engine.generate(input_ids=prompt_ids, sampling_params=params, lora_name=self.sync.lora_name)
        seconds = time.perf_counter() - start
        outputs = sorted(outputs, key=lambda o: (o.prompt_index, o.sample_index))
        tokens = sum(len(o.token_ids) for o in outputs)
        world = self.world
        slowest = world.max(seconds)
        prompt_tokens = world.sum(counters.prompt_tokens - prompt_before)
        cached = world.sum(counters.cached_prompt_tokens - cached_before)
        total_tokens = world.sum(tokens)
        drafted, accepted, verifies = (world.sum(now - before) for now, before in zip(
            (counters.drafted_tokens, counters.accepted_tokens, counters.verify_steps), spec_before))
        return outputs, {
            "spec_drafted": drafted, "spec_accepted": accepted, "spec_verifies": verifies,
            "seconds": slowest,
            "tokens": total_tokens,
            "tokens_per_s": total_tokens / slowest if slowest > 0 else 0.0,
            "prefix_cache_hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
        }

    # ---- train ------------------------------------------------------------------------
    def _train(self, batch: TrainBatch) -> dict[str, Any]:
        """mini_batches optimizer steps over the batch's groups; returns the trainer's
        pre-update log-probs (for the mismatch telemetry) and the loss statistics."""
        cfg, world = self.config, self.world
        n = batch.group_size
        old_logprobs = self._score(batch) if cfg.mini_batches > 1 else None
        pre_update: list[torch.Tensor] = []
        losses, clipfracs, kls, norms, weights = [], [], [], [], []
        groups_per_micro = -(-cfg.micro_batch_size // n) if cfg.micro_batch_size else 0
        for lo, hi in _split(batch.num_groups, cfg.mini_batches):
            mini = batch.groups(lo, hi)
            # Token-mean over the global mini-batch: DDP averages over ranks, so each rank
            # divides by (global tokens / world size).
            share_of_tokens = world.sum(float(mini.response_mask.sum())) / world.size
            micro_bounds = _split_by_size(hi - lo, groups_per_micro)
            loss_total = 0.0
            for index, (mlo, mhi) in enumerate(micro_bounds):
                micro = mini.groups(mlo, mhi)
                last = index == len(micro_bounds) - 1
                with self._no_sync(not last):
                    logprobs = response_logprobs(self.model, micro, cfg.temperature)
                    old = (old_logprobs[(lo + mlo) * n : (lo + mhi) * n] if old_logprobs is not None
                           else logprobs.detach())
                    out = grpo_loss(logprobs, old, micro.rollout_logprobs, micro.advantages, micro.response_mask,
                                    cfg.loss, num_tokens=share_of_tokens)
                    out.loss.backward()
                if old_logprobs is None:
                    pre_update.append(logprobs.detach())
                tokens = float(micro.response_mask.sum())
                loss_total += float(out.loss.detach())
                clipfracs.append(out.pg_clipfrac * tokens)
                kls.append(out.ppo_kl * tokens)
                weights.append(tokens)
            norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            losses.append(loss_total)
            norms.append(float(norm))
        trainer_logprobs = old_logprobs if old_logprobs is not None else torch.cat(pre_update)
        tokens = max(sum(weights), 1.0)
        return {
            "trainer_logprobs": trainer_logprobs,
            "actor/pg_loss": world.mean(sum(losses) / len(losses)),
            "actor/pg_clipfrac": world.sum(sum(clipfracs)) / max(world.sum(tokens), 1.0),
            "actor/ppo_kl": world.sum(sum(kls)) / max(world.sum(tokens), 1.0),
            "actor/grad_norm": sum(norms) / len(norms),
            "actor/lr": self.optimizer.param_groups[0]["lr"],
        }

    @torch.no_grad()
    def _score(self, batch: TrainBatch) -> torch.Tensor:
        n, size = batch.group_size, self.config.micro_batch_size
        parts = [response_logprobs(self.model, batch.groups(lo, hi), self.config.temperature)
                 for lo, hi in _split_by_size(batch.num_groups, -(-size // n) if size else 0)]
        return torch.cat(parts)

    def _no_sync(self, skip: bool) -> contextlib.AbstractContextManager:
        if skip and isinstance(self.model, nn.parallel.DistributedDataParallel):
            return self.model.no_sync()
        return contextlib.nullcontext()

    # ---- metrics ----------------------------------------------------------------------
    def _metrics(self, step: int, batch: TrainBatch, rewards: torch.Tensor, advantages: torch.Tensor,
                 outputs: list[RolloutOutput], local: list[Problem], rollout: dict[str, float],
                 train: dict[str, Any], trained_version: int) -> dict[str, Any]:
        cfg, world = self.config, self.world
        mask = batch.response_mask.bool()
        all_rewards = world.gather(rewards)
        lengths = world.gather(torch.tensor([float(len(o.token_ids)) for o in outputs]))
        clipped = world.gather(torch.tensor([float(o.finish_reason == "length") for o in outputs]))
        all_advantages = world.gather(advantages)
        trainer_lp = world.gather(train.pop("trainer_logprobs").cpu()[mask.cpu()])
        rollout_lp = world.gather(batch.rollout_logprobs.cpu()[mask.cpu()])
        lag = world.gather((trained_version - batch.token_versions.cpu()[mask.cpu()]).to(torch.float64))
        record: dict[str, Any] = {
            "critic/rewards/mean": float(all_rewards.mean()),
            "critic/rewards/std": float(all_rewards.std()) if all_rewards.numel() > 1 else 0.0,
            "critic/rewards/max": float(all_rewards.max()),
            "critic/rewards/min": float(all_rewards.min()),
            "critic/advantages/mean": float(all_advantages.mean()),
            "critic/advantages/max": float(all_advantages.max()),
            "critic/advantages/min": float(all_advantages.min()),
            "response_length/mean": float(lengths.mean()),
            "response_length/max": float(lengths.max()),
            "response_length/min": float(lengths.min()),
            "response_length/clip_ratio": float(clipped.mean()),
            HIST_KEY: histogram(lengths.tolist(), num_bins=min(cfg.max_new_tokens, 16), upper=cfg.max_new_tokens),
            "rollout/tokens": rollout["tokens"],
            "rollout/tokens_per_s": rollout["tokens_per_s"],
            "rollout/prefix_cache_hit_rate": rollout["prefix_cache_hit_rate"],
            "rollout/weight_version": trained_version,
            "rollout/weight_version_lag_mean": float(lag.mean()) if lag.numel() else 0.0,
            "rollout/weight_version_lag_max": float(lag.max()) if lag.numel() else 0.0,
            "perf/world_size": world.size,
        }
        if getattr(getattr(self.engine, "config", None), "speculative", None) is not None:
            # what speculation did this step: drafts per verify step and the share accepted;
            # tokens per request-step = 1 + accepted / (tokens - accepted) (spec_accepted_per_step)
            verifies, drafted, accepted = rollout["spec_verifies"], rollout["spec_drafted"], rollout["spec_accepted"]
            record.update({
                "rollout/spec_drafted_tokens": drafted,
                "rollout/spec_accepted_tokens": accepted,
                "rollout/spec_accepted_per_verify": accepted / verifies if verifies else 0.0,
                "rollout/spec_acceptance_rate": accepted / drafted if drafted else 0.0,
                "rollout/spec_accepted_per_step": accepted / max(rollout["tokens"] - accepted, 1),
            })
        record.update(train)
        record.update(mismatch_metrics(trainer_lp, rollout_lp, cfg.loss.tis_cap))
        if cfg.samples_every and (step == 1 or step % cfg.samples_every == 0) and world.is_main:
            record[SAMPLES_KEY] = [
                {"prompt": local[o.prompt_index].prompt, "response": o.text if o.text is not None else str(o.token_ids),
                 "reward": float(r)}
                for o, r in list(zip(outputs, rewards.tolist()))[: cfg.samples_logged]
            ]
        return record


def _split(count: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) bounds of `parts` contiguous, near-equal, non-empty chunks of range(count)."""
    parts = max(1, min(parts, count))
    return [(i * count // parts, (i + 1) * count // parts) for i in range(parts)]


def _split_by_size(count: int, size: int) -> list[tuple[int, int]]:
    if size <= 0 or size >= count:
        return [(0, count)]
    return [(lo, min(lo + size, count)) for lo in range(0, count, size)]


def run_grpo(trainer: GRPOTrainer, steps: int, sinks: list[Any], progress: Progress = _quiet,
             first_step: int = 1) -> list[dict[str, Any]]:
    """`steps` GRPO steps; rank 0 hands each step's record to every sink. Returns the records."""
    records = []
    start = time.perf_counter()
    for step in range(first_step, first_step + steps):
        record = trainer.step(step, progress=lambda text, s=step: progress(f"step {s}/{first_step + steps - 1}: {text}"))
        record["timing_s/elapsed"] = trainer.world.max(time.perf_counter() - start)
        records.append(record)
        if trainer.world.is_main:
            for sink in sinks:
                sink.log(step, record)
    return records
