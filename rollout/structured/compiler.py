"""Grammar compilation: specs -> xgrammar CompiledGrammars, on a thread pool, cached by text.

Compiling a grammar against the vocabulary (xgrammar's per-token mask cache) takes from
under a millisecond (a small regex) to tens of milliseconds (a JSON schema) to seconds (a
large grammar on a 128k vocabulary), so it never runs on the step loop: `submit` returns a
Future at once and the request waits in the queue for it while every other request keeps
running. A spec seen before shares its Future (and so its compiled grammar) with every
request that uses it; the cache holds the last `cache_size` specs.

Knows the tokenizer (as xgrammar's TokenizerInfo) and the model's vocabulary size; does not
know requests or the device.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from rollout.structured.spec import GrammarSpec, parse


@dataclass
class CompileStats:
    compiled: int = 0  # grammars compiled (cache misses that finished)
    cache_hits: int = 0
    failed: int = 0
    compile_seconds: float = 0.0  # summed over compiles, on the pool's threads


class GrammarCompiler:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], threads: int = 2,
                 cache_size: int = 1024) -> None:
        import xgrammar as xgr

        # The mask's width is the model's vocabulary (its logits), which may exceed the
        # tokenizer's (padded embeddings); ids past the tokenizer's are never allowed.
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        # xgrammar's own cache is off: this one is keyed by text and bounded by count.
        self._xgr = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._lock = threading.Lock()  # the cache is read by intake and written by pool threads
        self.cache_size = cache_size
        self.stats = CompileStats()

    def check(self, spec: GrammarSpec) -> None:
        """Refuse a spec xgrammar cannot parse (ValueError naming the field); cheap, and
        skipped for a spec already in the cache (a failed compile leaves it)."""
        with self._lock:
            cached = spec in self._cache
        if not cached:
            parse(spec)

    def submit(self, spec: GrammarSpec) -> Future:
        """The spec's compiled grammar, as a Future (done at once when cached)."""
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                self.stats.cache_hits += 1
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[spec] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)  # requests holding an evicted Future keep it
        return future

    def _compile(self, spec: GrammarSpec) -> Any:
        start = time.perf_counter()
        try:
            compiled = self._xgr.compile_grammar(parse(spec))
        except Exception:
            with self._lock:
                self.stats.failed += 1
                if self._cache.get(spec) is not None:
                    del self._cache[spec]  # a later request tries again (and is told why)
            raise
        with self._lock:
            self.stats.compiled += 1
            self.stats.compile_seconds += time.perf_counter() - start
        return compiled

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
