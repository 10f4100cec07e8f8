"""SmolLM2 (the real default model) and xgrammar's own view of its vocabulary: the references
the structured-output tests check the engine against."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def smollm2():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout.model.fetch import fetch_default_model

    path = fetch_default_model()
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return str(path), tok, hf


@pytest.fixture(scope="session")
def xgr_compiler(smollm2):
    """xgrammar's compiler over SmolLM2's vocabulary, built here (not the engine's)."""
    import xgrammar as xgr

    _, tok, hf = smollm2
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=hf.config.vocab_size, stop_token_ids=[tok.eos_token_id])
    return xgr.GrammarCompiler(info)

