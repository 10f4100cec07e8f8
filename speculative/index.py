"""ContinuationIndex: for every n-gram (n <= max_n) of the sequences added to it, how often
each token followed it, so a drafter reads "what came after these n tokens, and how often"
with one dict look-up per n, however many sequences the counts come from.

An n-gram is keyed by a 64-bit hash built from its last token backward, one multiply per
token, so the keys of the suffixes of lengths 1..max_n at a position cost max_n steps in
all (no tuples), and a look-up walks the lengths upward, stopping at the first suffix never
seen (no longer one can have been). Two n-grams sharing a hash would only merge their
counts: a worse draft, never a wrong output (verification decides).

A position is counted once its token is known (it is the continuation of the n-grams ending
before it), so a sequence's current suffix never matches itself. Each n-gram's counts are
kept in recency order (a continuation seen again moves to the end): the last one is the
latest continuation, which a point-mass draft follows.
"""

from __future__ import annotations

from collections.abc import Sequence

Counts = dict[int, int]  # next token -> times it followed the n-gram (latest last)

_MASK64 = (1 << 64) - 1
_MULT = 0x9E3779B97F4A7C15  # odd: multiplying is a bijection mod 2**64


class ContinuationIndex:
    __slots__ = ("max_n", "_next")

    def __init__(self, max_n: int) -> None:
        self.max_n = max_n
        self._next: dict[int, Counts] = {}

    def __len__(self) -> int:
        return len(self._next)

    def add(self, tokens: Sequence[int], start: int, end: int) -> None:
        """Count tokens[i], for start <= i < end, as the continuation of each n-gram that ends
        just before it."""
        # (The hash step ((h ^ (token + 1)) * _MULT) & _MASK64 is written out in each of the
        # four walks: they run per drafted or counted token on the step's host path, where a
        # call per step would cost more than the step itself.)
        table, max_n = self._next, self.max_n
        for i in range(max(start, 1), end):
            token, h = tokens[i], 0
            for j in range(i - 1, max(i - max_n, 0) - 1, -1):  # the suffixes of tokens[:i], shortest first
                h = ((h ^ (tokens[j] + 1)) * _MULT) & _MASK64
                counts = table.get(h)
                if counts is None:
                    table[h] = {token: 1}
                else:
                    counts[token] = counts.pop(token, 0) + 1  # re-inserted: the latest goes last

    def remove(self, tokens: Sequence[int], start: int, end: int) -> None:
        """Undo `add(tokens, start, end)` (a sequence leaving: evicted, aborted, retracted)."""
        table, max_n = self._next, self.max_n
        for i in range(max(start, 1), end):
            token, h = tokens[i], 0
            for j in range(i - 1, max(i - max_n, 0) - 1, -1):
                h = ((h ^ (tokens[j] + 1)) * _MULT) & _MASK64
                counts = table.get(h)
                if counts is None or token not in counts:
                    continue  # never added (a caller's mismatch must not raise mid-step)
                if counts[token] > 1:
                    counts[token] -= 1
                elif len(counts) > 1:
                    del counts[token]
                else:
                    del table[h]

    def may_match_after(self, context: Sequence[int], min_n: int) -> bool:
        """Could `context` plus one more token, whichever, have a suffix of length >= min_n
        with counts? That needs a token b that followed the context's last min_n - 1 tokens,
        and that (those tokens, b) was followed in turn: a look-up per such b."""
        if min_n <= 1:
            return bool(self._next)  # any token seen with a successor matches by itself
        tail = list(context[len(context) - (min_n - 1) :])
        if len(tail) < min_n - 1:
            return False
        levels = self.matches(tail, min_n - 1)
        if not levels:
            return False
        table = self._next
        for b in levels[-1]:  # the (min_n - 1)-gram's continuations
            h = ((b + 1) * _MULT) & _MASK64
            for t in reversed(tail):
                h = ((h ^ (t + 1)) * _MULT) & _MASK64
            if h in table:
                return True
        return False

    def matches(self, context: Sequence[int], min_n: int) -> list[Counts]:
        """Continuation counts after the context's suffixes of length >= min_n, longest first."""
        table, found, h = self._next, [], 0
        for n in range(1, min(self.max_n, len(context)) + 1):
            h = ((h ^ (context[-n] + 1)) * _MULT) & _MASK64
            counts = table.get(h)
            if counts is None:
                break  # never seen: no longer suffix was either
            if n >= min_n:
                found.append(counts)
        found.reverse()
        return found

    def counts(self, ngram: Sequence[int]) -> Counts | None:
        """What followed exactly `ngram` (inspection and tests)."""
        h = 0
        for token in reversed(ngram):
            h = ((h ^ (token + 1)) * _MULT) & _MASK64
        return self._next.get(h)
