"""Requests: what a caller asks for (SamplingParams), what the engine tracks (Req) and what
it returns (RolloutOutput).

Req holds CPU state only. Its KV lives in the pools and is reached through
`req_pool_idx` (a row of the request-to-slot table); nothing here touches a device.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from collections.abc import Hashable
from typing import TYPE_CHECKING

from rollout.structured.spec import GrammarSpec, constraint_fields, spec_of
from rollout.validate import check_bool, check_float, check_int, check_str

if TYPE_CHECKING:
    from rollout.cache.radix import TreeNode
    from rollout.structured.matcher import GrammarState

_LOGPROB_MODES = ("processed", "raw")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 -> greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 -> off
    min_p: float = 0.0
    max_new_tokens: int = 128
    n: int = 1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # "processed": log-prob under the distribution the token was drawn from (after a
    # grammar's mask, temperature and top-k/top-p/min-p); "raw": log_softmax of the unmodified logits,
    # which is what a trainer recomputes. For greedy both report the raw value.
    logprobs_mode: str = "processed"
    top_logprobs: int = 0  # > 0: also return the k most likely tokens per position
    # Structured output (at most one): every token is drawn under a mask of what the
    # constraint allows next; the request ends ("stop") when it is complete. json_schema: a
    # dict or its JSON text (kept as JSON text); regex: a pattern; grammar: EBNF whose start
    # rule is `root` (xgrammar's dialect).
    json_schema: str | None = None
    regex: str | None = None
    grammar: str | None = None
    # Scheduling: a higher priority is admitted before, and retracted after, a lower one
    # (SGLang's default order); deadline_s: seconds after the request is accepted, after
    # which it ends with finish_reason "deadline", keeping its tokens.
    priority: int = 0
    deadline_s: float | None = None

    def __post_init__(self) -> None:
        # Every field is checked for type and range, floats for finiteness (NaN passes any
        # `<` test); lists are accepted for convenience but stored as tuples (frozen, hashable).
        f = "SamplingParams."
        set_ = object.__setattr__
        set_(self, "temperature", check_float(self.temperature, f + "temperature"))
        set_(self, "top_p", check_float(self.top_p, f + "top_p"))
        set_(self, "min_p", check_float(self.min_p, f + "min_p"))
        check_int(self.top_k, f + "top_k", min=-1)
        check_int(self.max_new_tokens, f + "max_new_tokens", min=1)
        check_int(self.n, f + "n", min=1)
        check_int(self.top_logprobs, f + "top_logprobs", min=0)
        if self.seed is not None:
            check_int(self.seed, f + "seed")
        check_bool(self.ignore_eos, f + "ignore_eos")
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, (list, tuple, set, frozenset)):
            raise TypeError(f"{f}stop_token_ids={self.stop_token_ids!r}: expected a list of token ids")
        set_(self, "stop_token_ids", tuple(check_int(t, f"{f}stop_token_ids[{i}]", min=0)
                                           for i, t in enumerate(self.stop_token_ids)))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)):
            raise TypeError(f"{f}stop={self.stop!r}: expected a string or a list of strings")
        set_(self, "stop", tuple(check_str(s, f"{f}stop[{i}]") for i, s in enumerate(stop)))
        if self.temperature < 0:
            raise ValueError(f"{f}temperature={self.temperature}: must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"{f}top_p={self.top_p}: must be in (0, 1]")
        if self.top_k == 0:
            raise ValueError(f"{f}top_k={self.top_k}: must be -1 (off) or >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"{f}min_p={self.min_p}: must be in [0, 1]")
        check_int(self.priority, f + "priority")
        if self.deadline_s is not None:
            set_(self, "deadline_s", check_float(self.deadline_s, f + "deadline_s"))
            if self.deadline_s <= 0:
                raise ValueError(f"{f}deadline_s={self.deadline_s}: must be > 0 (seconds after the request is accepted)")
        if self.logprobs_mode not in _LOGPROB_MODES:
            raise ValueError(f"{f}logprobs_mode={self.logprobs_mode!r}: expected one of {_LOGPROB_MODES}")
        set_(self, "json_schema", constraint_fields(self.json_schema, self.regex, self.grammar))

    @property
    def constraint(self) -> GrammarSpec | None:
        return spec_of(self.json_schema, self.regex, self.grammar)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class AdapterKey:
    """The radix namespace of requests run under an adapter."""

    namespace: str | None
    lora_name: str
    version: int


def derive_seed(seed: int, sample_index: int) -> int:
    """Seed of sample i of n: a hash, so that samples of one prompt are independent and
    the same (seed, i) always gives the same stream whatever else is batched."""
    digest = hashlib.blake2b(f"{seed}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


@dataclass(eq=False)  # identity: the queues look requests up with `in` / remove()
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # this sample's own seed (derived from params.seed and sample_index)
    prompt_index: int = 0
    sample_index: int = 0
    namespace: str | None = None  # the caller's radix-cache namespace (None: shared)
    # LoRA: the adapter this request runs under (None: the base model), its version (the
    # engine bumps it on the waiting requests of an updated adapter) and, while running,
    # the device slot its weights sit in.
    lora_name: str | None = None
    lora_version: int = 0
    lora_slot: int = -1
    arrival: int = 0  # admission order; retraction takes the newest first (of the lowest priority)
    deadline: float | None = None  # time.monotonic() past which it ends ("deadline"); set when queued

    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # (weight_version, first output index, end output index) for each run of tokens
    version_spans: list[tuple[int, int, int]] = field(default_factory=list)
    lora_version_spans: list[tuple[int, int, int]] = field(default_factory=list)  # the same for the adapter
    finish_reason: str | None = None

    # KV bookkeeping, by counters: tokens [0, num_computed_tokens) of all_ids have KV.
    num_computed_tokens: int = 0
    num_prefix_tokens: int = 0  # leading slots owned by the radix tree (locked via last_node)
    # Prompt tokens served from the prefix cache (or a fork) on first admission; None until
    # then, which is also how the engine knows a request's first admission.
    num_cached_tokens: int | None = None
    num_allocated_slots: int = 0
    # Overlap scheduling: tokens sampled on the device whose values the host reads one step
    # later; the scheduler counts them (seq_len) and the runner feeds them from the device.
    num_inflight: int = 0
    req_pool_idx: int | None = None
    last_node: TreeNode | None = None

    # Speculative decoding: tokens proposed for this step (verified by the target, then
    # cleared), and this request's current draft length (adapted to its acceptance).
    draft_tokens: list[int] = field(default_factory=list)
    # a draft tree (speculative/tree.py): each draft's parent among the drafts, -1 for a child of
    # the last known token, parents first; None: the drafts are a chain
    draft_parents: list[int] | None = None
    spec_k: int = -1  # -1: not started (the engine's num_speculative_tokens)
    spec_pause: int = 0  # steps left before drafting again (after drafts kept failing)

    # n > 1: siblings wait for the first sample (the leader) to prefill the prompt,
    # then fork off its KV and its last-position logits instead of recomputing them.
    leader: Req | None = None
    followers: list[Req] = field(default_factory=list)

    # Structured output: this sample's matcher (None: unconstrained)
    grammar: GrammarState | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def cache_key(self) -> Hashable:
        """Radix-tree namespace: KV made under one adapter version is never served to
        another version, another adapter or the base model."""
        if self.lora_name is None:
            return self.namespace
        return AdapterKey(self.namespace, self.lora_name, self.lora_version)

    @property
    def seq_len(self) -> int:
        """Tokens in the sequence, counting sampled tokens the host has not read yet."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_inflight

    @property
    def known_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def clear_drafts(self) -> None:
        self.draft_tokens = []
        self.draft_parents = None

    def draft_depths(self) -> list[int]:
        """Each draft's depth below the last known token (1 for its children): its offset
        from the first drafted position. A chain's drafts sit at 1..k."""
        if self.draft_parents is None:
            return list(range(1, len(self.draft_tokens) + 1))
        return tree_depths(self.draft_parents)

    def append_token(self, token: int, logprob: float, top: list[tuple[int, float]] | None, version: int) -> None:
        idx = len(self.output_ids)
        self.output_ids.append(token)
        self.logprobs.append(logprob)
        if top is not None:
            self.top_logprobs.append(top)
        _extend_spans(self.version_spans, version, idx)
        if self.lora_name is not None:
            _extend_spans(self.lora_version_spans, self.lora_version, idx)


