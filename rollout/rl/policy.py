"""The policy a GRPO trainer optimizes (any Hugging Face causal LM checkpoint, trained in
full or through a PEFT LoRA adapter) and how it reaches the colocated engine each step.

Two syncs, one interface (`push()` after every optimizer step, the engine's version back):

- FullSync: `engine.update_weights(iter_hf_weights(model))`: every weight; for a PEFT
  model the merged W + scale * B @ A of each LoRA layer (the model is not modified).
- AdapterSync: LoRA only. The adapter is loaded into the engine once (`load_lora_adapter`,
  the engine's multi-LoRA path) and each step sends just lora_A / lora_B
  (`update_lora_adapter(iter_hf_weights(model, adapter_only=True))`); generation runs
  under that adapter. A few MB a step instead of the whole model.

`make_sync` picks AdapterSync for a PEFT policy when the engine has LoRA on, FullSync
otherwise. Either way the sync reports which version made each sampled token, so the loop
can measure the version lag of what it trains on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from rollout.request import RolloutOutput
from rollout.rl.batch import versions_from_spans
from weightsync.trainer import iter_hf_weights


@dataclass(frozen=True)
class LoraSpec:
    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0  # > 0 makes the trainer's log-probs differ from the engine's by design
    target_modules: str | tuple[str, ...] = "all-linear"

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank={self.rank}: must be >= 1")


def load_policy(model_dir: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                lora: LoraSpec | None = None, random_seed: int | None = None) -> nn.Module:
    """AutoModelForCausalLM from `model_dir` in eval mode (no dropout: the trainer must score
    tokens with the same function the engine sampled them with), optionally PEFT-wrapped.
    random_seed: random weights of the directory's config.json instead (benchmark shapes);
    the engine then needs one sync before the first rollout (GRPOTrainer(initial_sync=True))."""
    if random_seed is not None:
        from rollout.hf_trainer import random_trainer_model

        model = random_trainer_model(model_dir, str(device), dtype, random_seed)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        target = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
        model = get_peft_model(model, LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                 target_modules=target))
    return model.eval()


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the policy has no trainable parameters")
    return params


def peft_config(model: nn.Module) -> Any | None:
    """The active LoraConfig of a PEFT model (looking through DDP), else None."""
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    configs = getattr(inner, "peft_config", None)
    if not configs:
        return None
    return configs[getattr(inner, "active_adapter", "default")]


@dataclass(frozen=True)
class SyncResult:
    version: int  # the version of what the engine now serves (base weights or the adapter)
    seconds: float


class WeightSync(Protocol):
    lora_name: str | None  # generate under this adapter (None: the base model)

    @property
    def version(self) -> int: ...

    def push(self) -> SyncResult: ...

    def push_all(self) -> SyncResult:
        """Everything the engine needs to serve the policy, for an engine that loaded other
        weights (random benchmark weights, another checkpoint)."""
        ...

    def token_versions(self, output: RolloutOutput) -> list[int]: ...


class FullSync:
    lora_name = None

    def __init__(self, engine: Any, model: nn.Module) -> None:
        self.engine, self.model = engine, model

    @property
    def version(self) -> int:
        return self.engine.weight_version

    def push(self) -> SyncResult:
        start = time.perf_counter()
        version = self.engine.update_weights(iter_hf_weights(self.model))
        return SyncResult(version, time.perf_counter() - start)

    push_all = push

    def token_versions(self, output: RolloutOutput) -> list[int]:
        return versions_from_spans(output.weight_versions, output.weight_version, len(output.token_ids))


class AdapterSync:
    def __init__(self, engine: Any, model: nn.Module, name: str = "policy") -> None:
        config = peft_config(model)
        if config is None:
            raise ValueError("AdapterSync needs a PEFT (LoRA) policy")
        self.engine, self.model, self.lora_name = engine, model, name
        engine.load_lora_adapter(name, tensors=iter_hf_weights(model, adapter_only=True), config=config)
        self._version = 0

    @property
    def version(self) -> int:
        return self._version

    def push(self) -> SyncResult:
        start = time.perf_counter()
        self._version = self.engine.update_lora_adapter(self.lora_name, iter_hf_weights(self.model, adapter_only=True))
        return SyncResult(self._version, time.perf_counter() - start)

    def push_all(self) -> SyncResult:
        """The base weights (adapters disabled: the walk yields them unmerged), then the adapter."""
        start = time.perf_counter()
        with _unwrap(self.model).disable_adapter():
            self.engine.update_weights(iter_hf_weights(self.model))
        version = self.push().version
        return SyncResult(version, time.perf_counter() - start)

    def token_versions(self, output: RolloutOutput) -> list[int]:
        return versions_from_spans(output.lora_versions, self._version, len(output.token_ids))


def make_sync(engine: Any, model: nn.Module, mode: str = "auto") -> WeightSync:
    """mode: "adapter" (LoRA only), "full", or "auto" (adapter when possible)."""
    if mode not in ("auto", "adapter", "full"):
        raise ValueError(f"sync mode {mode!r}: expected auto, adapter or full")
    lora_ready = peft_config(model) is not None and getattr(engine, "lora", None) is not None
    if mode == "adapter" and not lora_ready:
        raise ValueError("adapter sync needs a PEFT policy and an engine with EngineConfig(enable_lora=True)")
    return AdapterSync(engine, model) if mode == "adapter" or (mode == "auto" and lora_ready) else FullSync(engine, model)


def _unwrap(model: nn.Module) -> nn.Module:
    """The PeftModel under a DDP wrapper (disable_adapter is the PeftModel's)."""
    return model.module if hasattr(model, "module") and not hasattr(model, "disable_adapter") else model
