"""Bad constraints are refused where they enter, naming the field, and the engine keeps
serving: SamplingParams' own checks, xgrammar's parse at intake (nothing of the batch is
queued), a grammar whose compilation fails later (the request ends as aborted, nothing
leaks), and an engine with no tokenizer."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from conftest import SMOLLM2_KV_TOKENS
from rollout import Engine, EngineConfig, SamplingParams
from rollout.structured.spec import GrammarSpec

from _structured_helpers import SCHEMAS, chat  # noqa: E402

pytest.importorskip("xgrammar")


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(json_schema="{not json"), ValueError, r"SamplingParams\.json_schema: not valid JSON"),
    (dict(json_schema=[1, 2]), TypeError, r"SamplingParams\.json_schema: expected a JSON schema object"),
    (dict(json_schema=True), TypeError, r"SamplingParams\.json_schema"),
    (dict(regex=""), TypeError, r"SamplingParams\.regex"),
    (dict(grammar=3), TypeError, r"SamplingParams\.grammar"),
    (dict(regex="a", json_schema={"type": "object"}), ValueError, "json_schema and regex are both set"),
])
def test_sampling_params_checks(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


def test_schema_text_and_dict_are_one_constraint() -> None:
    a = SamplingParams(json_schema=SCHEMAS[0])
    b = SamplingParams(json_schema='{"type": "object",\n "properties": ' + _dumps(SCHEMAS[0]["properties"]) +
                       ', "required": ["name", "age"]}')
    assert a.constraint == b.constraint == GrammarSpec("json_schema", a.json_schema)


def _dumps(value) -> str:
    import json

    return json.dumps(value, indent=2)


@pytest.fixture(scope="module")
def engine(smollm2):
    return Engine(EngineConfig(model=smollm2[0], page_size=16, max_total_tokens=SMOLLM2_KV_TOKENS))


@pytest.mark.parametrize("kwargs, field", [
    (dict(regex="(ab"), "SamplingParams.regex"),
    (dict(json_schema={"type": "foo"}), "SamplingParams.json_schema"),
    (dict(grammar="root ::= undefined_rule"), "SamplingParams.grammar"),
])
def test_xgrammar_refusals_name_the_field_and_queue_nothing(engine, smollm2, kwargs: dict, field: str) -> None:
    tok = smollm2[1]
    prompt = chat(tok, "Hi")
    good = SamplingParams(regex="(yes|no)", max_new_tokens=8, temperature=0)
    with pytest.raises(ValueError, match=rf"prompt 1: {field}: refused by xgrammar: \S"):
        engine.generate(input_ids=[prompt, prompt], sampling_params=[good, SamplingParams(**kwargs)])
    assert not engine.has_unfinished()  # the good prompt before it was not queued either
    with pytest.raises(ValueError, match=field):
        engine.add_request(prompt, SamplingParams(**kwargs))
    out = engine.generate(input_ids=[prompt], sampling_params=good)[0]  # still serving
    assert out.finish_reason == "stop" and out.text in ("yes", "no")


def test_a_grammar_failing_to_compile_aborts_its_request_only(engine, smollm2) -> None:
    """Parse passes, compilation fails (here: a failed Future planted in the cache): the
    request ends as aborted, every sample of it, and the request beside it finishes."""
    tok = smollm2[1]
    params = SamplingParams(regex="(maybe|perhaps)", n=2, max_new_tokens=8, temperature=0)
    failed: Future = Future()
    failed.set_exception(RuntimeError("out of memory in the grammar compiler"))
    engine.structured.compiler._cache[params.constraint] = failed
    other = SamplingParams(regex="(yes|no)", max_new_tokens=8, temperature=0)
    outs = engine.generate(input_ids=[chat(tok, "Hi")] * 2, sampling_params=[params, other])
    assert [o.finish_reason for o in outs] == ["abort", "abort", "stop"]
    assert outs[0].token_ids == [] and outs[2].text in ("yes", "no")
    assert not engine.has_unfinished()
    del engine.structured.compiler._cache[params.constraint]
    engine.flush_cache()
    assert engine.kv.used_slots() == 0


def test_no_tokenizer_no_structured_output(llama) -> None:
    engine = Engine(EngineConfig(model=str(llama.path), load_tokenizer=False))
    with pytest.raises(ValueError, match="SamplingParams.regex: structured output needs the model's tokenizer"):
        engine.add_request([1, 2, 3], SamplingParams(regex="a+"))
    assert engine.generate(input_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_new_tokens=2))[0].token_ids
