"""One request's place in its grammar: an xgrammar GrammarMatcher (CPU state, like the rest
of Req), made from the compiled grammar once its compilation is done.

Invariant between steps: the matcher has accepted exactly the request's `output_ids`. Tokens
are accepted as the step loop appends them; a retracted request keeps its tokens, so its
matcher stays where it is; each of n samples has its own matcher. Speculative drafts move
the matcher forward only while their rows' masks are filled (`fill_rows`) and are rolled
back right after, so what stays accepted is always what was emitted.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from rollout.structured.spec import GrammarSpec


class GrammarState:
    def __init__(self, spec: GrammarSpec, compiled: Future, stop_token_ids: list[int]) -> None:
        self.spec = spec
        self.compiled = compiled
        self._stop_token_ids = stop_token_ids
        self._matcher: Any = None

    # ---- compilation ------------------------------------------------------------------
    def ready(self) -> bool:
        """Compiled (or failed: `error` says why); a request is admitted once this holds."""
        return self.compiled.done()

    def error(self) -> str | None:
        if not self.compiled.done():
            return None
        exc = self.compiled.exception()
        return None if exc is None else f"{self.spec.field}: compilation failed: {exc}"

    @property
    def matcher(self) -> Any:
        if self._matcher is None:
            import xgrammar as xgr

            # The engine's EOS ids end the grammar: once it is complete only they are legal,
            # and accepting one terminates the matcher (and finishes the request).
            self._matcher = xgr.GrammarMatcher(self.compiled.result(), override_stop_tokens=self._stop_token_ids)
        return self._matcher

    # ---- tokens -----------------------------------------------------------------------
    def accept(self, token: int) -> bool:
        """Advance past an emitted token; True when it ended the grammar. A token the grammar
        refuses cannot have been sampled under its mask: that is a bug, said loudly."""
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"{self.spec.field}: sampled token {token} is not legal under the grammar")
        return self.matcher.is_terminated()

    @property
    def terminated(self) -> bool:
        return self._matcher is not None and self._matcher.is_terminated()

    def legal_prefix(self, drafts: list[int]) -> int:
        """How many leading drafts the grammar allows: a draft it refuses could never be
        accepted (the target's token there is drawn under the mask), nor any after it."""
        m = self.matcher
        n = 0
        for token in drafts:
            if m.is_terminated() or not m.accept_token(token):
                break
            n += 1
        if n:
            m.rollback(n)
        return n

    def fill_rows(self, bitmask: Any, first_row: int, drafts: list[int]) -> None:
        """Masks for a request's 1 + len(drafts) sampling rows: row j is the state after the
        first j drafts (all legal: `legal_prefix` trimmed them). Rolled back after."""
        m = self.matcher
        m.fill_next_token_bitmask(bitmask, first_row)
        for j, token in enumerate(drafts):
            accepted = m.accept_token(token)
            assert accepted, "drafts are trimmed to the grammar before the step"
            if m.is_terminated():  # a stop token among the drafts: nothing after it is emitted
                m.rollback(j + 1)
                return
            m.fill_next_token_bitmask(bitmask, first_row + j + 1)
        if drafts:
            m.rollback(len(drafts))
