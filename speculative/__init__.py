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
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from speculative.governor import SpeedGovernor

if TYPE_CHECKING:
    from rollout.config import EngineConfig
    from speculative.base import Drafter
    from speculative.draft_runner import DraftRunner


def make_drafter(config: EngineConfig, context_len: int, draft: DraftRunner | None = None) -> Drafter | None:
    if config.speculative is None:
        return None
    drafter: Drafter
    if config.speculative == "draft":
        from speculative.draft_model import DraftModelDrafter

        assert draft is not None, "build_parts makes the draft runner"
        drafter = DraftModelDrafter(draft, config.num_speculative_tokens, context_len, config.max_prefill_tokens,
                                    follow_updates=config.speculative_draft_sync)
    elif config.speculative == "ngram":
        from speculative.ngram import NgramDrafter

        drafter = NgramDrafter(config.num_speculative_tokens, context_len)
    else:
        from speculative.suffix import SuffixDrafter

        drafter = SuffixDrafter(config.num_speculative_tokens, context_len, config.speculative_history_tokens,
                                keep_on_update=config.speculative_keep_history_on_update,
                                cross_prompt=config.speculative_cross_prompt)
    drafter.tree_nodes = config.speculative_tree_nodes
    if not config.speculative_governor:
        drafter.governor = None
    elif config.overlap_plain:  # steps that do not draft are overlapped: probe in blocks
        drafter.governor = SpeedGovernor(blocks=True)
    return drafter
