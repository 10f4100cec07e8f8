"""The OpenAI-compatible endpoint through the official `openai` client, on CPU.

The model is a tiny random Llama whose vocabulary is a byte-level BPE tokenizer trained here
on a few sentences (accents, CJK, an emoji), saved beside it with a ChatML chat template: the
random model emits byte tokens that split multi-byte characters, which is what incremental
detokenization has to get right. The server runs in a thread on a free loopback port, in
front of an in-process engine (InProcessBackend).
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from rollout import Engine, EngineConfig, SamplingParams  # noqa: E402
from rollout.server.openai_backend import InProcessBackend  # noqa: E402
from rollout.server.openai_detok import IncrementalDetokenizer, StopText  # noqa: E402
from rollout.server.openai_http import ServerThread, build_app, check_host, load_tokenizer  # noqa: E402
from rollout.server.openai_protocol import Limits  # noqa: E402

MODEL = "tiny-chat"
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["Hello world, the quick brown fox jumps over the lazy dog.", "héllo wörld café naïve",
          "你好世界 🙂 emoji", "What is 2 + 3? The answer is 5."]


def _make_model_dir(path) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(CORPUS * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharpen the nearly flat random init: greedy argmaxes are not near-ties
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(4.0)
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return _make_model_dir(tmp_path_factory.mktemp("tiny_chat"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


def _config(model_dir: str) -> EngineConfig:
    return EngineConfig(model=model_dir, max_total_tokens=4096)


@pytest.fixture(scope="module")
def served(model_dir, tokenizer):
    engine = Engine(_config(model_dir))
    backend = InProcessBackend(engine)
    app = build_app(backend, tokenizer, MODEL, Limits(engine.context_len, engine.model_config.vocab_size))
    server = ServerThread(app).start()
    yield server, backend
    server.stop()
    backend.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].base_url, api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(model_dir) -> Engine:
    return Engine(_config(model_dir))


def _engine_stats(backend: InProcessBackend):
    import asyncio

    return asyncio.run(backend.call(lambda engine: engine.stats()))


def _wait_idle(backend: InProcessBackend, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        stats = _engine_stats(backend)
        if stats.num_running == 0 and stats.num_waiting == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


# ---- text, one token at a time ---------------------------------------------------------------

def test_detokenizer_holds_split_characters(tokenizer):
    text = "héllo 你好🙂 wörld"
    ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids), "the test needs a character split over tokens"
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add(t) for t in ids]
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) + detok.finish() == text


def test_stop_text_holds_back_a_possible_stop(tokenizer):
    ids = tokenizer.encode("the quick brown fox")
    stop = StopText(tokenizer, ("brown f",))
    out = ""
    for t in ids:
        out += stop.add(t)
        assert "the quick ".startswith(out)  # nothing of the stop string is handed out early
        if stop.stopped:
            break
    assert stop.stopped and out == "the quick "
    # a partial match that never completes comes out at the end
    partial = StopText(tokenizer, ("lazy cat",))
    text = "".join(partial.add(t) for t in tokenizer.encode("over the lazy dog")) + partial.finish()
    assert text == "over the lazy dog" and not partial.stopped


# ---- the endpoint --------------------------------------------------------------------------

def test_models(client, served):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == 512


def test_completion_text_and_token_prompts(client, tokenizer):
    text = "What is 2 + 3?"
    by_text = client.completions.create(model=MODEL, prompt=text, max_tokens=12, temperature=0,
                                        extra_body={"return_token_ids": True})
    ids = tokenizer.encode(text)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                                       extra_body={"return_token_ids": True})
    a, b = by_text.choices[0], by_ids.choices[0]
    assert a.model_extra["prompt_token_ids"] == ids == b.model_extra["prompt_token_ids"]
    assert a.model_extra["token_ids"] == b.model_extra["token_ids"] and a.text == b.text
    assert a.text == tokenizer.decode(a.model_extra["token_ids"], skip_special_tokens=True)
    assert by_text.usage.prompt_tokens == len(ids)
    assert by_text.usage.completion_tokens == len(a.model_extra["token_ids"])
    assert a.finish_reason in ("stop", "length")


def test_chat_completion(client, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo 你好"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                          extra_body={"return_token_ids": True})
    choice = resp.choices[0]
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert choice.model_extra["prompt_token_ids"] == tokenizer.encode(templated, add_special_tokens=False)
    assert choice.message.role == "assistant"
    assert choice.message.content == tokenizer.decode(choice.model_extra["token_ids"], skip_special_tokens=True)
    assert resp.object == "chat.completion" and resp.usage.total_tokens == resp.usage.prompt_tokens + len(
        choice.model_extra["token_ids"])


def _collect_stream(chunks, kind: str):
    text: dict[int, str] = {}
    tokens: dict[int, list[int]] = {}
    logprobs: dict[int, list[float]] = {}
    finish: dict[int, str] = {}
    versions: dict[int, list] = {}
    usage = None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            piece = c.text if kind == "completion" else (c.delta.content or "")
            text[c.index] = text.get(c.index, "") + piece
            tokens.setdefault(c.index, []).extend(c.model_extra.get("token_ids", []))
            logprobs.setdefault(c.index, []).extend(c.model_extra.get("token_logprobs", []))
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
                versions[c.index] = c.model_extra.get("weight_versions")
    return text, tokens, logprobs, finish, versions, usage


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_stream_concatenates_to_the_whole_response(client, kind):
    args = dict(model=MODEL, max_tokens=40, temperature=1.0, seed=11, n=2, extra_body={"return_token_ids": True})
    if kind == "completion":
        create, args["prompt"] = client.completions.create, "héllo 你好"
    else:
        create, args["messages"] = client.chat.completions.create, [{"role": "user", "content": "héllo 你好"}]
    whole = create(**args)
    text, tokens, logprobs, finish, versions, usage = _collect_stream(
        create(**args, stream=True, stream_options={"include_usage": True}), kind)
    assert sorted(text) == [0, 1]
    for c in whole.choices:
        body = c.text if kind == "completion" else c.message.content
        assert text[c.index] == body
        assert tokens[c.index] == c.model_extra["token_ids"]
        assert logprobs[c.index] == pytest.approx(c.model_extra["token_logprobs"], abs=1e-6)
        assert finish[c.index] == c.finish_reason
        assert versions[c.index] == c.model_extra["weight_versions"]
    assert whole.choices[0].model_extra["token_ids"] != whole.choices[1].model_extra["token_ids"]
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_completion_logprobs(client):
    resp = client.completions.create(model=MODEL, prompt="the quick", max_tokens=8, temperature=0.7, seed=3,
                                     logprobs=3, extra_body={"return_token_ids": True})
    choice = resp.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(choice.model_extra["token_ids"])
    assert lp.token_logprobs == pytest.approx(choice.model_extra["token_logprobs"])
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs_streamed_and_whole(client, tokenizer):
    args = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=24, temperature=1.0, seed=4,
                logprobs=True, top_logprobs=2, extra_body={"return_token_ids": True})
    whole = client.chat.completions.create(**args)
    content = whole.choices[0].logprobs.content
    assert content and all(len(e.top_logprobs) == 2 for e in content)
    assert all(e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in content)
    # byte-level tokens holding part of a character show U+FFFD, but their bytes join into the text
    assert any(e.token == "\ufffd" for e in content)  # (seeded: the random model samples byte tokens)
    raw = b"".join(bytes(e.bytes) for e in content).decode("utf-8", errors="replace")
    assert raw == tokenizer.decode(whole.choices[0].model_extra["token_ids"])
    streamed = [e for chunk in client.chat.completions.create(**args, stream=True) for c in chunk.choices
                if c.logprobs is not None for e in c.logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content])
    assert [e.token for e in streamed] == [e.token for e in content]


def test_completion_several_prompts_and_samples(client, tokenizer):
    prompts = ["the lazy dog", "你好世界"]
    resp = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6, seed=1,
                                     extra_body={"return_token_ids": True})
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    for c in resp.choices:
        assert c.model_extra["prompt_token_ids"] == tokenizer.encode(prompts[c.index // 2])
    assert resp.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)


def test_token_ids_are_the_engines(client, reference):
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is 2 + 3?"}], max_tokens=24, temperature=0.8,
        top_p=0.9, seed=5, n=3, extra_body={"return_token_ids": True, "logprobs_mode": "raw"})
    prompt = resp.choices[0].model_extra["prompt_token_ids"]
    outs = reference.generate(input_ids=[prompt], sampling_params=SamplingParams(
        temperature=0.8, top_p=0.9, seed=5, n=3, max_new_tokens=24, logprobs_mode="raw"))
    for choice, out in zip(resp.choices, outs):
        extra = choice.model_extra
        assert extra["prompt_token_ids"] == out.prompt_ids
        assert extra["token_ids"] == out.token_ids
        assert extra["token_logprobs"] == pytest.approx(out.logprobs, abs=1e-5)
        assert extra["weight_version"] == 0 and extra["weight_versions"] == [[0, 0, len(out.token_ids)]]
        assert choice.finish_reason == out.finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_text_and_tokens(client, served, tokenizer, stream):
    prompt = "over the lazy"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                     extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0]
    text, ids = full.text, full.model_extra["token_ids"]
    start = next(i for i in range(4, len(text) - 3) if "\ufffd" not in text[i:i + 3] and text[i:i + 3].strip())
    stop = text[start:start + 3]
    args = dict(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=[stop, "never-there"],
                extra_body={"return_token_ids": True, "ignore_eos": True})
    if stream:
        got_text, got_tokens, _, finish, _, _ = _collect_stream(client.completions.create(**args, stream=True),
                                                                "completion")
        got_text, got_ids, reason = got_text[0], got_tokens[0], finish[0]
    else:
        choice = client.completions.create(**args).choices[0]
        got_text, got_ids, reason = choice.text, choice.model_extra["token_ids"], choice.finish_reason
    assert got_text == text[: text.find(stop)] and reason == "stop"
    assert got_ids == ids[: len(got_ids)]  # the tokens up to the one that completed the stop string
    assert stop in tokenizer.decode(got_ids) and stop not in tokenizer.decode(got_ids[:-1])
    stats = _wait_idle(served[1])
    assert stats.num_running == 0 and stats.kv_used_tokens == 0


def _error(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as info:
        call()
    return info.value


@pytest.mark.parametrize("kind,fields,status,param", [
    ("completion", {"temperature": -1}, 400, "temperature"),
    ("completion", {"temperature": "hot"}, 400, "temperature"),
    ("completion", {"n": 0}, 400, "n"),
    ("completion", {"max_tokens": 5000}, 400, "max_tokens"),
    ("completion", {"model": "nope"}, 404, "model"),
    ("completion", {"prompt": [1.5, 2]}, 400, "prompt"),
    ("completion", {"prompt": [99999]}, 400, "prompt"),
    ("completion", {"prompt": ""}, 400, "prompt"),
    ("completion", {"presence_penalty": 0.5}, 400, "presence_penalty"),
    ("completion", {"logit_bias": {"5": 10}}, 400, "logit_bias"),
    ("completion", {"best_of": 3}, 400, "best_of"),
    ("completion", {"echo": True}, 400, "echo"),
    ("completion", {"some_new_knob": 1}, 400, "some_new_knob"),
    ("completion", {"stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("completion", {"logprobs": 50}, 400, "logprobs"),
    ("chat", {"messages": []}, 400, "messages"),
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("chat", {"top_logprobs": 2}, 400, "top_logprobs"),
    ("chat", {"frequency_penalty": 1.0}, 400, "frequency_penalty"),
    ("chat", {"response_format": {"type": "xml"}}, 400, "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}}, 400,
     "response_format"),
    ("chat", {"tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, "tools"),
    ("chat", {"max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("chat", {"top_p": 0}, 400, "top_p"),
    ("chat", {"seed": "7"}, 400, "seed"),
    ("chat", {"lora_name": "math"}, 404, "lora_name"),
])
def test_bad_requests_name_the_field(served, kind, fields, status, param):
    # raw JSON, so that fields of the wrong type reach the server as sent
    body = {"model": MODEL, "max_tokens": 4}
    body.update({"prompt": "hi"} if kind == "completion" else {"messages": [{"role": "user", "content": "hi"}]})
    body.update(fields)
    path = "completions" if kind == "completion" else "chat/completions"
    resp = httpx.post(f"{served[0].base_url}/{path}", json=body, timeout=30)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_bad_requests_through_the_client(client, served):
    err = _error(lambda: client.completions.create(model=MODEL, prompt="hi", temperature=3))
    assert isinstance(err, openai.BadRequestError) and err.param == "temperature"
    err = _error(lambda: client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}]))
    assert isinstance(err, openai.NotFoundError) and err.param == "model"
    err = _error(lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                        stream=True, n=0))
    assert isinstance(err, openai.BadRequestError) and err.param == "n"
    resp = httpx.post(f"{served[0].base_url}/completions", content=b"{not json", timeout=30)
    assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]


def test_client_disconnect_aborts_the_stream(client, served):
    backend = served[1]

    def slow(engine):
        step = engine.step

        def slow_step():
            time.sleep(0.01)
            return step()

        engine.step = slow_step
        return step

    import asyncio

    before = _engine_stats(backend).counters["aborted_requests"]
    original = asyncio.run(backend.call(slow))
    try:
        stream = client.completions.create(model=MODEL, prompt="the quick", max_tokens=400, temperature=1.0,
                                           stream=True, extra_body={"ignore_eos": True})
        received = 0
        for chunk in stream:
            received += sum(1 for c in chunk.choices if c.text)
            if received >= 3:
                break
        assert _engine_stats(backend).num_running == 1
        stream.close()
        stats = _wait_idle(backend)
    finally:
        asyncio.run(backend.call(lambda engine: setattr(engine, "step", original)))
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.counters["aborted_requests"] == before + 1
    assert stats.kv_used_tokens == 0  # its KV went back (or to the unlocked prefix cache)


def test_loopback_only_unless_asked():
    assert check_host("127.0.0.1", False) == "127.0.0.1" and check_host("::1", False) == "::1"
    with pytest.raises(ValueError, match="allow-remote"):
        check_host("0.0.0.0", False)
    assert check_host("0.0.0.0", True) == "0.0.0.0"


def test_sse_wire_format(served):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{served[0].base_url}/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_pause_and_continue_generation_over_http(client, served, tokenizer):
    """SGLang's endpoints: a completion made while paused waits for /continue_generation and
    is then the engine's whole answer; refusals are 400s naming the reason."""
    import threading

    base = served[0].base_url.removesuffix("/v1")
    resp = httpx.post(f"{base}/pause_generation", json={"mode": "in_place"}, timeout=30)
    assert resp.status_code == 200 and resp.json() == {"ok": True, "mode": "in_place"}
    try:
        assert _engine_stats(served[1]).generation_paused == "in_place"
        again = httpx.post(f"{base}/pause_generation", json={"mode": "retract"}, timeout=30)
        assert again.status_code == 400 and "already paused (mode='in_place')" in again.json()["error"]["message"]
        got: list = []
        call = threading.Thread(target=lambda: got.append(client.completions.create(
            model=MODEL, prompt="the cat", max_tokens=6, temperature=0)))
        call.start()
        time.sleep(0.5)
        assert call.is_alive() and not got, "a completion made while paused waits"
    finally:
        assert httpx.post(f"{base}/continue_generation", timeout=30).status_code == 200
    call.join(60)
    assert got and got[0].choices[0].finish_reason in ("length", "stop")
    bad = httpx.post(f"{base}/pause_generation", json={"mode": "keep"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "mode"
    assert "expected one of ['abort', 'retract', 'in_place']" in bad.json()["error"]["message"]
    running = httpx.post(f"{base}/continue_generation", timeout=30)
    assert running.status_code == 400 and "generation is not paused" in running.json()["error"]["message"]
    assert httpx.post(f"{base}/pause_generation", timeout=30).json() == {"ok": True, "mode": "abort"}  # SGLang's default
    assert httpx.post(f"{base}/continue_generation", timeout=30).status_code == 200
    assert _wait_idle(served[1]).generation_paused is None
