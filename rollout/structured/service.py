"""The engine's structured-output parts (compiler, mask builder), built at the first request
that asks for a constraint, so an engine that never does pays nothing (not even importing
xgrammar or indexing the vocabulary); and the step loop's grammar hook (rollout/core/hooks.py):
which steps sample under grammars, their masks, each token's advance. Until a constrained
request comes in, the hook answers as the null one does without looking at the requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, wait
from typing import TYPE_CHECKING, Any

from rollout.core.hooks import Grammar
from rollout.structured.spec import GrammarSpec

if TYPE_CHECKING:
    import torch

    from rollout.request import Req
    from rollout.structured.bitmask import TokenMask


class StructuredOutput(Grammar):
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: set[int], threads: int = 2) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.threads = threads
        self._compiler: Any = None
        self._masks: Any = None
        self._serving = False  # a constrained request came in: steps look for grammars from then on

    @property
    def compiler(self) -> Any:
        if self._compiler is None:
            from rollout.structured.compiler import GrammarCompiler

            self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.stop_token_ids, self.threads)
        return self._compiler

    @property
    def masks(self) -> Any:
        if self._masks is None:
            from rollout.structured.bitmask import MaskBuilder

            self._masks = MaskBuilder(self.vocab_size)
        return self._masks

    def states(self, spec: GrammarSpec, n: int) -> list[Any]:
        """A matcher state for each of n samples, their grammar compiling in the background.
        Refuses (ValueError naming the field) what cannot be served, before anything is queued."""
        if self.tokenizer is None:
            raise ValueError(f"{spec.field}: structured output needs the model's tokenizer, and this engine has "
                             "none (its model directory has no tokenizer files, or load_tokenizer=False)")
        try:
            import xgrammar  # noqa: F401
        except ImportError:
            raise ValueError(f"{spec.field}: structured output needs xgrammar: pip install "
                             "'rollout-engine[structured]'") from None
        from rollout.structured.matcher import GrammarState

        self.compiler.check(spec)
        future = self.compiler.submit(spec)
        self._serving = True
        return [GrammarState(spec, future, self.stop_token_ids) for _ in range(n)]

    # ---- the step loop's grammar hook ---------------------------------------------------
    def constrained(self, reqs: list[Req]) -> bool:
        return self._serving and any(r.grammar is not None for r in reqs)

    def mask(self, reqs: list[Req], drafts: list[list[int]], device: torch.device) -> TokenMask | None:
        """The masks of this step's constrained rows (their matchers have seen every token
        emitted so far: with overlap, the previous step was read back first)."""
        rows, at = [], 0
        for req, mine in zip(reqs, drafts):
            if req.grammar is not None and not req.finished:
                rows.append((at, req.grammar, mine))
            at += 1 + len(mine)
        return self.masks.build(rows, at, device)

    def accept(self, req: Req, token: int) -> bool:
        return req.grammar is not None and req.grammar.accept(token)

    def wait_for_compiles(self, waiting: Sequence[Req]) -> None:
        """Sleep until one of the waiting requests' grammars is compiled (at most 50 ms)
        instead of spinning against the compiling threads."""
        pending = [r.grammar.compiled for r in waiting if r.grammar is not None and not r.grammar.ready()]
        if pending:
            wait(pending, timeout=0.05, return_when=FIRST_COMPLETED)
