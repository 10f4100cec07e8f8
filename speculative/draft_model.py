"""DraftModelDrafter: a small model sharing the target's tokenizer proposes k tokens, greedily.

Each running request has a draft sequence: the token ids whose KV the draft model holds and
their slots. Before a step, the draft catches up on the tokens the target emitted since
(the common prefix with what it drafted last time is kept; the rest is rolled back), which
gives it the first draft token, then decodes k - 1 more, one batched forward per position
for every request at once (CUDA graphs on the GPU).

The drafts are point masses (the draft model's argmax), so the target's verification,
which accepts a draft exactly when it equals the token the target draws there with that
position's noise, is rejection sampling for a deterministic proposal: acceptance is the
target's probability of the drafted token, and the output is plain decoding's, token for
token (speculative/__init__.py).

Staleness: a weight update of the target alone leaves the draft behind the policy. With
`speculative_draft_sync=True` (the default: the trainer syncs the draft too) drafting pauses
until the draft's own update arrives, visible in stats (draft_weight_version); with False
the draft is a fixed model and keeps drafting. A draft update drops every draft sequence:
its KV was made by the old draft weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rollout.cache.manager import KVManager
from rollout.metrics import Counters
from rollout.request import Req
from speculative.base import Drafter
from speculative.draft_runner import DraftRow, DraftRunner
from speculative.speculator import Speculator


@dataclass
class DraftSeq:
    tokens: list[int] = field(default_factory=list)  # ids whose KV the draft holds, by position
    slots: list[int] = field(default_factory=list)
    verified: int = 0  # tokens[:verified] are known to equal the request's tokens


class DraftModelDrafter(Drafter):
    looks = False  # a look for drafts would be a draft-model forward between steps

    def __init__(self, runner: DraftRunner, max_tokens: int, context_len: int, max_prefill_tokens: int,
                 follow_updates: bool) -> None:
        super().__init__(max_tokens, min(context_len, runner.context_len))
        self.runner = runner
        self.max_prefill_tokens = max_prefill_tokens
        self.follow_updates = follow_updates
        self.seqs: dict[Req, DraftSeq] = {}
        self.stale = False  # the target moved on without the draft (follow_updates only)
        self.weight_version = 0  # the engine's weight version the draft was last synced at
        self.forwards = 0  # draft forward passes (benchmarks: cost per step)

    # ---- lifecycle --------------------------------------------------------------------
    def begin_step(self, running: list[Req]) -> None:
        live = set(running)
        for req in [r for r in self.seqs if r not in live]:
            self._drop(req)  # finished, aborted or retracted

    def observe_finished(self, req: Req) -> None:
        self._drop(req)

    def on_weight_update(self) -> None:
        self.stale = self.follow_updates

    def on_draft_update(self, version: int) -> None:
        for req in list(self.seqs):
            self._drop(req)
        self.stale, self.weight_version = False, version

    def release(self) -> None:
        for req in list(self.seqs):
            self._drop(req)
        self.runner.detach()

    def _drop(self, req: Req) -> None:
        seq = self.seqs.pop(req, None)
        if seq is not None:
            self.runner.free(seq.slots)

    def propose(self, req: Req, k: int) -> list[int]:
        return self.propose_batch([(req, k)])[0]

    # ---- drafting ---------------------------------------------------------------------
    def propose_batch(self, wanted: list[tuple[Req, int]]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in wanted]
        if self.stale or not wanted:
            return drafts
        rows: list[tuple[int, DraftRow, DraftSeq]] = []  # (index in wanted, row, seq)
        budget = self.max_prefill_tokens
        for i, (req, k) in enumerate(wanted):
            ids = req.all_ids
            seq = self.seqs.setdefault(req, DraftSeq())
            keep = self._roll_back(seq, ids)
            n = min(len(ids) - keep, max(budget, 1))
            complete = keep + n == len(ids)
            # slots for the catch-up tokens and, when it completes, the k - 1 drafts fed back
            slots = self.runner.alloc(n + (k - 1 if complete else 0))
            if slots is None:
                self._drop(req)  # short of draft KV: this request drafts nothing this step
                continue
            seq.slots.extend(slots)
            seq.tokens.extend(ids[keep : keep + n])
            seq.verified = keep + n
            if n > 1:
                budget -= n
            rows.append((i, DraftRow(ids[keep : keep + n], keep, seq.slots, complete), seq))
        rows.sort(key=lambda r: not (len(r[1].tokens) == 1 and r[1].wants_logits))  # decodes first
        if not rows:
            return drafts
        # the catch-up forward: each complete row's last token proposes its first draft
        first = self.runner.propose([row for _, row, _ in rows])
        self.forwards += 1
        active = []  # (index in wanted, seq, position of the first draft)
        for i, row, seq in rows:
            if row.wants_logits:
                active.append((i, seq, row.start + len(row.tokens)))
            else:  # a long prompt still catching up (over this step's budget): no drafts yet
                self._trim(seq, seq.verified)
        # k - 1 decode forwards, each draft fed back from the device: one host sync at the end
        rounds = [(list(range(len(active))), first)]  # (rows of `active`, their drafts on the device)
        for j in range(1, max((wanted[i][1] for i, _, _ in active), default=1)):
            prev_rows, prev = rounds[-1]
            step = [a for a in prev_rows if wanted[active[a][0]][1] > j]
            if not step:
                break
            fed = prev if len(step) == len(prev_rows) else prev[torch.tensor(
                [prev_rows.index(a) for a in step], dtype=torch.int64, device=prev.device)]
            batch = [DraftRow([0], active[a][2] + j - 1, active[a][1].slots, True) for a in step]
            rounds.append((step, self.runner.propose(batch, fed=fed)))
            self.forwards += 1
        values = torch.cat([t for _, t in rounds]).tolist()
        at = 0
        for step, tokens in rounds:
            for a, token in zip(step, values[at : at + len(step)]):
                drafts[active[a][0]].append(token)
            at += len(step)
        for i, seq, _ in active:  # the drafts fed back hold KV now; slots past them go back
            seq.tokens.extend(drafts[i][: wanted[i][1] - 1])
            self._trim(seq, len(seq.tokens))
        return drafts

    def _roll_back(self, seq: DraftSeq, ids: list[int]) -> int:
        """Keep the longest prefix of the draft's tokens the request still has (always
        leaving the last token to be fed: its logits propose the first draft)."""
        keep = min(seq.verified, len(ids))
        limit = min(len(seq.tokens), len(ids))
        while keep < limit and seq.tokens[keep] == ids[keep]:
            keep += 1
        keep = min(keep, len(ids) - 1)
        self._trim(seq, keep)
        return keep

    def _trim(self, seq: DraftSeq, n: int) -> None:
        self.runner.free(seq.slots[n:])
        del seq.slots[n:], seq.tokens[n:]
        seq.verified = min(seq.verified, n)


class DraftModelSpeculator(Speculator):
    """The Speculator of a draft model: the engine syncs the draft's weights, and its backend
    and graphs sleep and wake with the target's (`attach`: build.attach_backend for the draft)."""

    drafter: DraftModelDrafter

    def __init__(self, drafter: DraftModelDrafter, attach: Callable[[], None], kv: KVManager | None = None,
                 counters: Counters | None = None) -> None:
        super().__init__(drafter, kv, counters)
        self.attach = attach

    @property
    def draft_weight_version(self) -> int | None:  # type: ignore[override]
        return self.drafter.weight_version

    @property
    def draft_stale(self) -> bool:  # type: ignore[override]
        return self.drafter.stale

    def draft_updated(self, version: int) -> None:
        self.drafter.on_draft_update(version)

    def wake(self) -> None:
        self.attach()
