"""Text for the OpenAI endpoint, one token at a time: incremental detokenization that hands
out only stable text, and stop strings.

Stable text: a byte-level tokenizer splits a multi-byte character (an accent, a CJK
character, an emoji) over several tokens, and decoding a prefix of them gives U+FFFD. The
detokenizer decodes a small window of recent tokens and hands out the new text only once
it no longer ends in an incomplete character (vLLM's prefix/read offsets); `finish()`
flushes what is left. What it hands out, concatenated, is `tokenizer.decode(all tokens)`.

Stop strings: the text is cut before the first stop string, and the tail that could still
grow into one is held back until it cannot (or the sample ends), so a streamed client never
sees text that a later token turns into a stop.

Knows a tokenizer; does not know the engine or HTTP.
"""

from __future__ import annotations

_INCOMPLETE = "\ufffd"  # what decoding a partial UTF-8 sequence ends in


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""  # the stable text handed out so far
        # Tokens [prefix_offset, read_offset) are the context the window is decoded with
        # (a SentencePiece decoder drops a leading space at the start of a decode); tokens
        # from read_offset on are not in self.text yet.
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def add(self, token_id: int) -> str:
        """Take one token; returns the text that became stable with it (often "")."""
        self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        window = self._decode(self.token_ids[self._prefix_offset:])
        if len(window) <= len(prefix) or window.endswith(_INCOMPLETE):
            return ""  # a special token skipped, or a character still missing bytes
        delta = window[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        self.text += delta
        return delta

    def finish(self) -> str:
        """The sample ended: whatever is left (an incomplete character decodes to U+FFFD)."""
        full = self._decode(self.token_ids)
        if full.startswith(self.text):
            delta = full[len(self.text):]
        else:  # a decoder that is not prefix-stable: the window's remainder is the best we have
            prefix = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
            delta = self._decode(self.token_ids[self._prefix_offset:])[len(prefix):]
        self._prefix_offset = self._read_offset = len(self.token_ids)
        self.text += delta
        return delta


class StopText:
    """One sample's text as its tokens arrive: stable, cut at the first stop string.

    `add(token)` returns the text safe to hand out now; once a stop string appears,
    `stopped` is set, the text ends before the stop, and the caller aborts the request
    (tokens after the one that completed the stop are not part of the sample)."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.stop = tuple(stop)
        self._longest_stop = max((len(s) for s in self.stop), default=0)
        self.sent = 0  # characters of detok.text handed out
        self.stopped = False

    @property
    def text(self) -> str:
        """The text handed out so far."""
        return self.detok.text[: self.sent]

    def add(self, token_id: int) -> str:
        if self.stopped:
            raise RuntimeError("StopText.add after a stop string ended the text")
        checked = len(self.detok.text)
        self.detok.add(token_id)
        return self._advance(checked, final=False)

    def finish(self) -> str:
        if self.stopped:
            return ""
        checked = len(self.detok.text)
        self.detok.finish()
        return self._advance(checked, final=True)

    def _advance(self, checked: int, final: bool) -> str:
        """Hand out text up to the first stop, or up to the tail that may become one.
        `checked`: the text before this call held no complete stop string."""
        text = self.detok.text
        end = len(text)
        if self.stop:
            start = max(0, checked - self._longest_stop + 1)
            hits = [i for s in self.stop if (i := text.find(s, start)) >= 0]
            if hits:
                self.stopped = True
                end = min(hits)
            elif not final:
                end -= self._held_tail(text)
        delta = text[self.sent:end]
        self.sent = max(self.sent, end)
        return delta

    def _held_tail(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        held = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), held, -1):
                if text.endswith(s[:k]):
                    held = k
                    break
        return held
