"""Pausing requests while what made their KV changes (a weight update, an adapter update or
unload, sleep), or because the caller paused generation (Engine.pause_generation).

Three modes (`pause_mode`): "wait" runs the affected requests to completion first, "abort"
finishes them now as aborted, "retract" sends them back to waiting to resume afterwards.
Every caller replaces what made their KV (the weights, an adapter) or releases it (sleep),
so a retracted request's KV is dropped, not cached.

Outputs that finish here (a pause that aborts or waits, the step in flight read back) are
not returned to the caller of update_weights or sleep: they go to the Outbox, which the
engine's next step() hands out first, as if that step had finished them.

Knows the scheduler's queues and the step loop's step in flight; not what is being changed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollout.core.step import StepLoop
    from rollout.metrics import Counters
    from rollout.request import Req, RolloutOutput
    from rollout.scheduler import Scheduler


class Outbox:
    """Finished outputs not yet handed out: the next step() returns them first."""

    def __init__(self) -> None:
        self._outputs: list[RolloutOutput] = []

    def put(self, outputs: Iterable[RolloutOutput]) -> None:
        self._outputs.extend(outputs)

    def take(self) -> list[RolloutOutput]:
        outputs, self._outputs = self._outputs, []
        return outputs


class Pause:
    """`step` and `abort` are the engine's own (a "wait" pause steps as the engine does, with
    its sleep check and step timing; an "abort" one finishes requests as Engine.abort does);
    `can_step` says whether a step runs anything now (not while asleep or after sleep level 2
    discarded the weights)."""

    def __init__(self, scheduler: Scheduler, loop: StepLoop, counters: Counters, outbox: Outbox,
                 step: Callable[[], list[RolloutOutput]], abort: Callable[[str], RolloutOutput | None],
                 can_step: Callable[[], bool]) -> None:
        self.scheduler = scheduler
        self.loop = loop
        self.counters = counters
        self.outbox = outbox
        self.step = step
        self.abort = abort
        self.can_step = can_step

    def drain(self) -> None:
        """Read the step in flight back (overlap scheduling): its tokens land before anything
        that must see every token (a pause, an unload)."""
        self.outbox.put(self.loop.drain())

    def __call__(self, pause_mode: str, affected: Callable[[Req], bool] | None = None, *,
                 keep_kv: bool = False) -> None:
        """Stop the requests an update affects (all, or those `affected` selects) from running on.
        `keep_kv`: a "retract" caches their KV in the prefix tree (nothing that made it is
        changing: Engine.pause_generation) instead of dropping it."""
        self.drain()
        hit = affected or (lambda req: True)
        sched = self.scheduler
        if pause_mode == "wait" and not self.can_step():
            # Nothing can run to completion now, and nothing is running: sleep retracted every
            # request. Those waiting start under what the caller writes, as after "retract"
            # (stepping here would loop forever: a step runs nothing until wake / a full sync).
            pause_mode = "retract"
        if pause_mode == "wait":
            while self.loop.inflight is not None or any(hit(r) for r in (*sched.running, *sched.waiting)):
                self.outbox.put(self.step())  # step() hands the outbox out first: put all of it back
        elif pause_mode == "abort":
            for req in [r for r in (*sched.running, *sched.waiting) if hit(r)]:
                out = self.abort(req.rid)
                if out is not None:
                    self.outbox.put([out])
        else:
            self.counters.retractions += len(sched.retract_all(hit, keep_kv=keep_kv))
