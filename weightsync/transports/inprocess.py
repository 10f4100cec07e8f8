"""In-process transport: trainer and engine share one Python process.

No buckets here, on purpose. Bucketing exists to amortize the fixed cost of a transfer
(a collective launch, an IPC handle round trip) and to bound staging memory on the way;
in one address space there is no transfer. The engine's loader copies each tensor into
its own parameters anyway (fusing q/k/v and gate/up as it goes), so flattening first
would add one full extra copy of the model for nothing.

The catch is the engine's atomicity: it validates the whole stream before applying, so it
keeps a reference to every tensor until it applies. For a plain model those are the live
parameters (no extra memory); for FSDP each is a gathered full tensor, so the whole model
is materialized once on the way. Use a bucketed transport when that does not fit.

The engine must copy, never alias, what it receives: the trainer's optimizer keeps
updating these very tensors in place.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from weightsync.transports.base import SendStats, StreamCounter, SupportsUpdateWeights


class InProcessSender:
    """Hands the trainer's stream straight to `engine.update_weights`.

    `full=True` tells the engine this is the complete model (it may reject a stream that
    misses a parameter); pass False to push a subset.
    """

    def __init__(self, engine: SupportsUpdateWeights, *, full: bool = True) -> None:
        if not callable(getattr(engine, "update_weights", None)):
            raise TypeError(f"engine {type(engine).__name__} has no update_weights(named_tensors, *, full) method")
        self.engine = engine
        self.full = full

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SendStats:
        counter = StreamCounter()
        version = self.engine.update_weights(counter.wrap(named_tensors), full=self.full)
        return counter.stats(num_buckets=0, engine_version=version)
