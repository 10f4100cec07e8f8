"""Chat requests whose output is constrained: `response_format` (json_object, json_schema) and
forced tool calls (`tool_choice` naming a function, or "required"), as the JSON schema the
engine samples under (SamplingParams.json_schema); and the tool calls read back from the
constrained text.

- response_format {"type": "json_object"}: any JSON object; {"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}: that schema.
- tool_choice {"type": "function", "function": {"name": F}}: the output is F's arguments (its
  `parameters` schema); it comes back as one tool call to F, finish_reason "stop" (as OpenAI
  answers a named tool choice). Streamed: the call's id and name first, then the arguments
  as they come.
- tool_choice "required": the output is {"name": one of the tools, "arguments": its
  parameters}; it comes back as one tool call, finish_reason "tool_calls". Not streamed (the
  name is only known once its JSON is complete): a stream asking for it gets a 400.

Knows OpenAI's request and message shapes; not the engine or HTTP.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from rollout.server.openai_errors import ApiError

_ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolCallMode:
    """How a chat's output becomes a tool call (None on the job: it is plain content)."""

    name: str | None  # the forced function; None: "required" (the output names it)


def output_schema(body: dict) -> tuple[dict | None, ToolCallMode | None]:
    """The JSON schema a chat request's output must follow (None: unconstrained), and how it
    is returned when it is a tool call. Every refusal names its field."""
    schema = _response_format(body.get("response_format"))
    tool_schema, mode = _tool_choice(body.get("tool_choice"), body.get("tools"), bool(body.get("stream")))
    if schema is not None and tool_schema is not None:
        raise ApiError("response_format and a forced tool_choice both constrain the output; send one", "tool_choice")
    return (schema if schema is not None else tool_schema), mode


def _response_format(value: Any) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise ApiError("response_format: expected {'type': 'text' | 'json_object' | 'json_schema', ...}", "response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return _ANY_OBJECT
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise ApiError("response_format.json_schema: expected an object with name and schema",
                       "response_format.json_schema")
    schema = spec.get("schema", _ANY_OBJECT)
    if not isinstance(schema, dict):
        raise ApiError("response_format.json_schema.schema: expected a JSON schema object",
                       "response_format.json_schema.schema")
    return schema


def _tool_choice(choice: Any, tools: Any, stream: bool) -> tuple[dict | None, ToolCallMode | None]:
    if choice is None or choice in ("auto", "none"):
        return None, None
    functions = _functions(tools)
    if choice == "required":
        if stream:
            raise ApiError("tool_choice='required' is not supported with stream: true (the function's name is only "
                           "known once the call is complete); name the function, or do not stream", "tool_choice")
        options = [{"type": "object", "properties": {"name": {"const": name}, "arguments": params},
                    "required": ["name", "arguments"]} for name, params in functions.items()]
        return {"anyOf": options}, ToolCallMode(None)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if not isinstance(name, str):
        raise ApiError("tool_choice: expected 'none', 'auto', 'required' or {'type': 'function', 'function': "
                       "{'name': ...}}", "tool_choice")
    if name not in functions:
        raise ApiError(f"tool_choice names function {name!r}, which is not in tools ({sorted(functions)})", "tool_choice")
    return functions[name], ToolCallMode(name)


def _functions(tools: Any) -> dict[str, dict]:
    """tools -> {function name: its parameters schema}."""
    if not isinstance(tools, list) or not tools:
        raise ApiError("tool_choice forces a tool call, and tools is empty", "tools")
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(f"tools[{i}]: expected {{'type': 'function', 'function': {{'name', 'parameters'}}}}",
                           f"tools[{i}]")
        params = fn.get("parameters", _ANY_OBJECT)
        if not isinstance(params, dict):
            raise ApiError(f"tools[{i}].function.parameters: expected a JSON schema object",
                           f"tools[{i}].function.parameters")
        out[fn["name"]] = params
    return out


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_calls(mode: ToolCallMode, text: str) -> list[dict] | None:
    """The message's tool_calls from the constrained text (None: not a complete call, e.g.
    cut by max_tokens; the text is then returned as content)."""
    if mode.name is not None:
        name, arguments = mode.name, text
    else:
        try:
            call = json.loads(text)
        except json.JSONDecodeError:
            return None
        name, arguments = call["name"], json.dumps(call["arguments"], ensure_ascii=False)
    return [{"id": tool_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}]
