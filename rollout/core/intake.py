"""Request intake: what a caller hands `generate` / `add_request`, checked and turned into
Reqs. Everything is validated before anything is queued, so a bad prompt raises (naming
the prompt index and the field) and leaves the requests already accepted untouched.

Knows the model's limits (vocabulary, context, KV budget) and the tokenizer; does not
know the scheduler beyond asking whether a request id is taken.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from rollout.request import Req, SamplingParams, derive_seed
from rollout.validate import check_int, check_str, token_ids

if TYPE_CHECKING:
    from rollout.structured.spec import GrammarSpec


class Versioned(Protocol):
    """A loaded adapter as intake sees it (lora/manager.py AdapterEntry)."""

    @property
    def version(self) -> int: ...


class LoadedAdapters(Protocol):
    """What intake asks of the adapter manager (lora/manager.py LoraManager): the loaded
    adapters by name, each with its version (a request records the one it starts under)."""

    @property
    def adapters(self) -> Mapping[str, Versioned]: ...


class GrammarStates(Protocol):
    """What intake asks of structured output (rollout/structured/service.py StructuredOutput):
    a matcher state for each of n samples; a ValueError for what it cannot serve."""

    def states(self, spec: GrammarSpec, n: int) -> list[Any]: ...


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    context_len: int
    kv_budget: int  # tokens one request may hold at most (the KV pool less a page)


class Intake:
    def __init__(self, limits: Limits, tokenizer, id_in_use: Callable[[str], bool], seed: int, fork_samples: bool,
                 lora: LoadedAdapters | None = None, structured: GrammarStates | None = None) -> None:
        self.limits = limits
        self.lora = lora
        self.structured = structured  # json_schema / regex / grammar requests (None: refused)
        self.fork_samples = fork_samples  # n > 1: samples fork the first one's prompt KV (needs the radix tree)
        self.tokenizer = tokenizer
        self._id_in_use = id_in_use
        self._next_id = 0
        self._seed_rng = torch.Generator().manual_seed(seed)

    def batch(self, input_ids: Any, prompts: Any, sampling_params: Any) -> list[tuple[list[int] | None, str | None, SamplingParams]]:
        return split_batch(input_ids, prompts, sampling_params)

    def lora_names(self, lora_name: Any, num_prompts: int) -> list[str | None]:
        return split_lora_names(lora_name, num_prompts)

    def _adapter_version(self, lora_name: Any, where: str) -> int:
        if not isinstance(lora_name, str):
            raise TypeError(f"{where}: lora_name={lora_name!r}: expected an adapter name (str) or None")
        if self.lora is None:
            raise ValueError(f"{where}: lora_name={lora_name!r} but LoRA is off (EngineConfig(enable_lora=True))")
        entry = self.lora.adapters.get(lora_name)
        if entry is None:
            raise ValueError(f"{where}: lora_name={lora_name!r} is not loaded (loaded: {sorted(self.lora.adapters)})")
        return entry.version

    def make_reqs(self, input_ids: Any, prompt: str | None, params: Any, request_id: Any, prompt_index: int,
                  namespace: Any, lora_name: Any = None) -> list[Req]:
        """One prompt's n samples as Reqs (not queued). Raises before anything changes."""
        where = f"prompt {prompt_index}"
        if not isinstance(params, SamplingParams):
            raise TypeError(f"{where}: sampling_params must be a SamplingParams, got {type(params).__name__}")
        if input_ids is None:
            if prompt is None:
                raise ValueError("a request needs input_ids or a prompt")
            if self.tokenizer is None:
                raise ValueError("prompt text given but the engine has no tokenizer; pass input_ids")
            input_ids = self.tokenizer.encode(prompt)
        ids = token_ids(input_ids, where)
        if not ids:
            raise ValueError(f"{where}: empty prompt (no tokens)")
        lim = self.limits
        bad = next((t for t in ids if not 0 <= t < lim.vocab_size), None)
        if bad is not None:
            raise ValueError(f"{where}: token id {bad} is outside the vocabulary [0, {lim.vocab_size})")
        bad = next((t for t in params.stop_token_ids if t >= lim.vocab_size), None)
        if bad is not None:
            raise ValueError(f"{where}: SamplingParams.stop_token_ids has {bad}, outside the vocabulary [0, {lim.vocab_size})")
        if params.top_logprobs > lim.vocab_size:
            raise ValueError(f"{where}: SamplingParams.top_logprobs={params.top_logprobs} exceeds the vocabulary size {lim.vocab_size}")
        total = len(ids) + params.max_new_tokens
        if total > lim.context_len:
            raise ValueError(f"{where}: {len(ids)} prompt tokens + max_new_tokens {params.max_new_tokens} = {total} "
                             f"exceeds the model's context length {lim.context_len}")
        if total > lim.kv_budget:
            raise ValueError(f"{where}: {len(ids)} prompt tokens + max_new_tokens {params.max_new_tokens} = {total} "
                             f"exceeds the whole KV budget of {lim.kv_budget} tokens (max_total_tokens)")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine has none (use stop_token_ids)")
        if namespace is not None and not isinstance(namespace, str):
            raise TypeError(f"namespace={namespace!r}: expected a str or None, got {type(namespace).__name__}")
        check_int(prompt_index, "prompt_index", min=0)
        lora_version = 0 if lora_name is None else self._adapter_version(lora_name, where)
        if request_id is None:
            base = f"req-{self._next_id}"
            self._next_id += 1
        else:
            base = check_str(request_id, "request_id")
        if self._id_in_use(base) or (params.n > 1 and self._id_in_use(f"{base}-0")):
            raise ValueError(f"request id {base!r} is already in use")
        grammars = self._grammar_states(params, where)
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        reqs = [
            Req(rid=base if params.n == 1 else f"{base}-{i}", prompt_ids=ids, params=params,
                seed=derive_seed(seed, i), prompt_index=prompt_index, sample_index=i, namespace=namespace,
                lora_name=lora_name, lora_version=lora_version, grammar=grammars[i] if grammars else None)
            for i in range(params.n)
        ]
        if len(reqs) > 1 and self.fork_samples:
            leader = reqs[0]
            leader.followers = reqs[1:]
            for follower in leader.followers:
                follower.leader = leader
        return reqs

    def _grammar_states(self, params: SamplingParams, where: str) -> list | None:
        """Each sample's matcher state (its grammar compiling in the background), or None."""
        spec = params.constraint
        if spec is None:
            return None
        if self.structured is None:
            raise ValueError(f"{where}: {spec.field}: this engine does not serve structured output")
        try:
            return self.structured.states(spec, params.n)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None


