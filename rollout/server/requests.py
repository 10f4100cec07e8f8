"""The engine process's requests: one frozen dataclass per operation, its fields named and
defaulted as the Engine method's parameters it carries (optable.py maps each to its method).

A request's fields are checked when it is made, here (each `__post_init__`, with
rollout.validate) and by codec.from_plain when it is decoded; protocol.py says how a request
crosses the socket. An op that carries tensors declares one field of (name, tensor) pairs with
metadata frames=True: they travel as raw frames, never in the header.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from rollout.request import SamplingParams
from rollout.validate import check_float, check_int, check_pause_mode, check_str

NamedTensors = list  # list[tuple[str, torch.Tensor]]: travels as frames, never in the header
FRAMES = {"frames": True}  # a field's metadata: its tensors travel as frames


def _check_positive(value: float | None, name: str) -> None:
    if value is not None and check_float(value, name) <= 0:
        raise ValueError(f"{name}={value}: must be > 0")


class Request:
    """Base of the ops below; an op that carries tensors declares one field of (name, tensor)
    pairs with metadata frames=True: the header's "tensors" describes them, raw frames carry
    them. Fields are named as the Engine method's parameters they carry (optable.py)."""

    op: ClassVar[str]


@dataclass(frozen=True)
class Hello(Request):
    op: ClassVar[str] = "hello"


@dataclass(frozen=True)
class Generate(Request):
    """Prompts run to completion; one reply with every sample's output, prompt-major."""

    op: ClassVar[str] = "generate"
    sampling_params: list[SamplingParams]  # one per prompt
    lora_names: list[str | None]  # one per prompt
    input_ids: list[list[int]] | None = None
    prompts: list[str] | None = None

    def __post_init__(self) -> None:
        if (self.input_ids is None) == (self.prompts is None):
            raise ValueError("generate takes exactly one of input_ids or prompts")
        count = len(self.input_ids if self.input_ids is not None else self.prompts)  # type: ignore[arg-type]
        if len(self.sampling_params) != count or len(self.lora_names) != count:
            raise ValueError(f"generate: {count} prompts but {len(self.sampling_params)} sampling_params "
                             f"and {len(self.lora_names)} lora_names")


@dataclass(frozen=True)
class Add(Request):
    """One prompt (its n samples) queued; the reply acknowledges with the request ids, then
    events bring stream deltas (if `stream`) and each sample's output."""

    op: ClassVar[str] = "add"
    sampling_params: SamplingParams
    input_ids: list[int] | None = None
    prompt: str | None = None
    request_id: str | None = None
    lora_name: str | None = None
    stream: bool = False

    def __post_init__(self) -> None:
        if (self.input_ids is None) == (self.prompt is None):
            raise ValueError("add takes exactly one of input_ids or prompt")
        if self.request_id is not None:
            check_str(self.request_id, "request_id")


@dataclass(frozen=True)
class Abort(Request):
    op: ClassVar[str] = "abort"
    request_id: str


@dataclass(frozen=True)
class Cancel(Request):
    """Abort every request an earlier call of this client started (a stream given up on)."""

    op: ClassVar[str] = "cancel"
    call_id: int


@dataclass(frozen=True)
class UpdateWeights(Request):
    op: ClassVar[str] = "update_weights"
    full: bool = False
    pause_mode: str = "retract"
    target: str = "model"  # or "draft": the draft model's weights (speculative="draft")
    named_tensors: NamedTensors = field(default_factory=list, metadata=FRAMES)

    def __post_init__(self) -> None:
        check_pause_mode(self.pause_mode)


@dataclass(frozen=True)
class UpdateWeightsFromDisk(Request):
    op: ClassVar[str] = "update_weights_from_disk"
    path: str
    full: bool = True
    pause_mode: str = "retract"
    lora_name: str | None = None
    target: str = "model"

    def __post_init__(self) -> None:
        check_str(self.path, "path")
        check_pause_mode(self.pause_mode)


@dataclass(frozen=True)
class UpdateWeightsFromIpc(Request):
    op: ClassVar[str] = "update_weights_from_ipc"
    endpoint: str
    full: bool = True
    pause_mode: str = "retract"
    timeout_s: float = 300.0
    lora_name: str | None = None
    target: str = "model"

    def __post_init__(self) -> None:
        from weightsync.transports.ipc_wire import check_loopback_endpoint

        check_loopback_endpoint(self.endpoint)  # CUDA IPC is one host: its socket never leaves it
        check_pause_mode(self.pause_mode)
        _check_positive(self.timeout_s, "timeout_s")