def tree_depths(parents: list[int]) -> list[int]:
    """Each node's depth in a draft tree given its parents (parents first; -1: the root's
    child, depth 1)."""
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def _extend_spans(spans: list[tuple[int, int, int]], version: int, idx: int) -> None:
    """Record that output token idx came from `version`: runs of one version are one span."""
    if spans and spans[-1][0] == version and spans[-1][2] == idx:
        spans[-1] = (version, spans[-1][1], idx + 1)
    else:
        spans.append((version, idx, idx + 1))


@dataclass
class RolloutOutput:
    request_id: str
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort" | "deadline"
    text: str | None
    num_cached_tokens: int
    weight_version: int  # the version that produced the last token (or current, if none)
    weight_versions: list[tuple[int, int, int]]  # (version, start, end) spans over token_ids
    top_logprobs: list[list[tuple[int, float]]] | None = None
    lora_name: str | None = None  # the adapter that made the tokens (None: the base model)
    lora_versions: list[tuple[int, int, int]] | None = None  # (adapter version, start, end) spans

    @classmethod
    def from_req(cls, req: Req, text: str | None, current_version: int) -> RolloutOutput:
        return cls(
            request_id=req.rid,
            prompt_index=req.prompt_index,
            sample_index=req.sample_index,
            prompt_ids=list(req.prompt_ids),
            token_ids=list(req.output_ids),
            logprobs=list(req.logprobs),
            finish_reason=req.finish_reason or "abort",
            text=text,
            num_cached_tokens=req.num_cached_tokens or 0,
            weight_version=req.version_spans[-1][0] if req.version_spans else current_version,
            weight_versions=list(req.version_spans),
            top_logprobs=list(req.top_logprobs) if req.params.top_logprobs else None,
            lora_name=req.lora_name,
            lora_versions=list(req.lora_version_spans) if req.lora_name is not None else None,
        )
