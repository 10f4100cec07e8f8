"""Speculative decoding for rollouts: drafters propose tokens, the engine verifies them.

A drafter proposes up to k tokens per running request each step (`base.Drafter`); the engine
computes the last token and the drafts in one forward and samples every position with that
position's own seeded noise, so the run it emits (the drafts that match what it drew, then
the first token that does not) is exactly what plain decoding would have drawn: the output
distribution, the tokens for a given seed and the log-probs are the target model's.

- `ngram.NgramDrafter`: prompt lookup in the request's own tokens.
- `suffix.SuffixDrafter`: suffix matches in the request, its running siblings (the other
  samples of its prompt) and earlier rollouts of the same prompt (a bounded history:
  groups.py), all counted in one continuation index per prompt (index.py); where those never
  continued the context, other prompts' earlier rollouts (one shared index per namespace).
- `draft_model.DraftModelDrafter`: a small model sharing the tokenizer, with its own KV pool
  and decode graphs (draft_runner.py), synced by the same weight-update calls.

The two history drafters draft a sampled request with the sampler's own noise (noise.py, a
host twin of rollout.sampling.uniform_noise) raced over the continuation counts, so a draft
from samples of the target's distribution is the target's own draw as often as those counts
allow (choice.py); greedy requests follow the latest continuation. `governor.py` keeps
drafting on only while it beats plain decoding (on CUDA plain decoding overlaps its steps
while drafting is off, as without speculation).

The engine's step loop sees none of this: `speculator.Speculator` implements its speculation
hook (rollout/core/hooks.py), and rollout/core/build.py plugs it in (`make_speculator`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from speculative.governor import SpeedGovernor

if TYPE_CHECKING:
    from rollout.cache.manager import KVManager
    from rollout.config import EngineConfig
    from rollout.metrics import Counters
    from speculative.base import Drafter
    from speculative.draft_runner import DraftRunner
    from speculative.speculator import Speculator


def make_drafter(config: EngineConfig, context_len: int, draft: DraftRunner | None = None) -> Drafter:
    """The drafter EngineConfig.speculative names (not None)."""
    assert config.speculative is not None
    if config.speculative == "draft":
        from speculative.draft_model import DraftModelDrafter

        assert draft is not None, "build_parts makes the draft runner"
        return DraftModelDrafter(draft, config.num_speculative_tokens, context_len, config.max_prefill_tokens,
                                 follow_updates=config.speculative_draft_sync)
    if config.speculative == "ngram":
        from speculative.ngram import NgramDrafter

        return NgramDrafter(config.num_speculative_tokens, context_len)
    from speculative.suffix import SuffixDrafter

    return SuffixDrafter(config.num_speculative_tokens, context_len, config.speculative_history_tokens,
                         keep_on_update=config.speculative_keep_history_on_update,
                         cross_prompt=config.speculative_cross_prompt)


def make_speculator(config: EngineConfig, context_len: int, kv: KVManager, counters: Counters,
                    tree_rows: Callable[[], int], draft: DraftRunner | None = None,
                    attach_draft: Callable[[], None] | None = None) -> Speculator:
    """The engine's speculation hook for EngineConfig.speculative (not None). `tree_rows`: the
    rows a verify step of draft trees may have (ModelRunner.tree_rows_max); `attach_draft`:
    the draft model's backend and graphs, again on wake (speculative="draft")."""
    from speculative.speculator import Speculator

    drafter = make_drafter(config, context_len, draft)
    spec: Speculator
    if draft is not None:
        from speculative.draft_model import DraftModelDrafter, DraftModelSpeculator

        assert isinstance(drafter, DraftModelDrafter) and attach_draft is not None
        spec = DraftModelSpeculator(drafter, attach_draft, kv, counters)
    else:
        spec = Speculator(drafter, kv, counters)
    spec.tree_nodes = config.speculative_tree_nodes
    spec.tree_rows = tree_rows  # (graphs come and go with sleep)
    if not config.speculative_governor:
        spec.governor = None
    elif config.overlap_plain:  # steps that do not draft are overlapped: probe in blocks
        spec.governor = SpeedGovernor(blocks=True)
    return spec
