"""Text for one request, built off the step loop: incremental detokenization (stream text
deltas), stop strings (where the text first contains one, and which token made it), and
the final output cut there.

The rule it keeps is the in-process engine's (rollout/core/outputs.py): a request stops at
the first token after which its decoded text contains a stop string; its token_ids end
with that token; its text is the decoded text cut before the stop string. The engine
process applies the rule here, after the fact, so the output is the same; what differs is
only when the engine hears of it (see text_worker.py).

Knows a tokenizer's decode(); not sockets, queues or the engine.
"""

from __future__ import annotations

import dataclasses

from rollout.request import RolloutOutput

_INCOMPLETE = "\ufffd"  # what decode() gives for a UTF-8 sequence cut between tokens


class IncrementalText:
    """Text of a growing token list, a delta at a time, without decoding the whole list each
    time: decode a short window ending at the new tokens and keep what it adds past the
    tokens already read (vLLM's prefix/read offsets). A delta ending in half a character is
    held until the next token completes it."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0  # window start: tokens before it never change the text again
        self._read_offset = 0  # tokens whose text is in self.text

    def add(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        decode = self.tokenizer.decode
        before = decode(self.token_ids[self._prefix_offset : self._read_offset], skip_special_tokens=True)
        after = decode(self.token_ids[self._prefix_offset :], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith(_INCOMPLETE):
            return ""
        delta = after[len(before) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        self.text += delta
        return delta


class StopWatch:
    """Feeds tokens through IncrementalText and reports the first token after which the text
    contains one of `stop`. `sendable_text` holds back the last len(longest stop) - 1
    characters, which may yet begin a stop string, so a stream never shows part of one."""

    def __init__(self, tokenizer, stop: tuple[str, ...]) -> None:
        self.text = IncrementalText(tokenizer)
        self.stop = stop
        self.stop_at: int | None = None  # tokens kept (the stopping token included), once hit
        self._hold = max((len(s) for s in stop), default=1) - 1

    @property
    def num_tokens(self) -> int:
        return len(self.text.token_ids)

    def feed(self, token_ids: list[int]) -> bool:
        """Add tokens until a stop string shows; True once one has (later tokens ignored)."""
        for token in token_ids:
            if self.stop_at is not None:
                return True
            seen = len(self.text.text)
            if self.text.add(token) and self.stop:
                window = self.text.text[max(0, seen - self._hold) :]  # a new match must touch the new text
                if any(s in window for s in self.stop):
                    self.stop_at = self.num_tokens
        return self.stop_at is not None

    def sendable_text(self) -> str:
        """The text a stream may show so far: all of it when no stop string can follow."""
        if not self.stop:
            return self.text.text
        if self.stop_at is not None:
            return cut_at_stop(self.text.text, self.stop)
        return self.text.text[: len(self.text.text) - self._hold] if self._hold else self.text.text


def cut_at_stop(text: str, stop: tuple[str, ...]) -> str:
    cuts = [text.find(s) for s in stop if s in text]
    return text[: min(cuts)] if cuts else text


def finish_output(output: RolloutOutput, tokenizer, stop: tuple[str, ...], stop_at: int | None) -> RolloutOutput:
    """The engine's output as in-process generate would have returned it: text decoded (as
    Outputs.make does), and with a stop string hit after `stop_at` tokens, every per-token
    field cut there and the finish reason "stop". If the stopping token was the last one
    anyway, the engine's own reason stands (in-process checks EOS and length first)."""
    if tokenizer is None:
        return output
    if stop_at is not None and stop_at < len(output.token_ids) or (stop_at is not None and output.finish_reason == "abort"):
        output = _cut(output, stop_at)
    text = tokenizer.decode(output.token_ids, skip_special_tokens=True)
    return dataclasses.replace(output, text=cut_at_stop(text, stop) if stop else text)


def _cut(output: RolloutOutput, keep: int) -> RolloutOutput:
    weight_versions = _clip_spans(output.weight_versions, keep)
    return dataclasses.replace(
        output,
        token_ids=output.token_ids[:keep],
        logprobs=output.logprobs[:keep],
        top_logprobs=output.top_logprobs[:keep] if output.top_logprobs is not None else None,
        weight_versions=weight_versions,
        weight_version=weight_versions[-1][0] if weight_versions else output.weight_version,
        lora_versions=_clip_spans(output.lora_versions, keep) if output.lora_versions is not None else None,
        finish_reason="stop",
    )


def _clip_spans(spans: list[tuple[int, int, int]], keep: int) -> list[tuple[int, int, int]]:
    return [(version, start, min(end, keep)) for version, start, end in spans if start < keep]
