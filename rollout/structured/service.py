"""The engine's structured-output parts (compiler, mask builder), built at the first request
that asks for a constraint, so an engine that never does pays nothing (not even importing
xgrammar or indexing the vocabulary).
"""

from __future__ import annotations

from typing import Any

from rollout.structured.spec import GrammarSpec


class StructuredOutput:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: set[int], threads: int = 2) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.threads = threads
        self._compiler: Any = None
        self._masks: Any = None

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
        return [GrammarState(spec, future, self.stop_token_ids) for _ in range(n)]
