"""Structured output under LoRA adapters: in one batch, constrained rows under an adapter and
on the base model each give peft's (or transformers') greedy tokens under xgrammar's mask,
teacher-forced, with raw log-probs to 2e-4."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import SMOLLM2_KV_TOKENS
from rollout import Engine, EngineConfig, SamplingParams

from _structured_helpers import REGEX, SCHEMAS, chat, reference_logits, xgr_compiler  # noqa: E402, F401 (fixtures)

peft = pytest.importorskip("peft")
pytest.importorskip("xgrammar")


def _masked_greedy_check(model, compiler, params, prompt: list[int], out) -> None:
    logits, masked = reference_logits(model, compiler, params, prompt, out.token_ids)
    assert out.finish_reason == "stop" and out.token_ids == masked.argmax(-1).tolist()
    ref_raw = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.logprobs), ref_raw, atol=2e-4, rtol=0)


def test_constrained_rows_under_an_adapter_and_the_base_model(smollm2, xgr_compiler, tmp_path) -> None:
    path, tok, hf = smollm2
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
    model = peft.get_peft_model(copy.deepcopy(hf), config, adapter_name="tool")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # peft's lora_B starts at zero (a no-op): make the adapter change the outputs
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    model.save_pretrained(str(tmp_path))
    engine = Engine(EngineConfig(model=path, page_size=16, max_total_tokens=SMOLLM2_KV_TOKENS, enable_lora=True,
                                 max_lora_rank=8))
    [adapter_dir] = {p.parent for p in tmp_path.rglob("adapter_config.json")}  # peft nests named adapters
    engine.load_lora_adapter("tool", str(adapter_dir))
    prompts = [chat(tok, "Describe a person as JSON with a name and an age."),
               chat(tok, "Is the sky blue? Answer yes or no and say why.")] * 2
    params = [SamplingParams(json_schema=SCHEMAS[0], temperature=0, max_new_tokens=48, logprobs_mode="raw"),
              SamplingParams(regex=REGEX, temperature=0, max_new_tokens=48, logprobs_mode="raw")] * 2
    outs = engine.generate(input_ids=prompts, sampling_params=params, lora_name=["tool", "tool", None, None])
    model.eval()
    for i, (prompt, p, out) in enumerate(zip(prompts, params, outs)):
        _masked_greedy_check(model if i < 2 else hf, xgr_compiler, p, prompt, out)
    assert outs[0].token_ids != outs[2].token_ids or outs[1].token_ids != outs[3].token_ids  # the adapter mattered
