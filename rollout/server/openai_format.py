"""Response bodies and stream chunks in OpenAI's shapes, from ChoiceEvents.

OpenAI's own fields: text / message content, finish_reason, logprobs (completions: tokens,
token_logprobs, top_logprobs, text_offset; chat: content[] with token, logprob, bytes,
top_logprobs), usage (prompt_tokens_details.cached_tokens: prompt tokens served from the
prefix cache). With `return_token_ids: true` each choice also carries the extension fields
a trainer needs, in streamed chunks as deltas:
  prompt_token_ids (the first chunk of a choice), token_ids and token_logprobs (the engine's
  log-probs, per logprobs_mode), weight_version and weight_versions ([version, start, end]
  spans over token_ids; the last chunk), lora_name and lora_versions under an adapter.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import lru_cache

from rollout.server.openai_choices import ChoiceEvent
from rollout.server.openai_protocol import GenerationJob
from rollout.server.openai_structured import tool_call_id, tool_calls


class Formatter:
    def __init__(self, tokenizer, job: GenerationJob, response_id: str, created: int, model: str) -> None:
        self.tokenizer = tokenizer
        self.job = job
        self.id = response_id
        self.created = created
        self.model = model
        self._token_text: dict[int, str] = {}
        self._token_bytes: dict[int, list[int]] = {}
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"  # GPT-2 style: a token's chars are its bytes
        self._started: set[int] = set()  # choices whose first chunk went out
        self._completion_tokens = 0
        self._cached_tokens = 0

    # ---- whole responses --------------------------------------------------------------------
    def response(self, events: Iterable[ChoiceEvent]) -> dict:
        totals: dict[int, ChoiceEvent] = {}
        for event in events:
            total = totals.setdefault(event.index, ChoiceEvent(event.index))
            _extend(total, event)
            self._count(event)
        choices = [self._choice(totals[i], first=True, delta=False) for i in sorted(totals)]
        obj = "text_completion" if self.job.kind == "completion" else "chat.completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                "usage": self.usage()}

    # ---- streamed ----------------------------------------------------------------------------
    def opening_chunks(self) -> list[dict]:
        """Chat: a first chunk per choice with the assistant role (as OpenAI sends); with the
        token-id extension it also carries the prompt's ids (completions too)."""
        if self.job.kind == "completion" and not self.job.return_token_ids:
            return []
        out = []
        for index in range(len(self.job.prompts) * self.job.n):
            out.append(self._chunk([self._choice(ChoiceEvent(index), first=True, delta=True)]))
            self._started.add(index)
        return out

    def chunk(self, event: ChoiceEvent) -> dict | None:
        self._count(event)
        if event.empty:
            return None
        first = event.index not in self._started
        self._started.add(event.index)
        return self._chunk([self._choice(event, first=first, delta=True)])

    def usage_chunk(self) -> dict:
        return {**self._chunk([]), "usage": self.usage()}

    def _chunk(self, choices: list[dict]) -> dict:
        obj = "text_completion" if self.job.kind == "completion" else "chat.completion.chunk"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    # ---- parts -------------------------------------------------------------------------------
    def usage(self) -> dict:
        prompt = sum(len(p) for p in self.job.prompts)
        return {"prompt_tokens": prompt, "completion_tokens": self._completion_tokens,
                "total_tokens": prompt + self._completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self._cached_tokens}}

    def _count(self, event: ChoiceEvent) -> None:
        self._completion_tokens += len(event.token_ids)
        if event.output is not None and event.index % self.job.n == 0:  # a prompt's first sample
            self._cached_tokens += event.output.num_cached_tokens

    def _choice(self, event: ChoiceEvent, first: bool, delta: bool) -> dict:
        job = self.job
        choice: dict = {"index": event.index}
        if job.kind == "completion":
            choice["text"] = event.text
            choice["logprobs"] = self._completion_logprobs(event) if job.logprobs is not None else None
        elif job.tool_call is not None:
            self._tool_call_choice(choice, event, first, delta)
        else:
            if delta:
                choice["delta"] = {"role": "assistant", "content": event.text} if first else (
                    {"content": event.text} if event.text or event.token_ids else {})
            else:
                choice["message"] = {"role": "assistant", "content": event.text}
        if job.kind == "chat":
            choice["logprobs"] = self._chat_logprobs(event) if job.logprobs is not None else None
        choice.setdefault("finish_reason", event.finish_reason)
        if job.return_token_ids:
            if first:
                choice["prompt_token_ids"] = job.prompts[event.index // job.n]
            choice["token_ids"] = event.token_ids
            choice["token_logprobs"] = event.logprobs
            if event.output is not None:
                out = event.output
                versions = event.weight_versions if event.weight_versions is not None else out.weight_versions
                choice["weight_version"] = versions[-1][0] if versions else out.weight_version
                choice["weight_versions"] = [list(span) for span in versions]
                if out.lora_name is not None:
                    choice["lora_name"] = out.lora_name
                    choice["lora_versions"] = [list(s) for s in out.lora_versions or []]
        return choice

    def _tool_call_choice(self, choice: dict, event: ChoiceEvent, first: bool, delta: bool) -> None:
        """A forced tool call: the constrained text is the call (openai_structured.py)."""
        mode = self.job.tool_call
        assert mode is not None
        if delta:  # streamed: only a named function (its id and name first, then the arguments)
            if first:
                call = {"index": 0, "id": tool_call_id(), "type": "function",
                        "function": {"name": mode.name, "arguments": event.text}}
                choice["delta"] = {"role": "assistant", "content": None, "tool_calls": [call]}
            else:
                choice["delta"] = {"tool_calls": [{"index": 0, "function": {"arguments": event.text}}]} \
                    if event.text else {}
            return
        calls = tool_calls(mode, event.text)
        if calls is None:  # not a complete call (cut by max_tokens): the text as it is
            choice["message"] = {"role": "assistant", "content": event.text}
            return
        choice["message"] = {"role": "assistant", "content": None, "tool_calls": calls}
        if mode.name is None and event.finish_reason == "stop":
            choice["finish_reason"] = "tool_calls"

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"token_id:{token_id}"
            self._token_text[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's own bytes (OpenAI's `bytes`): a byte-level token that holds part of a
        character decodes to U+FFFD, but its bytes, concatenated with its neighbours', are
        the character."""
        found = self._token_bytes.get(token_id)
        if found is None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id) if self.tokenizer is not None else None
            byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece) if isinstance(piece, str) else None
            table = _byte_decoder()
            if byte is not None:  # SentencePiece byte fallback
                found = [int(byte.group(1), 16)]
            elif self._byte_level and isinstance(piece, str) and piece and all(ch in table for ch in piece):
                found = [table[ch] for ch in piece]
            else:
                found = list(self.token_text(token_id).encode())
            self._token_bytes[token_id] = found
        return found

    def _completion_logprobs(self, event: ChoiceEvent) -> dict:
        top = None
        if self.job.logprobs:
            top = [{self.token_text(t): lp for t, lp in alternatives} for alternatives in event.top_logprobs]
        return {"tokens": [self.token_text(t) for t in event.token_ids], "token_logprobs": list(event.logprobs),
                "top_logprobs": top, "text_offset": list(event.text_offsets)}

    def _chat_logprobs(self, event: ChoiceEvent) -> dict:
        content = []
        for k, (token, logprob) in enumerate(zip(event.token_ids, event.logprobs)):
            entry = {"token": self.token_text(token), "logprob": logprob, "bytes": self.token_bytes(token),
                     "top_logprobs": []}
            if self.job.logprobs:
                entry["top_logprobs"] = [{"token": self.token_text(t), "logprob": lp, "bytes": self.token_bytes(t)}
                                         for t, lp in event.top_logprobs[k]]
            content.append(entry)
        return {"content": content, "refusal": None}


def _extend(total: ChoiceEvent, event: ChoiceEvent) -> None:
    total.text += event.text
    total.token_ids += event.token_ids
    total.logprobs += event.logprobs
    total.top_logprobs += event.top_logprobs
    total.text_offsets += event.text_offsets
    if event.finish_reason is not None:
        total.finish_reason = event.finish_reason
        total.output = event.output
        total.weight_versions = event.weight_versions


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, char -> byte: printable bytes stand for themselves, the
    other 68 are shifted to code points from 256 up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table
