"""Structured-output benchmark parts (benchmarks/structured.py): steady decode throughput of
a batch whose rows are half JSON-constrained against the same batch unconstrained, and grammar
compile times.

The constrained rows follow BENCH_SCHEMA, an array of at least 64 small records, so they stay
inside structured JSON (keys, integers, bounded strings, booleans) for the whole timed window
instead of finishing early; every row, constrained or not, samples at temperature 1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from benchmarks.common.steady import run_to_decode

BENCH_SCHEMA = {
    "type": "array", "minItems": 64,
    "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 100000},
                                               "name": {"type": "string", "maxLength": 16},
                                               "ok": {"type": "boolean"},
                                               "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]},
                                                        "maxItems": 3}},
              "required": ["id", "name", "ok", "tags"]},
}
SMALL_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                 "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                "required": ["name", "age"]}
REGEX = r"(yes|no), because [a-z ]{1,40}\."


@dataclass
class DecodeResult:
    label: str
    tokens_per_s: float
    step_ms: float
    rows_running: int  # rows still decoding at the end of the window (all of them, or the result is not steady)


def steady_decode(engine, label: str, prompts: list[list[int]], params: list, steps: int) -> DecodeResult:
    """Queue the batch on an idle engine, run it to steady decode, time `steps` steps (their
    tokens read back), then abort what is left."""
    for prompt, p in zip(prompts, params):
        engine.add_request(prompt, p)
    run_to_decode(engine, warm_steps=2)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    generated = engine.counters.generated_tokens
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    engine.step()  # with overlap the last step's tokens are read back one step later
    sync()
    seconds = time.perf_counter() - start
    tokens = engine.counters.generated_tokens - generated
    running = len(engine.scheduler.running)
    for req in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        engine.abort(req.rid)
    while engine.has_unfinished():
        engine.step()
    return DecodeResult(label, tokens / seconds, 1000 * seconds / (steps + 1), running)


def mixed_batch(prompts: list[list[int]], max_new_tokens: int, constrained_every: int = 2) -> tuple[list, list]:
    """(unconstrained params, mixed params) for the prompts: every `constrained_every`-th row
    of the mixed batch follows BENCH_SCHEMA; unconstrained rows ignore EOS (they stay running)."""
    from rollout import SamplingParams

    plain = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, ignore_eos=True, seed=0)
    json_row = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, json_schema=BENCH_SCHEMA, seed=0)
    mixed = [json_row if i % constrained_every == 0 else plain for i in range(len(prompts))]
    return [plain] * len(prompts), mixed


def compile_times(tokenizer, vocab_size: int, stop_token_ids: list[int]) -> list[tuple[str, float]]:
    """Seconds for: xgrammar's view of the vocabulary (once per engine), each grammar's cold
    compile (a fresh compiler, so nothing cached), and a cached lookup."""
    from rollout.structured.compiler import GrammarCompiler
    from rollout.structured.spec import GrammarSpec, constraint_fields

    start = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, vocab_size, stop_token_ids)
    rows = [("tokenizer info (once per engine)", time.perf_counter() - start)]
    specs = [("JSON schema: small object", GrammarSpec("json_schema", constraint_fields(SMALL_SCHEMA, None, None))),
             ("JSON schema: bench records", GrammarSpec("json_schema", constraint_fields(BENCH_SCHEMA, None, None))),
             ("regex", GrammarSpec("regex", REGEX))]
    for label, spec in specs:
        start = time.perf_counter()
        compiler.submit(spec).result()
        rows.append((f"compile {label}", time.perf_counter() - start))
    start = time.perf_counter()
    compiler.submit(specs[1][1]).result()
    rows.append(("cached (same text again)", time.perf_counter() - start))
    compiler.close()
    return rows
