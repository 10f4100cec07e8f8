"""What RolloutClient and AsyncRolloutClient share: turning the Engine's call signatures
into protocol requests (checked here first, so a bad argument fails before it is sent),
replies back into the Engine's return types, the socket's options, and the errors.

How a client knows the engine is gone: its zmq socket is monitored, and a closed
connection (the engine process exited or was killed: the kernel closes its sockets at
once) or zmq heartbeats unanswered for heartbeat_timeout_s (a hung or stopped process)
make every waiting call and every later one raise EngineDeadError. A live engine that is
slow to answer raises EngineTimeoutError after the call's timeout instead.

How a client's sockets end: see ClientSockets (close(), or a finalizer when the client is
dropped, collected in a reference cycle, or left at interpreter exit; the finalizer is
weightsync.transports.zmq_lifetime's, shared with the CUDA IPC sender).
"""

from __future__ import annotations

import dataclasses
import enum
import os
import shutil
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import zmq

from lora.flat import FlatLoraAdapter
from rollout.core.intake import split_batch, split_lora_names
from rollout.request import RolloutOutput, SamplingParams
from rollout.server import protocol
from rollout.server.errors import EngineDeadError, EngineError, EngineTimeoutError, ProtocolError
from rollout.server.optable import OPS
from rollout.validate import check_str, named_tensor_list, token_ids
from weightsync.transports.zmq_lifetime import ZmqSockets

DEFAULT_TIMEOUT_S = 600.0  # one call (or, for a stream, the wait for its next delta)
DEFAULT_CONNECT_TIMEOUT_S = 60.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0
# The engine's errors that mean "your argument is wrong" (a missing adapter or checkpoint
# directory included): raised as the same type, as in-process.
_SAME_TYPE = {"ValueError": ValueError, "TypeError": TypeError, "ProtocolError": ProtocolError,
              "FileNotFoundError": FileNotFoundError}


def new_identity() -> bytes:
    return b"c" + os.urandom(15)  # zmq reserves ids starting with a zero byte for its own


