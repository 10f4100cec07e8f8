"""Shared by the structured-output tests: xgrammar's own view of SmolLM2's vocabulary (a
fixture to import; `smollm2` is the root conftest's), the constraints, prompts, and checks against xgrammar's matcher and a small
JSON-schema checker. (Not a conftest.py: `from conftest import ...` elsewhere must find the
root one.)"""

from __future__ import annotations

import json
import re

import pytest
import torch

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                      "sunny": {"type": "boolean"},
                                      "scores": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                             "maximum": 9}, "maxItems": 3}},
     "required": ["city", "sunny", "scores"]},
]
REGEX = r"(yes|no), because [a-z]{1,8}\."


@pytest.fixture(scope="session")
def xgr_compiler(smollm2):
    """xgrammar's compiler over SmolLM2's vocabulary, built here (not the engine's)."""
    import xgrammar as xgr

    _, tok, hf = smollm2
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=hf.config.vocab_size, stop_token_ids=[tok.eos_token_id])
    return xgr.GrammarCompiler(info)


def chat(tok, text: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=False))


def reference_matcher(compiler, params):
    """A fresh xgrammar matcher for the request's constraint (the layout the engine promises:
    JSON compact, no free whitespace)."""
    import xgrammar as xgr

    if params.json_schema is not None:
        compiled = compiler.compile_json_schema(params.json_schema, any_whitespace=False)
    elif params.regex is not None:
        compiled = compiler.compile_regex(params.regex)
    else:
        compiled = compiler.compile_grammar(params.grammar)
    return xgr.GrammarMatcher(compiled)


def assert_follows_grammar(compiler, params, tokens: list[int]) -> None:
    """Every token is legal for xgrammar's own matcher, and the last one ends the grammar."""
    matcher = reference_matcher(compiler, params)
    for i, t in enumerate(tokens):
        assert matcher.accept_token(t), f"token {i} ({t}) is not legal under the grammar"
    assert matcher.is_terminated()


def reference_logits(model, compiler, params, prompt: list[int], tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own logits at each output position (teacher-forced on `tokens`, float32),
    and the same with xgrammar's mask of the state before each token applied by xgrammar's
    kernel; every token must be legal and the last must end the grammar."""
    import xgrammar as xgr

    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    matcher = reference_matcher(compiler, params)
    bitmask = xgr.allocate_token_bitmask(1, logits.shape[-1])
    masked = logits.clone()
    for i, token in enumerate(tokens):
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(masked[i : i + 1], bitmask)
        assert matcher.accept_token(token), f"token {i} ({token}) is not legal under the grammar"
    assert matcher.is_terminated()
    return logits, masked


def check_schema(schema: dict, value) -> None:
    """The parts of JSON schema SCHEMAS use (no jsonschema package here)."""
    kind = schema.get("type")
    if kind == "object":
        assert isinstance(value, dict) and set(schema["required"]) <= set(value) <= set(schema["properties"])
        for key, sub in schema["properties"].items():
            if key in value:
                check_schema(sub, value[key])
    elif kind == "array":
        assert isinstance(value, list) and len(value) <= schema.get("maxItems", 1 << 30)
        for item in value:
            check_schema(schema["items"], item)
    elif kind == "string":
        assert isinstance(value, str) and len(value) <= schema.get("maxLength", 1 << 30)
        assert "enum" not in schema or value in schema["enum"]
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool)
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value)
    elif kind == "boolean":
        assert isinstance(value, bool)


def check_text(params, text: str) -> None:
    if params.json_schema is not None:
        check_schema(json.loads(params.json_schema), json.loads(text))
    else:
        assert re.fullmatch(params.regex, text), text
