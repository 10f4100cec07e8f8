"""YaRN RoPE scaling (Qwen3's long context): the frequencies and the attention factor are
transformers' for every way a checkpoint states them, and a tiny Qwen3 with YaRN generates
transformers' greedy tokens and log-probs past its original context."""

from __future__ import annotations

import pytest
import torch

from conftest import _COMMON, make_prompts
from rollout import Engine, EngineConfig, SamplingParams
from rollout.model.config import ModelConfig
from rollout.model.llama import rope_attention_factor, rope_inv_freq

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}


def _hf_config(**rope):
    from transformers import Qwen3Config

    return Qwen3Config(**_COMMON, head_dim=32, tie_word_embeddings=False, rope_parameters={**YARN, **rope})


@pytest.mark.parametrize("rope", [
    {},
    {"beta_fast": 16, "beta_slow": 2},
    {"attention_factor": 0.8},
    {"mscale": 1.0, "mscale_all_dim": 0.5},  # DeepSeek's form of the attention factor
    {"truncate": False},
    {"factor": None},  # the factor from max_position_embeddings / original
    {"rope_theta": 1_000_000.0, "factor": 8.0},
], ids=str)
def test_frequencies_and_attention_factor_are_transformers(rope: dict) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = _hf_config(**rope)
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    cfg = ModelConfig.from_dict(hf.to_dict() | {"architectures": ["Qwen3ForCausalLM"]})
    torch.testing.assert_close(rope_inv_freq(cfg), want_freq.float(), atol=0, rtol=1e-6)
    assert rope_attention_factor(cfg) == pytest.approx(want_factor, rel=1e-9)


def test_a_qwen3_with_yarn_generates_transformers_tokens_past_its_original_context(tmp_path) -> None:
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(7)
    hf = Qwen3ForCausalLM(_hf_config()).eval()
    with torch.no_grad():  # sharpen the flat random init: greedy argmaxes are not near-ties
        for name, p in hf.named_parameters():
            if "norm" not in name:
                p.mul_(4.0)
    hf.config.architectures = ["Qwen3ForCausalLM"]
    hf.save_pretrained(tmp_path)
    prompt = make_prompts(hf.config.vocab_size, [40], seed=8)[0]  # past the original 32 positions
    engine = Engine(EngineConfig(model=str(tmp_path), page_size=16))
    out = engine.generate(input_ids=[prompt], sampling_params=SamplingParams(
        temperature=0, max_new_tokens=10, ignore_eos=True, logprobs_mode="raw"))[0]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0,
                           attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1].float()
    assert out.token_ids == want
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)


def test_partial_rotary_is_refused_by_name() -> None:
    cfg = ModelConfig.from_dict(_hf_config(partial_rotary_factor=0.5).to_dict() | {"architectures": ["Qwen3ForCausalLM"]})
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5"):
        rope_inv_freq(cfg)