def configure_socket(socket: zmq.Socket, address: str, heartbeat_timeout_s: float) -> bytes:
    if not isinstance(address, str) or not address.startswith(("ipc://", "tcp://")):
        raise ValueError(f"address {address!r}: expected ipc:///path or tcp://HOST:PORT")
    identity = new_identity()
    socket.setsockopt(zmq.ROUTING_ID, identity)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVHWM, 0)  # outputs are never dropped on our side either
    timeout_ms = max(int(heartbeat_timeout_s * 1000), 10)
    socket.setsockopt(zmq.HEARTBEAT_IVL, max(10, min(1000, timeout_ms // 4)))
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
    socket.setsockopt(zmq.HEARTBEAT_TTL, timeout_ms)
    socket.setsockopt(zmq.SNDTIMEO, timeout_ms)
    if address.startswith("tcp://["):
        socket.setsockopt(zmq.IPV6, 1)
    return identity


# A client's context and sockets, closed once (linger 0) and the context ended: by the client's
# close(), or by a finalizer when the client is dropped without it, collected in a reference
# cycle, or left at interpreter exit (zmq_lifetime.py says why a finalizer, issue 49). The sync
# client passes its lock: the finalizer closes under it. Run first in a cycle's garbage, it
# leaves a stream's `finally` to find the socket closed, and its cancel is skipped quietly.
# The poller and the monitor socket hold no client: the poller is a list of sockets, the
# monitor one more socket of the context, closed with the others.
ClientSockets = ZmqSockets


def stop_on_collect(owner: object, process: Any) -> weakref.finalize:
    """A launched engine process (launch.EngineProcess) belongs to its client: dropped without
    close(), or left at interpreter exit, the client asks it to stop (SIGTERM: the engine
    process shuts down as on a shutdown request) instead of leaving it running and holding
    its device. Nothing waits here: a collection or the exit must not block on a child."""
    return weakref.finalize(owner, _terminate, process)


def _terminate(process: Any) -> None:
    if process.exit_code() is None:
        try:
            process.process.terminate()
        except OSError:
            pass  # exited in between
    if process.tmpdir is not None:  # its ipc socket's directory; an engine still exiting minds no more
        shutil.rmtree(process.tmpdir, ignore_errors=True)
        process.tmpdir = None


# CONNECTED: a connection was made at least once (a call that times out before that found
# nothing listening, not a busy engine); DISCONNECTED: the engine is gone.
MONITOR_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


def dead_message(address: str, heartbeat_timeout_s: float) -> str:
    return (f"the engine at {address} is gone: its connection closed (the process exited or was killed, "
            f"or it answered no heartbeat for {heartbeat_timeout_s}s)")


def dead_error(reason: str, what: str, timeout: float | None) -> EngineDeadError:
    limit = f" (call timeout {timeout}s)" if timeout is not None else ""
    return EngineDeadError(f"{what}: {reason}{limit}")


def timeout_error(address: str, what: str, timeout: float, connected: bool = True) -> Exception:
    if not connected:
        return EngineDeadError(f"{what}: no engine is listening at {address}: nothing accepted a connection within "
                               f"{timeout}s (not started, exited, or the wrong address)")
    return EngineTimeoutError(f"{what}: no answer from the engine at {address} within {timeout}s (its connection "
                              "is up: it is busy or stuck; pass a longer timeout= for long operations)")


def remote_error(message: protocol.ErrorReply) -> Exception:
    cls = _SAME_TYPE.get(message.error_type)
    return cls(message.message) if cls is not None else EngineError(message.error_type, message.message)


def stream_deltas(message: object, left: set[str]) -> list[protocol.StreamDelta]:
    """The deltas of one message of a stream (raising its error reply), crossing off the
    request ids whose last delta this is; the sync and asyncio clients read streams alike."""
    if isinstance(message, protocol.ErrorReply):
        raise remote_error(message)
    if not isinstance(message, protocol.Event):
        return []
    for delta in message.deltas:
        if delta.finished:
            left.discard(delta.request_id)
    return list(message.deltas)


def check_frames(frames: list, info: protocol.ServerInfo | None) -> None:
    """Refuse locally what the engine would refuse (or drop the connection for)."""
    if info is None:
        return
    header = len(frames[0])
    if header > info.max_header_bytes:
        raise ValueError(f"request header of {header} bytes exceeds the engine's {info.max_header_bytes}-byte cap "
                         "(--max-header-bytes)")
    for frame in frames[1:]:
        size = memoryview(frame).nbytes
        if size > info.max_tensor_bytes:
            raise ValueError(f"a tensor of {size} bytes exceeds the engine's {info.max_tensor_bytes}-byte cap "
                             "(--max-tensor-bytes; send large updates by disk, CUDA IPC or broadcast)")


# ---- arguments -> requests ---------------------------------------------------------------------
def generate_request(input_ids: Any, sampling_params: Any, prompts: Any, lora_name: Any) -> protocol.Generate:
    """Checked as in-process Engine.generate checks them (rollout/core/intake.py), with the
    same messages: a caller sees the same error from either."""
    items = split_batch(input_ids, prompts, sampling_params)
    texts = [text for _, text, _ in items] if prompts is not None else None
    ids = [_token_ids(row, f"prompt {i}") for i, (row, _, _) in enumerate(items)] if prompts is None else None
    params = [_check_params(sp, i) for i, (_, _, sp) in enumerate(items)]
    names = split_lora_names(lora_name, len(items))
    for i, name in enumerate(names):
        if name is not None and not isinstance(name, str):
            raise TypeError(f"prompt {i}: lora_name={name!r}: expected an adapter name (str) or None")
    return protocol.Generate(sampling_params=params, lora_names=names, input_ids=ids, prompts=texts)


def _token_ids(row: Any, where: str) -> list[int]:
    """rollout.validate.token_ids, with a fast path for the common case (a list of plain
    ints, taken as it is) so that a batch of long prompts costs one C-speed pass each."""
    if type(row) is list and all(type(t) is int for t in row):
        return row
    return token_ids(row, where)


def _check_params(params: Any, i: int) -> SamplingParams:
    if not isinstance(params, SamplingParams):
        raise TypeError(f"prompt {i}: sampling_params must be a SamplingParams, got {type(params).__name__}")
    return params


def add_request(input_ids: Any, sampling_params: Any, prompt: Any, request_id: Any, lora_name: Any,
                stream: bool) -> protocol.Add:
    """Checked as in-process Engine.add_request checks them, with the same messages; given
    both, input_ids wins (as in-process)."""
    if sampling_params is None:
        sampling_params = SamplingParams()
    if not isinstance(sampling_params, SamplingParams):
        raise TypeError(f"prompt 0: sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
    if input_ids is None and prompt is None:
        raise ValueError("a request needs input_ids or a prompt")
    if input_ids is not None:
        ids, prompt = _token_ids(input_ids, "prompt 0"), None
    else:
        ids = None
        check_str(prompt, "prompt", allow_empty=True)
    if lora_name is not None and not isinstance(lora_name, str):
        raise TypeError(f"prompt 0: lora_name={lora_name!r}: expected an adapter name (str) or None")
    return protocol.Add(sampling_params=sampling_params, input_ids=ids, prompt=prompt, request_id=request_id,
                        lora_name=lora_name, stream=stream)


def tensor_pairs(named_tensors: Any) -> list[tuple[str, Any]]:
    if isinstance(named_tensors, Mapping):
        return list(named_tensors.items())
    if isinstance(named_tensors, FlatLoraAdapter):
        return named_tensors.named_tensors()  # its views travel by name
    return named_tensor_list(named_tensors)


def lora_updates_request(updates: Any, pause_mode: str) -> protocol.UpdateLoraAdapters:
    """Engine.update_lora_adapters' {adapter name: tensors} as one request: the names, how
    many tensors each has, and the tensors in that order."""
    if not isinstance(updates, Mapping):
        raise ValueError("update_lora_adapters: expected a non-empty {adapter name: tensors} mapping")
    pairs = {check_str(name, "lora_name"): tensor_pairs(tensors) for name, tensors in updates.items()}
    return protocol.UpdateLoraAdapters(names=list(pairs), counts=[len(p) for p in pairs.values()],
                                       pause_mode=pause_mode, named_tensors=[t for p in pairs.values() for t in p])


def load_lora_request(name: str, path: str | Path | None, tensors: Any, config: Any) -> protocol.LoadLoraAdapter:
    if config is not None and hasattr(config, "to_dict"):
        config = config.to_dict()  # a peft LoraConfig
    return protocol.LoadLoraAdapter(
        name=name, path=str(path) if path is not None else None,
        config=_plain_config(config, "config") if config is not None else None,
        tensors=tensor_pairs(tensors) if tensors is not None else None)


def _plain_config(value: Any, where: str) -> Any:
    """A LoraConfig dict as plain values: sets and tuples as lists, enums by value."""
    if isinstance(value, enum.Enum):
        return _plain_config(value.value, where)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (set, frozenset)):
        return sorted(_plain_config(v, where) for v in value)
    if isinstance(value, (list, tuple)):
        return [_plain_config(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        return {str(k): _plain_config(v, f"{where}.{k}") for k, v in value.items()}
    raise TypeError(f"{where}: {type(value).__name__} cannot be sent to the engine (plain values only)")


# ---- replies -> results --------------------------------------------------------------------
def result_of(op: str, message: protocol.Message) -> Any:
    """A call's single answer as the Engine would return it (optable.py: each op's reply)."""
    if isinstance(message, protocol.ErrorReply):
        raise remote_error(message)
    if not isinstance(message, protocol.Reply):
        raise ProtocolError(f"{op}: expected a reply, got {type(message).__name__}")
    return OPS[op].result(message)


@dataclasses.dataclass
class OpenAdds:
    """add_request calls whose outputs have not all arrived: call id -> request ids left;
    outputs arrived and not yet handed out; errors to raise at the next collection."""

    pending: dict[int, set[str]] = dataclasses.field(default_factory=dict)
    finished: dict[str, RolloutOutput] = dataclasses.field(default_factory=dict)
    errors: list[Exception] = dataclasses.field(default_factory=list)

    def take(self, call_id: int, message: protocol.Message) -> None:
        if isinstance(message, protocol.ErrorReply):
            self.pending.pop(call_id, None)
            self.errors.append(remote_error(message))
        elif isinstance(message, protocol.Event):
            left = self.pending.get(call_id, set())
            for output in message.outputs:
                self.finished[output.request_id] = output
                left.discard(output.request_id)
            if not left:
                self.pending.pop(call_id, None)

    def check_free(self, request: protocol.Add) -> None:
        """Refuse an id this client still owes an output for (running, or arrived and not yet
        handed out): the engine only knows the running ones, and a request that finished
        before the second add arrived would otherwise be accepted twice under one id."""
        base, n = request.request_id, request.sampling_params.n
        if base is None:
            return
        ids = [base] if n == 1 else [f"{base}-{i}" for i in range(n)]
        held = set(self.finished).union(*self.pending.values())
        if any(rid in held for rid in ids):
            raise ValueError(f"request id {base!r} is already in use")

    def raise_errors(self) -> None:
        if self.errors:
            raise self.errors.pop(0)

    def take_outputs(self, wanted: list[str] | None) -> list[RolloutOutput] | None:
        """All finished outputs (wanted=None), or those wanted in order once all are in."""
        self.raise_errors()
        if wanted is None:
            done, self.finished = list(self.finished.values()), {}
            return done
        if all(rid in self.finished for rid in wanted):
            return [self.finished.pop(rid) for rid in wanted]
        return None


def path_arg(path: str | Path) -> str:
    if not isinstance(path, (str, Path)):
        raise TypeError(f"path={path!r}: expected a str or Path")
    return str(path)

