"""The engine process's operations, one row each: the request that names it on the wire
(requests.py), the Engine method it serves, how the engine process runs it, and what a
client's call returns.

From this table:
- the engine process dispatches (engine_process.py): a CALL row calls its Engine method on
  the loop with the request's fields as keywords; a BACKGROUND row makes the same call on a
  background thread (it waits on another party: background.py); a HANDLER row is the
  EngineOps method of the op's name (ops.py: text to tokenize, sessions to track, a wait
  split from its update);
- the engine process steps after a row that `finishes_requests` (a pause or an unload may
  finish requests between steps: their outputs wait in the engine for the next step);
- both clients read a reply through its row (`Op.result`): the result checked against
  `reply`, the type the Engine method returns;
- tests/server/test_op_table.py checks the rest: every public Engine method is a row's or
  is named in IN_PROCESS_ONLY with its reason; a CALL or BACKGROUND row's request fields
  are its Engine method's parameters, with the same defaults; both clients have a method
  for each row, with the Engine method's parameters (less ENGINE_ONLY_ARGS) plus timeout=
  (and wait= in the blocking client where the answer waits on a trainer).

Serving a new Engine method: its request dataclass in requests.py (fields named and
defaulted as the method's parameters), its row here, and the one-line method in each
client (RolloutClient, AsyncRolloutClient); the table test names whatever is missing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lora.manager import LoraAdapterInfo
from rollout.core.memory import SleepStats
from rollout.metrics import EngineStats
from rollout.server import codec, protocol
from rollout.server.errors import ProtocolError

CALL, BACKGROUND, HANDLER = "call", "background", "handler"


@dataclass(frozen=True)
class Op:
    request: type[protocol.Request]
    engine: str | None  # the public Engine method it serves; None: the engine process's own op
    reply: Any = None  # what the call returns (an annotation codec.check_value reads); None: nothing
    run: str = CALL
    finishes_requests: bool = False  # the engine process steps next, to hand their outputs out
    waits_on_trainer: bool = False  # answered once a trainer sends (the blocking client's wait=False)
    read: Callable[[protocol.Reply], Any] | None = None  # a reply that is more than a checked result
    internal: bool = False  # sent by the clients themselves, not a method of theirs

    def __post_init__(self) -> None:
        if self.run not in (CALL, BACKGROUND, HANDLER):
            raise ValueError(f"{self.name}: run={self.run!r}")
        if self.run != HANDLER and self.engine is None:
            raise ValueError(f"{self.name}: only a HANDLER row serves no Engine method")

    @property
    def name(self) -> str:
        return self.request.op

    @property
    def method(self) -> str | None:
        """The clients' method for this op: the Engine method's name, or the op's own."""
        return None if self.internal else self.engine or self.name

    def engine_kwargs(self, request: Any) -> dict[str, Any]:
        """A CALL or BACKGROUND row's Engine call: the request's fields, by name."""
        return {f.name: getattr(request, f.name) for f in dataclasses.fields(request)}

    def result(self, message: protocol.Reply) -> Any:
        """The reply as the Engine method would have returned it, checked field by field."""
        if self.read is not None:
            return self.read(message)
        try:
            return codec.check_value(message.result, type(None) if self.reply is None else self.reply, self.name)
        except (KeyError, TypeError) as error:
            raise ProtocolError(f"{self.name}: malformed result ({error})") from None


def _outputs(message: protocol.Reply) -> Any:
    if message.outputs is None:
        raise ProtocolError("generate: the reply carries no outputs")
    return message.outputs


def _ids(op: str, key: str, convert: Callable[[list[str]], Any] = list) -> Callable[[protocol.Reply], Any]:
    """A result of the form {key: [request id, ...]}."""
    def read(message: protocol.Reply) -> Any:
        raw = codec.check_value(message.result, dict[str, Any], op)
        if key not in raw:
            raise ProtocolError(f"{op}: malformed result (no {key!r})")
        return convert(codec.check_value(raw[key], list[str], key))
    return read


OPS: dict[str, Op] = {op.name: op for op in (
    # the engine process's own
    Op(protocol.Hello, None, protocol.ServerInfo, HANDLER, internal=True),  # the clients' connect
    Op(protocol.Cancel, None, None, HANDLER, read=_ids("cancel", "aborted"), internal=True),  # a call given up on
    Op(protocol.GetModelInfo, None, protocol.ModelInfo, HANDLER),
    Op(protocol.Health, None, protocol.HealthInfo, HANDLER),
    Op(protocol.Shutdown, None, None, HANDLER),
    # requests
    Op(protocol.Generate, "generate", run=HANDLER, read=_outputs),
    Op(protocol.Add, "add_request", run=HANDLER, read=_ids("add", "request_ids")),  # (and the clients' stream)
    Op(protocol.Abort, "abort", run=HANDLER, read=_ids("abort", "aborted", bool)),
    # weights
    Op(protocol.UpdateWeights, "update_weights", int, finishes_requests=True),
    Op(protocol.UpdateWeightsFromDisk, "update_weights_from_disk", int, finishes_requests=True),
    Op(protocol.UpdateWeightsFromIpc, "update_weights_from_ipc", int, HANDLER, waits_on_trainer=True),
    Op(protocol.InitWeightSyncGroup, "init_weight_sync_group", None, BACKGROUND, waits_on_trainer=True),
    Op(protocol.UpdateWeightsFromDistributed, "update_weights_from_distributed", int, HANDLER,
       finishes_requests=True, waits_on_trainer=True),
    Op(protocol.DestroyWeightSyncGroup, "destroy_weight_sync_group", None, HANDLER),
    # LoRA adapters
    Op(protocol.LoadLoraAdapter, "load_lora_adapter", LoraAdapterInfo),
    Op(protocol.ListLoraAdapters, "list_lora_adapters", list[LoraAdapterInfo]),
    Op(protocol.UpdateLoraAdapter, "update_lora_adapter", int, finishes_requests=True),
    Op(protocol.UpdateLoraAdapters, "update_lora_adapters", dict[str, int], HANDLER, finishes_requests=True),
    Op(protocol.UnloadLoraAdapter, "unload_lora_adapter", None, finishes_requests=True),
    # memory and introspection
    Op(protocol.Sleep, "sleep", SleepStats, finishes_requests=True),
    Op(protocol.Wake, "wake", SleepStats, HANDLER, finishes_requests=True),
    Op(protocol.Stats, "stats", EngineStats),
    Op(protocol.FlushCache, "flush_cache", None),
    # pausing generation ("abort" finishes requests: the next step hands their outputs out)
    Op(protocol.PauseGeneration, "pause_generation", None, finishes_requests=True),
    Op(protocol.ContinueGeneration, "continue_generation", None),
)}

# Public Engine methods the engine process does not serve, and why.
IN_PROCESS_ONLY: dict[str, str] = {
    "step": "the engine process runs the step loop itself, between messages",
    "has_unfinished": "the engine process's loop asks it to decide whether to step; a client waits on "
                      "its own calls instead (generate, stream, get_outputs, poll_outputs)",
}

# Engine method parameters the clients do not send, and why.
ENGINE_ONLY_ARGS: dict[tuple[str, str], str] = {
    ("generate", "namespace"): "the engine process's clients share one prefix cache",
    ("add_request", "namespace"): "the engine process's clients share one prefix cache",
    ("generate", "progress"): "a progress line printed by the engine's own process",
    ("add_request", "prompt_index"): "the engine process numbers a client's prompts itself",
}