def split_batch(input_ids: Any, prompts: Any, sampling_params: Any) -> list[tuple[list[int] | None, str | None, SamplingParams]]:
    """generate()'s arguments -> one (token ids | None, text | None, params) per prompt: the shape
    checks every entry point shares (in-process, and the engine process's client before it sends)."""
    if (input_ids is None) == (prompts is None):
        raise ValueError("generate() takes exactly one of input_ids= or prompts=")
    if prompts is not None:
        if isinstance(prompts, str):
            raise TypeError("prompts: expected a list of strings, got one str (wrap it: prompts=[text])")
        items = list(prompts)
        for i, p in enumerate(items):
            check_str(p, f"prompts[{i}]", allow_empty=True)
    else:
        if isinstance(input_ids, (str, bytes)) or not hasattr(input_ids, "__len__"):
            raise TypeError(f"input_ids: expected a list of prompts (each a list of token ids), got {type(input_ids).__name__}")
        if isinstance(input_ids, torch.Tensor) and input_ids.ndim != 2:
            raise ValueError(f"input_ids: a tensor must be 2-D [num_prompts, len], got shape {tuple(input_ids.shape)}")
        items = list(input_ids)
        if items and all(isinstance(t, int) for t in items):
            raise TypeError("input_ids: expected a list of prompts, each a list of token ids, got a flat list of "
                            f"ints; for one prompt pass input_ids=[{items[:3]!r}...] wrapped in a list")
    if sampling_params is None:
        params_list = [SamplingParams()] * len(items)
    elif isinstance(sampling_params, SamplingParams):
        params_list = [sampling_params] * len(items)
    else:
        params_list = list(sampling_params)
        if len(params_list) != len(items):
            raise ValueError(f"sampling_params has {len(params_list)} entries for {len(items)} prompts")
    if prompts is not None:
        return [(None, p, sp) for p, sp in zip(items, params_list)]
    return [(ids, None, sp) for ids, sp in zip(items, params_list)]


def split_lora_names(lora_name: Any, num_prompts: int) -> list[str | None]:
    """generate()'s lora_name (one for all prompts, or a list with one per prompt)."""
    if isinstance(lora_name, (list, tuple)):
        if len(lora_name) != num_prompts:
            raise ValueError(f"lora_name has {len(lora_name)} entries for {num_prompts} prompts")
        return list(lora_name)
    return [lora_name] * num_prompts
