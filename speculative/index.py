"""NgramIndex: where each n-gram (n <= max_n) of a growing token sequence last occurred, so
a drafter finds "the last time these n tokens appeared, what came next" in O(max_n) dict
look-ups per step instead of a scan of the sequence.

An n-gram is indexed once a token follows it (its continuation exists), so the sequence's
own current suffix never matches itself.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    __slots__ = ("max_n", "tokens", "_last", "_indexed")

    def __init__(self, max_n: int) -> None:
        self.max_n = max_n
        self.tokens: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> start of its latest indexed occurrence
        self._indexed = 0  # n-grams ending at positions < this are indexed

    def sync(self, *parts: Sequence[int]) -> None:
        """Catch up with the sequence `parts` concatenate to (the same sequence, grown since
        the last call): a request passes its prompt and its output, uncopied."""
        have = len(self.tokens)
        for part in parts:
            if have < len(part):
                self.tokens.extend(part[have:])
            have = max(have - len(part), 0)
        t, last, max_n = self.tokens, self._last, self.max_n
        for end in range(self._indexed + 1, len(t)):  # n-grams t[end-n:end] with t[end] after them
            for n in range(1, min(max_n, end) + 1):
                last[tuple(t[end - n : end])] = end - n
        self._indexed = max(self._indexed, len(t) - 1)

    def continuation(self, key: tuple[int, ...], k: int, own: bool = False) -> list[int]:
        """Up to k tokens that followed the latest indexed occurrence of `key` ([] if none).
        own=True: `key` is this sequence's own suffix, so a continuation that runs into the
        end goes on with itself (a repeating pattern repeats: the copy the draft predicts)."""
        start = self._last.get(key)
        if start is None:
            return []
        at = start + len(key)
        out = self.tokens[at : at + k]
        if own:
            end = len(self.tokens)
            while len(out) < k:  # position at + len(out) >= end: the draft's own earlier token
                out.append(out[at + len(out) - end])
        return out
