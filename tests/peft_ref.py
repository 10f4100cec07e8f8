"""The multi-LoRA reference, shared by the LoRA engine tests and the tensor-parallel ones:
three PEFT adapters of different ranks, alphas and target sets (one rslora) on a tiny
model, held unmerged in one PeftModel (float32, CPU) and saved as PEFT directories."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from conftest import TinyModel

from rollout import SamplingParams

NEW = 8
GREEDY = SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True, logprobs_mode="raw")
ADAPTERS = {
    "a": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "b": dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]),
    "c": dict(r=4, lora_alpha=8, target_modules=["k_proj", "o_proj", "down_proj", "up_proj"], use_rslora=True),
}


class PeftRef:
    """One PeftModel holding every adapter (unmerged), the reference for tokens and log-probs."""

    def __init__(self, tiny: TinyModel, root: Path) -> None:
        import peft  # the callers importorskip it

        base = copy.deepcopy(tiny.hf)
        self.model = None
        for i, (name, cfg) in enumerate(ADAPTERS.items()):
            config = peft.LoraConfig(**cfg)
            if self.model is None:
                self.model = peft.get_peft_model(base, config, adapter_name=name)
            else:
                self.model.add_adapter(name, config)
            randomize_adapter(self.model, name, seed=100 + i)  # peft's lora_B starts at zero: a no-op
        self.model.eval()
        self.dirs = {name: save_adapter(self.model, name, root / name) for name in ADAPTERS}

    @torch.no_grad()
    def greedy(self, adapter: str | None, prompt: list[int], n: int = NEW) -> list[int]:
        ids = torch.tensor([prompt])
        kw = dict(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
                  attention_mask=torch.ones_like(ids))
        if adapter is None:
            with self.model.disable_adapter():
                out = self.model.generate(input_ids=ids, **kw)
        else:
            self.model.set_adapter(adapter)
            out = self.model.generate(input_ids=ids, **kw)
        return out[0, len(prompt):].tolist()

    @torch.no_grad()
    def logprobs(self, adapter: str | None, prompt: list[int], completion: list[int]) -> torch.Tensor:
        ids = torch.tensor([prompt + completion])
        if adapter is None:
            with self.model.disable_adapter():
                logits = self.model(input_ids=ids).logits
        else:
            self.model.set_adapter(adapter)
            logits = self.model(input_ids=ids).logits
        lp = torch.log_softmax(logits[0, len(prompt) - 1 : -1].float(), -1)
        return lp.gather(-1, torch.tensor(completion)[:, None])[:, 0]


def save_adapter(model, adapter: str, path: Path) -> str:
    """One adapter as a PEFT directory (adapter_config.json + adapter_model.safetensors)."""
    model.save_pretrained(str(path), selected_adapters=[adapter])
    found = [p.parent for p in path.rglob("adapter_config.json")]  # peft nests non-default adapters
    assert len(found) == 1, found
    return str(found[0])


def randomize_adapter(model, adapter: str, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if f".{adapter}." in name and "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