@dataclass(frozen=True)
class UpdateWeightsFromDistributed(Request):
    op: ClassVar[str] = "update_weights_from_distributed"
    full: bool = True
    pause_mode: str = "retract"
    lora_name: str | None = None
    target: str = "model"

    def __post_init__(self) -> None:
        check_pause_mode(self.pause_mode)


@dataclass(frozen=True)
class InitWeightSyncGroup(Request):
    op: ClassVar[str] = "init_weight_sync_group"
    master_addr: str
    master_port: int
    rank_offset: int
    world_size: int
    backend: str = "gloo"
    timeout_s: float = 300.0
    join_timeout_s: float | None = None

    def __post_init__(self) -> None:
        _check_positive(self.timeout_s, "timeout_s")
        _check_positive(self.join_timeout_s, "join_timeout_s")


@dataclass(frozen=True)
class DestroyWeightSyncGroup(Request):
    op: ClassVar[str] = "destroy_weight_sync_group"


@dataclass(frozen=True)
class LoadLoraAdapter(Request):
    op: ClassVar[str] = "load_lora_adapter"
    name: str
    path: str | None = None
    config: dict[str, Any] | None = None
    tensors: NamedTensors | None = field(default=None, metadata=FRAMES)


@dataclass(frozen=True)
class UnloadLoraAdapter(Request):
    op: ClassVar[str] = "unload_lora_adapter"
    name: str


@dataclass(frozen=True)
class UpdateLoraAdapter(Request):
    op: ClassVar[str] = "update_lora_adapter"
    name: str
    pause_mode: str = "retract"
    named_tensors: NamedTensors = field(default_factory=list, metadata=FRAMES)

    def __post_init__(self) -> None:
        check_pause_mode(self.pause_mode)


@dataclass(frozen=True)
class UpdateLoraAdapters(Request):
    """Several adapters in one atomic update: adapter names[i]'s tensors are the next
    counts[i] of named_tensors."""

    op: ClassVar[str] = "update_lora_adapters"
    names: list[str]
    counts: list[int]
    pause_mode: str = "retract"
    named_tensors: NamedTensors = field(default_factory=list, metadata=FRAMES)

    def __post_init__(self) -> None:
        check_pause_mode(self.pause_mode)
        if len(self.counts) != len(self.names):
            raise ValueError(f"update_lora_adapters: {len(self.names)} names but {len(self.counts)} counts")
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"update_lora_adapters: an adapter named twice in {self.names}")
        if any(c < 0 for c in self.counts) or sum(self.counts) != len(self.named_tensors):
            raise ValueError(f"update_lora_adapters: counts {self.counts} do not add up to the "
                             f"{len(self.named_tensors)} tensors sent")

    def updates(self) -> dict[str, list]:
        """{adapter name: its (name, tensor) pairs}, as Engine.update_lora_adapters takes them."""
        out, at = {}, 0
        for name, count in zip(self.names, self.counts):
            out[name], at = self.named_tensors[at : at + count], at + count
        return out


@dataclass(frozen=True)
class ListLoraAdapters(Request):
    op: ClassVar[str] = "list_lora_adapters"


@dataclass(frozen=True)
class Sleep(Request):
    op: ClassVar[str] = "sleep"
    level: int = 1

    def __post_init__(self) -> None:
        check_int(self.level, "level", min=0)


@dataclass(frozen=True)
class Wake(Request):
    op: ClassVar[str] = "wake"
    tags: list[str] | None = None


@dataclass(frozen=True)
class Stats(Request):
    op: ClassVar[str] = "stats"


@dataclass(frozen=True)
class FlushCache(Request):
    op: ClassVar[str] = "flush_cache"


@dataclass(frozen=True)
class PauseGeneration(Request):
    op: ClassVar[str] = "pause_generation"
    mode: str = "abort"  # checked by Engine.pause_generation, which names the field


@dataclass(frozen=True)
class ContinueGeneration(Request):
    op: ClassVar[str] = "continue_generation"


@dataclass(frozen=True)
class Health(Request):
    op: ClassVar[str] = "health"


@dataclass(frozen=True)
class GetModelInfo(Request):
    op: ClassVar[str] = "model_info"


@dataclass(frozen=True)
class Shutdown(Request):
    op: ClassVar[str] = "shutdown"


# every op's request, by name (what each op does: optable.py)
REQUESTS: dict[str, type[Request]] = {cls.op: cls for cls in Request.__subclasses__()}
