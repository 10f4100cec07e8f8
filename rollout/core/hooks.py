"""The step loop's extension points: what speculative decoding and structured output do in a
step, as typed hooks whose base classes are the null implementations (the feature off). The
loop (step.py) calls every hook every step without asking whether a feature is on; a feature
implements its hook outside the core (speculative/speculator.py, rollout/structured/
service.py) and core/build.py, the composition root, plugs it in.

- `Speculation`: drafts before the schedule, whether the step overlaps, the scheduler's
  verify budget, the step's sampling rows, what finished, how the step went.
- `StepRows`: a step's sampling rows. PLAIN_ROWS is one row per request; a verify step's
  rows (speculative/verify.py) are each request's last token and its drafts, and their read
  back walks the drafts the draws accept.
- `Grammar`: which steps sample under grammars, their masks, each token's advance.
- `Launched`: a step whose sampled tokens are still on the device, what `StepRows` reads
  back (the loop makes it; it sits here, with the hooks that read it).

Knows the step's data (requests, scheduled batches, packed sampling rows); knows nothing of
drafters, governors, draft trees or grammar matchers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from rollout.batch import ScheduledBatch
    from rollout.request import Req, RolloutOutput
    from rollout.structured.bitmask import TokenMask


@dataclass
class Launched:
    """A step whose sampled tokens are still on the device (or just copied back)."""

    reqs: list[Req]
    packed: torch.Tensor | None  # [rows, 3 + 4k] float64: token, raw lp, processed lp, top-k
    event: torch.cuda.Event | None  # set when the copy to pinned host memory is done
    top_k: int
    version: int  # weight version that produced these tokens
    rows: StepRows
    constrained: bool


class TokenSink(Protocol):
    """The loop's side of a read back (StepLoop): a sampled row's token into its request, and
    a finished request out of the engine."""

    def emit(self, req: Req, row: list[float], top_k: int, version: int, constrained: bool) -> bool:
        """Append the row's token (and its log-probs) to `req`; True when that ends it."""
        ...

    def finish(self, req: Req, version: int) -> RolloutOutput:
        """A request that just finished leaves the queues; its output."""
        ...


class StepRows:
    """A step's sampling rows: which request each row draws for, at which position, and how
    their tokens come back. This base (PLAIN_ROWS) is the plain layout: one row per request,
    drawing its next token."""

    def sampling(self, reqs: list[Req]) -> tuple[list[Req], list[int] | None]:
        """Each row's request, and each row's position past its request's next one (None: 0)."""
        return reqs, None

    def drafts(self, reqs: list[Req]) -> list[list[int]]:
        """Each request's drafts (its rows are 1 + their number): the grammar masks them too."""
        return [[]] * len(reqs)

    def read_back(self, launched: Launched, rows: list[list[float]], sink: TokenSink) -> list[RolloutOutput]:
        """Each request's token (rows: the packed host copy, one list per row); returns the
        outputs of the requests that finished."""
        finished = []
        top_k, version, constrained = launched.top_k, launched.version, launched.constrained
        for req, row in zip(launched.reqs, rows):
            req.num_inflight -= 1
            if req.finished:
                continue  # finished or aborted while this token was in flight: dropped
            sink.emit(req, row, top_k, version, constrained)
            if req.finished:
                finished.append(sink.finish(req, version))
        return finished


PLAIN_ROWS = StepRows()


class Speculation:
    """Speculative decoding's part in a step, in the order the loop calls it. This base is the
    null hook (NO_SPECULATION): nothing is drafted, and every step is a plain one that
    overlaps as the loop's `overlap` says."""

    # ---- the step loop ------------------------------------------------------------------
    def drain_for_drafts(self, running: list[Req], overlap: bool,
                         drain: Callable[[], list[RolloutOutput]]) -> Sequence[RolloutOutput]:
        """A step is in flight: if this step's drafts would continue its tokens, read it back
        first (`drain`) and return its outputs. `overlap`: whether plain steps overlap."""
        return ()

    def propose(self, running: list[Req], overlap: bool) -> bool:
        """Set this step's drafts on the running requests (Req.draft_tokens, draft_parents);
        returns whether the step overlaps (`overlap`: whether a plain step does)."""
        return overlap

    def scheduled(self, batch: ScheduledBatch) -> None:
        """The step's batch, before the runner lays it out."""

    def rows(self, reqs: list[Req]) -> StepRows:
        """The sampling rows of the requests that sample this step (after the forward)."""
        return PLAIN_ROWS

    def finished(self, req: Req) -> None:
        """A request finished (its tokens may draft for requests after it)."""

    def end_step(self) -> None:
        """A step with a batch is done: its tokens read back (with overlap, the step before's)."""

    # ---- the scheduler ------------------------------------------------------------------
    def verify_tokens(self, req: Req, need: int, budget: int) -> int:
        """How many tokens a request with drafts computes this step: its last token and all
        its drafts, or (short of the step's `budget` or of KV) `need`, its drafts dropped."""
        return need

    # ---- the engine ---------------------------------------------------------------------
    draft_weight_version: int | None = None  # a draft model's last synced version (None: none)
    draft_stale: bool = False  # drafting waits for the draft model's sync

    def policy_changed(self, lora_name: str | None = None) -> None:
        """The target's weights changed, or (lora_name) one adapter's."""

    def draft_updated(self, version: int) -> None:
        """The draft model's weights were synced at weight version `version`."""

    def release(self) -> None:
        """The engine sleeps: drop every device resource tied to requests."""

    def wake(self) -> None:
        """The engine woke: rebuild what `release` dropped (attention backend, graphs)."""


NO_SPECULATION = Speculation()


class Grammar:
    """Structured output's part in a step. This base is the null hook (NO_GRAMMAR): no
    request samples under a grammar."""

    def constrained(self, reqs: list[Req]) -> bool:
        """Does any of these requests sample under a grammar? (Its mask needs every token
        before it: with overlap, the step in flight is read back before this one samples.)"""
        return False

    def mask(self, reqs: list[Req], drafts: list[list[int]], device: torch.device) -> TokenMask | None:
        """The masks of a constrained step's rows (`drafts`: each request's, StepRows.drafts)."""
        return None

    def accept(self, req: Req, token: int) -> bool:
        """Advance a request's grammar by its new token; True when the grammar is complete."""
        return False

    def wait_for_compiles(self, waiting: Sequence[Req]) -> None:
        """Nothing ran while requests wait: if it is for their grammars, wait a little."""


NO_GRAMMAR = Grammar()
