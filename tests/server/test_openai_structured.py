"""The OpenAI endpoint's constrained outputs on SmolLM2, through the official client:
response_format (json_object, json_schema), a named tool_choice (whole and streamed) and
tool_choice "required", each checked against what it promises (the text parses and fits the
schema; the tool call names a tool and its arguments fit its parameters)."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")

from conftest import SMOLLM2_KV_TOKENS  # noqa: E402
from rollout import Engine, EngineConfig  # noqa: E402
from rollout.server.openai_backend import InProcessBackend  # noqa: E402
from rollout.server.openai_http import ServerThread, build_app, load_tokenizer  # noqa: E402
from rollout.server.openai_protocol import Limits  # noqa: E402

MODEL = "smollm2"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
             "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                              "b": {"type": "integer", "minimum": 0, "maximum": 99}},
             "required": ["a", "b"]}}}]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client():
    from rollout.model.fetch import fetch_default_model

    path = str(fetch_default_model())
    engine = Engine(EngineConfig(model=path, page_size=16, max_total_tokens=SMOLLM2_KV_TOKENS))
    backend = InProcessBackend(engine)
    server = ServerThread(build_app(backend, load_tokenizer(path), MODEL,
                                    Limits(engine.context_len, engine.model_config.vocab_size))).start()
    yield openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)
    server.stop()
    backend.close()


def test_response_format_json_schema_and_json_object(client) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A person, as JSON."}],
                                          response_format=fmt, n=3, temperature=1.0, seed=0, max_tokens=64)
    for choice in resp.choices:
        assert choice.finish_reason == "stop"
        person = json.loads(choice.message.content)
        assert set(person) == {"name", "age"} and len(person["name"]) <= 12 and 0 <= person["age"] <= 120
    resp = client.chat.completions.create(model=MODEL, messages=USER, response_format={"type": "json_object"},
                                          temperature=0, max_tokens=128)
    assert resp.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(resp.choices[0].message.content), dict)


def test_named_tool_choice_whole_and_streamed(client) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    resp = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice=choice,
                                          temperature=0, max_tokens=32)
    [call] = resp.choices[0].message.tool_calls
    assert resp.choices[0].message.content is None and resp.choices[0].finish_reason == "stop"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    stream = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice=choice,
                                            temperature=0, max_tokens=32, stream=True)
    parts, names = [], []
    for chunk in stream:
        for delta_call in chunk.choices[0].delta.tool_calls or []:
            names.append(delta_call.function.name)
            parts.append(delta_call.function.arguments or "")
    assert names[0] == "get_weather" and "".join(parts) == call.function.arguments


def test_required_tool_choice(client) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Add 2 and 3."}],
                                          tools=TOOLS, tool_choice="required", n=2, temperature=1.0, seed=1,
                                          max_tokens=64)
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls
        args = json.loads(call.function.arguments)
        assert call.function.name in ("get_weather", "add")
        assert set(args) == ({"city"} if call.function.name == "get_weather" else {"a", "b"})
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required", stream=True)
    assert info.value.body["param"] == "tool_choice"
