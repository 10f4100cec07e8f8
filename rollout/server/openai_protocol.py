"""OpenAI request bodies -> a typed `GenerationJob`, checked field by field.

Every refusal is an `ApiError` that names the field (`param`), as OpenAI's own errors do. A
field that would change what is sampled and that the engine cannot honour (penalties,
logit_bias, best_of, echo, ...) is refused, never ignored; so is a field
this server does not know (OpenAI answers those with a 400 too). Fields that change nothing
sampled (user, metadata, ...) are accepted and ignored.

Knows the tokenizer (prompts, chat templates) and the model's limits; does not know the
engine or HTTP.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from rollout.request import SamplingParams
from rollout.server.openai_errors import ApiError
from rollout.server.openai_structured import ToolCallMode, output_schema

MAX_N = 128
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class Limits:
    context_len: int
    vocab_size: int


@dataclass(frozen=True)
class GenerationJob:
    """One /v1/completions or /v1/chat/completions request, ready for the engine."""

    kind: str  # "completion" | "chat"
    model: str
    prompts: list[list[int]]  # token ids, one list per prompt (chat: one)
    params: SamplingParams  # what the engine samples with (stop strings stay here, in `stop`)
    stop: tuple[str, ...]
    lora_name: str | None
    stream: bool
    include_usage: bool
    logprobs: int | None  # None: no OpenAI logprobs; k: with the k most likely tokens per position
    return_token_ids: bool  # the token-id extension: prompt/response ids, log-probs, weight versions
    tool_call: ToolCallMode | None = None  # chat: the output is a forced tool call (openai_structured.py)

    @property
    def n(self) -> int:
        return self.params.n


# ---- fields ----------------------------------------------------------------------------------

_COMMON = {"model", "temperature", "top_p", "n", "stream", "stream_options", "stop", "max_tokens", "seed",
           "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "user",
           # extensions (docs/openai.md, "The token-id extension"): the token-id return, the engine's
           # sampling knobs, adapters
           "return_token_ids", "logprobs_mode", "lora_name", "top_k", "min_p", "stop_token_ids", "ignore_eos"}
_COMPLETION = _COMMON | {"prompt", "echo", "suffix", "best_of"}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools", "tool_choice",
                   "parallel_tool_calls", "metadata", "store", "service_tier", "reasoning_effort", "modalities",
                   "audio", "prediction", "web_search_options", "functions", "function_call", "verbosity",
                   "prompt_cache_key", "safety_identifier", "chat_template_kwargs", "add_generation_prompt"}


class _Body:
    """Typed reads of a JSON object's fields; every failure names the field."""

    def __init__(self, body: Any, known: set[str]) -> None:
        if not isinstance(body, dict):
            raise ApiError(f"the request body must be a JSON object, got {_json_type(body)}")
        unknown = sorted(set(body) - known)
        if unknown:
            raise ApiError(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0])
        self.body = body

    def get(self, name: str, default: Any = None) -> Any:
        value = self.body.get(name)
        return default if value is None else value

    def number(self, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
        value = self.get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ApiError(f"{name}: expected a number, got {value!r}", name)
        if value > hi or value < lo or (lo_open and value == lo):
            raise ApiError(f"{name}={value}: must be in {'(' if lo_open else '['}{lo}, {hi}]", name)
        return float(value)

    def integer(self, name: str, default: int | None, lo: int | None = None, hi: int | None = None) -> int | None:
        value = self.get(name, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ApiError(f"{name}: expected an integer, got {value!r}", name)
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]" if lo is not None else f"<= {hi}"
            raise ApiError(f"{name}={value}: must be {bounds}", name)
        return value

    def boolean(self, name: str, default: bool) -> bool:
        value = self.get(name, default)
        if not isinstance(value, bool):
            raise ApiError(f"{name}: expected true or false, got {value!r}", name)
        return value

    def string(self, name: str, default: str | None = None) -> str | None:
        value = self.get(name, default)
        if value is not None and not isinstance(value, str):
            raise ApiError(f"{name}: expected a string, got {_json_type(value)}", name)
        return value

    def refuse_unless(self, name: str, allowed: Any, why: str) -> None:
        """A field that would change what is sampled: only its no-op values pass."""
        value = self.body.get(name)
        if value is not None and value not in allowed:
            raise ApiError(f"{name}={value!r} is not supported: {why}", name)


def _json_type(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


# ---- requests --------------------------------------------------------------------------------

def parse_completion(body: Any, tokenizer, limits: Limits) -> GenerationJob:
    b = _Body(body, _COMPLETION)
    b.refuse_unless("echo", (False,), "the prompt is not echoed (prompt_token_ids come with return_token_ids)")
    b.refuse_unless("suffix", ("",), "no insertion mode")
    n = b.integer("n", 1, 1, MAX_N)
    best_of = b.integer("best_of", None, 1)
    if best_of is not None and best_of != n:
        raise ApiError(f"best_of={best_of} is not supported (only best_of == n: every sample is returned)", "best_of")
    prompts = _completion_prompts(body.get("prompt"), tokenizer, limits)
    logprobs = b.integer("logprobs", None, 0, MAX_TOP_LOGPROBS)
    return _job(b, "completion", prompts, "prompt", logprobs, default_max_tokens=16, limits=limits)


def parse_chat(body: Any, tokenizer, limits: Limits) -> GenerationJob:
    b = _Body(body, _CHAT)
    schema, tool_call = output_schema(b.body)  # response_format / a forced tool_choice
    for name in ("reasoning_effort", "audio", "prediction", "web_search_options", "functions", "function_call",
                 "verbosity"):
        b.refuse_unless(name, (), "not supported by this engine")
    b.refuse_unless("modalities", (["text"],), "text only")
    prompt = _chat_prompt(b, tokenizer, limits)
    max_tokens, max_completion = b.integer("max_tokens", None, 1), b.integer("max_completion_tokens", None, 1)
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise ApiError("max_tokens and max_completion_tokens differ; send one", "max_completion_tokens")
    wants = b.boolean("logprobs", False)
    top = b.integer("top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top is not None and not wants:
        raise ApiError("top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = (top or 0) if wants else None
    job = _job(b, "chat", [prompt], "messages", logprobs, default_max_tokens=None, limits=limits,
               max_tokens_field="max_completion_tokens" if max_completion is not None else "max_tokens")
    if schema is None:
        return job
    try:
        params = dataclasses.replace(job.params, json_schema=schema)
    except (TypeError, ValueError) as exc:
        raise ApiError(str(exc), "tool_choice" if tool_call is not None else "response_format") from None
    return dataclasses.replace(job, params=params, tool_call=tool_call)


def _job(b: _Body, kind: str, prompts: list[list[int]], prompt_field: str, logprobs: int | None,
         default_max_tokens: int | None, limits: Limits, max_tokens_field: str = "max_tokens") -> GenerationJob:
    model = b.string("model", "") or ""
    for name in ("presence_penalty", "frequency_penalty"):
        if b.number(name, 0.0, -2.0, 2.0) != 0.0:
            raise ApiError(f"{name} is not supported (only 0): the engine samples without penalties", name)
    logit_bias = b.get("logit_bias")
    if logit_bias is not None and logit_bias != {}:
        raise ApiError("logit_bias is not supported", "logit_bias")
    temperature = b.number("temperature", 1.0, 0.0, 2.0)
    top_p = b.number("top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = b.integer("top_k", -1, -1)
    if top_k == 0:
        raise ApiError("top_k=0: must be -1 (off) or >= 1", "top_k")
    min_p = b.number("min_p", 0.0, 0.0, 1.0)
    n = b.integer("n", 1, 1, MAX_N)
    seed = b.integer("seed", None)
    stop = _stop_strings(b.get("stop"))
    stop_token_ids = b.get("stop_token_ids", [])
    if not isinstance(stop_token_ids, list) or any(isinstance(t, bool) or not isinstance(t, int)
                                                   or not 0 <= t < limits.vocab_size for t in stop_token_ids):
        raise ApiError(f"stop_token_ids: expected a list of token ids in [0, {limits.vocab_size})", "stop_token_ids")
    ignore_eos = b.boolean("ignore_eos", False)
    logprobs_mode = b.string("logprobs_mode", "processed")
    if logprobs_mode not in ("processed", "raw"):
        raise ApiError(f"logprobs_mode={logprobs_mode!r}: expected 'processed' or 'raw'", "logprobs_mode")
    lora_name = b.string("lora_name")
    stream = b.boolean("stream", False)
    options = b.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise ApiError("stream_options is only allowed with stream: true", "stream_options")
        if not isinstance(options, dict):
            raise ApiError("stream_options: expected an object", "stream_options")
        include_usage = options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise ApiError("stream_options.include_usage: expected true or false", "stream_options.include_usage")
    return_token_ids = b.boolean("return_token_ids", False)

    longest = max(len(p) for p in prompts)
    room = limits.context_len - longest
    if room < 1:
        raise ApiError(f"{prompt_field}: {longest} prompt tokens leave no room for a completion in the model's "
                       f"context of {limits.context_len} tokens", prompt_field)
    max_tokens = b.integer(max_tokens_field, default_max_tokens, 1)
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > room:
        raise ApiError(f"{max_tokens_field}={max_tokens}: {longest} prompt tokens + {max_tokens} exceeds the "
                       f"model's context of {limits.context_len} tokens", max_tokens_field)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, max_new_tokens=max_tokens,
                            n=n, seed=seed, stop_token_ids=tuple(stop_token_ids), ignore_eos=ignore_eos,
                            logprobs_mode=logprobs_mode, top_logprobs=logprobs or 0)
    return GenerationJob(kind, model, prompts, params, stop, lora_name, stream, include_usage, logprobs,
                         return_token_ids)


def _stop_strings(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise ApiError("stop: expected a non-empty string or a list of non-empty strings", "stop")
    if len(items) > MAX_STOP_STRINGS:
        raise ApiError(f"stop: at most {MAX_STOP_STRINGS} strings", "stop")
    return tuple(items)


def _completion_prompts(prompt: Any, tokenizer, limits: Limits) -> list[list[int]]:
    """prompt: a string, a list of strings, a list of token ids, or a list of lists of ids."""
    if prompt is None:
        raise ApiError("prompt is required", "prompt")
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt:
        items = prompt
    else:
        raise ApiError("prompt: expected a string, a list of strings, a list of token ids or a list of such lists",
                       "prompt")
    out = []
    for i, item in enumerate(items):
        where = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            if tokenizer is None:
                raise ApiError(f"{where}: text needs a tokenizer; this server has none (send token ids)", "prompt")
            ids = list(tokenizer.encode(item))
        elif isinstance(item, list) and all(_is_token(t) for t in item):
            ids = item
            bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
            if bad is not None:
                raise ApiError(f"{where}: token id {bad} is outside the vocabulary [0, {limits.vocab_size})", "prompt")
        else:
            raise ApiError(f"{where}: expected a string or a list of integer token ids", "prompt")
        if not ids:
            raise ApiError(f"{where}: empty prompt (no tokens)", "prompt")
        out.append(ids)
    return out


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _chat_prompt(b: _Body, tokenizer, limits: Limits) -> list[int]:
    messages = b.body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages: expected a non-empty array of messages", "messages")
    conversation = [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
    tools = b.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ApiError("tools: expected an array of tool objects", "tools")
    kwargs = b.get("chat_template_kwargs", {})
    if not isinstance(kwargs, dict):
        raise ApiError("chat_template_kwargs: expected an object", "chat_template_kwargs")
    add_generation_prompt = b.boolean("add_generation_prompt", True)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ApiError("this model has no chat template: use /v1/completions", "messages")
    try:
        text = tokenizer.apply_chat_template(conversation, tools=tools, add_generation_prompt=add_generation_prompt,
                                             tokenize=False, **kwargs)
    except Exception as exc:  # the template itself refused the conversation (raise_exception in jinja)
        raise ApiError(f"messages: the chat template refused them: {exc}", "messages") from exc
    ids = list(tokenizer.encode(text, add_special_tokens=False))  # the template wrote any BOS itself
    if not ids:
        raise ApiError("messages: the chat template produced an empty prompt", "messages")
    return ids


def _message(message: Any, where: str) -> dict:
    if not isinstance(message, dict):
        raise ApiError(f"{where}: expected an object with role and content", where)
    role = message.get("role")
    if role not in _ROLES:
        raise ApiError(f"{where}.role={role!r}: expected one of {list(_ROLES)}", f"{where}.role")
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(f"{where}.content[{j}]: only text parts ({{'type': 'text', 'text': ...}}) are supported",
                               f"{where}.content[{j}]")
            parts.append(part["text"])
        content = "".join(parts)
    elif content is None:
        if not (role == "assistant" and message.get("tool_calls")):
            raise ApiError(f"{where}.content is required", f"{where}.content")
    elif not isinstance(content, str):
        raise ApiError(f"{where}.content: expected a string or an array of text parts", f"{where}.content")
    out = {k: v for k, v in message.items() if k in ("role", "name", "tool_calls", "tool_call_id")}
    out["content"] = content
    return out


def engine_error(exc: Exception) -> ApiError:
    """An engine's refusal (ValueError / TypeError naming its own field) as a 400 naming ours."""
    message = str(exc)
    param = None
    for key, field in (("json_schema", "response_format"), ("max_new_tokens", "max_tokens"), ("lora_name", "model"), ("token id", "prompt"),
                       ("top_logprobs", "logprobs"), ("stop_token_ids", "stop_token_ids"), ("seed", "seed")):
        if key in message:
            param = field
            break
    return ApiError(message, param)
