"""Counters the engine keeps while it works, and the stats() view of them.

Counters only; turning them into dashboards (W&B) is the caller's business.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class Counters:
    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests (first admission only)
    cached_prompt_tokens: int = 0  # of those, served from the prefix cache (or a fork)
    computed_tokens: int = 0  # tokens whose KV was computed (prefill, chunks, recompute after retraction)
    generated_tokens: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    deadline_requests: int = 0  # ended by their SamplingParams.deadline_s
    retractions: int = 0
    # speculative decoding: draft tokens verified, those accepted, and the (request, step)
    # verifications (mean accepted length per verification = accepted / verify_steps)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0
    # ... decode steps while drafting that had nothing to draft and overlapped, and the
    # read-backs a drafting step waited for (of a step in flight) before it drafted
    spec_overlapped_steps: int = 0
    spec_drains: int = 0
    step_seconds: float = 0.0  # wall time inside step(): schedule, forward, sample, read back, bookkeeping


@dataclass(frozen=True)
class EngineStats:
    tokens_per_second: float  # generated tokens over time spent stepping
    prefix_cache_hit_rate: float  # cached prompt tokens / prompt tokens
    num_running: int
    num_waiting: int
    kv_used_tokens: int
    kv_capacity_tokens: int
    kv_usage: float
    weight_version: int
    counters: dict
    # speculative decoding: accepted drafts per verification (tokens emitted per verify step
    # is this + 1), and the share of drafted tokens accepted
    mean_accepted_length: float = 0.0
    draft_acceptance_rate: float = 0.0
    # speculative="draft": the weight version the draft model was last synced at, and whether
    # drafting is paused because the target moved on without it
    draft_weight_version: int | None = None
    draft_stale: bool = False
    # Engine.pause_generation's mode while generation is paused, else None
    generation_paused: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)
