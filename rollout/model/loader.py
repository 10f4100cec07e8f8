"""HF parameter names -> engine parameters. The ONE loader: the checkpoint load at start-up
and every live weight update go through `plan_writes` / `apply_writes`.

A stream of (HF name, tensor) pairs becomes a list of WeightWrites (which parameter, which
rows of it). Everything is validated before anything is written, so a bad update (unknown
name, wrong shape, non-float dtype, NaN/Inf, a missing tensor in a full load) raises a
ValueError naming the offending parameter and leaves the model untouched.

A tensor-parallel model (model.tp) gets the same HF-named full tensors: shapes are checked
against the whole model's, then each write keeps this rank's shard (a view, no copy), and
finiteness is checked on that shard only. A rank whose shard is bad fails here; the
engine's TP agreement then makes every rank refuse (rollout/distributed/tp.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from rollout.kernels import first_non_finite
from rollout.model.config import ModelConfig
from rollout.model.parallel import full_shape, local_rows, shard_dim, take_shard

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_QKV = re.compile(r"^self_attn\.([qkv])_proj\.(weight|bias)$")
_GATE_UP = re.compile(r"^mlp\.(gate|up)_proj\.weight$")
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.rotary_emb\.)")


@dataclass
class WeightWrite:
    hf_name: str
    param: torch.Tensor  # the engine parameter (written in place)
    rows: slice | None  # rows of the fused parameter this tensor fills; None = all of it
    tensor: torch.Tensor  # the incoming value (any device / float dtype); with TP, this rank's shard


def _target(cfg: ModelConfig, hf_name: str) -> tuple[str, slice | None] | None:
    """(engine parameter name, rows) for an HF name; None for names to ignore."""
    if _IGNORED.search(hf_name):
        return None
    name = hf_name[len("model.") :] if hf_name.startswith("model.") else hf_name
    if name == "lm_head.weight":
        return ("embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"), None
    m = _LAYER.match(name)
    if m:
        layer, rest = m.group(1), m.group(2)
        qkv = _QKV.match(rest)
        if qkv:
            which, kind = qkv.groups()
            start = {"q": 0, "k": cfg.q_size, "v": cfg.q_size + cfg.kv_size}[which]
            size = cfg.q_size if which == "q" else cfg.kv_size
            return f"layers.{layer}.self_attn.qkv_proj.{kind}", slice(start, start + size)
        gate_up = _GATE_UP.match(rest)
        if gate_up:
            start = 0 if gate_up.group(1) == "gate" else cfg.intermediate_size
            return f"layers.{layer}.mlp.gate_up_proj.weight", slice(start, start + cfg.intermediate_size)
    return name, None


def expected_hf_names(cfg: ModelConfig) -> list[str]:
    """Every HF tensor a full checkpoint of this config must provide."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        if cfg.qkv_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        if cfg.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    return names


def iter_hf_views(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The engine's weights under HF names (views: fused qkv / gate_up split back into rows),
    in the form a trainer sends them: for a transformers model of the same weights, and
    for benchmarks that sync the engine's own weights back into it."""
    cfg: ModelConfig = model.config  # type: ignore[assignment]
    params = dict(model.named_parameters())
    for name in expected_hf_names(cfg):
        param_name, rows = _target(cfg, name)  # type: ignore[misc]  (expected names are never ignored)
        param = params[param_name]
        yield name, param if rows is None else param[rows]


@dataclass(frozen=True)
class _Target:
    """Where one HF name goes in this model, worked out once per name (see _Targets)."""

    param: nn.Parameter  # written through (no_grad): sleep/wake swap its .data in place
    rows: slice | None
    dim: int | None  # the TP shard dimension, None when not sharded
    want: tuple[int, ...]  # the incoming tensor's shape: these rows, or the whole model's tensor


class _Targets:
    """The model's memo of HF name -> _Target (None: a name to ignore), filled as names come.

    A weight update sends the same few hundred names every step; mapping each through the
    regexes and the parameter dict again cost ~11 us a tensor (3.3 ms for an 8B model)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.params = dict(model.named_parameters())  # Parameters keep their identity (sleep/wake too)
        self.by_name: dict[str, _Target | None] = {}

    @staticmethod
    def of(model: nn.Module) -> _Targets:
        memo = model.__dict__.get("_hf_targets")
        if memo is None:
            memo = model.__dict__["_hf_targets"] = _Targets(model)
        return memo

    def lookup(self, hf_name: str) -> _Target | None:
        if hf_name in self.by_name:
            return self.by_name[hf_name]
        cfg: ModelConfig = self.model.config  # type: ignore[assignment]
        target = _target(cfg, hf_name)
        if target is None:
            self.by_name[hf_name] = None
            return None
        pname, rows = target
        param = self.params.get(pname)
        if param is None:  # not memoized: a typo keeps failing, and costs nothing on the good path
            raise ValueError(f"unknown parameter {hf_name!r}: the {cfg.architecture} model has no such tensor")
        tp = self.model.tp  # type: ignore[attr-defined]
        dim = shard_dim(pname) if tp.size > 1 else None
        # rows are in the whole model's fused layout; a dim-0 shard leaves the other dims whole
        # (updates run awake, so the parameter has its real shape here)
        want = (rows.stop - rows.start, *param.shape[1:]) if rows is not None else tuple(full_shape(param.shape, dim, tp))
        self.by_name[hf_name] = found = _Target(param, rows, dim, want)
        return found


def plan_writes(model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]], *, full: bool) -> list[WeightWrite]:
    """Map and validate a whole update. Raises ValueError naming the first bad tensor."""
    cfg: ModelConfig = model.config  # type: ignore[assignment]
    tp = model.tp  # type: ignore[attr-defined]
    targets = _Targets.of(model)
    writes: list[WeightWrite] = []
    seen: set[str] = set()
    # Per tensor only what can differ between updates (type, shape, repeats); what a name
    # maps to, and the shape it must have, is memoized: this loop runs for every tensor of
    # every sync (291 for an 8B model), ahead of the NaN/Inf check on the critical path.
    for hf_name, tensor in named_tensors:
        target = targets.lookup(hf_name)
        if target is None:
            continue
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"parameter {hf_name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
        if not tensor.is_floating_point():
            raise ValueError(f"parameter {hf_name!r}: dtype {tensor.dtype} is not a floating-point type")
        if tensor.shape != target.want:
            raise ValueError(f"parameter {hf_name!r}: shape {tuple(tensor.shape)} does not match the model's "
                             f"{target.want}")
        if hf_name in seen and hf_name != "lm_head.weight":
            raise ValueError(f"parameter {hf_name!r} given twice in one update")
        seen.add(hf_name)
        rows, dim = target.rows, target.dim
        if dim is not None:
            tensor = take_shard(tensor, dim, tp)
            rows = local_rows(rows, tp) if rows is not None else None
        writes.append(WeightWrite(hf_name, target.param, rows, tensor))
    if full:
        missing = [n for n in expected_hf_names(cfg) if n not in seen]
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise ValueError(f"missing tensors for a full load: {missing[:5]}{more}")
    _check_finite(writes)
    return writes


def _check_finite(writes: list[WeightWrite]) -> None:
    bad = first_non_finite([w.tensor for w in writes])
    if bad is not None:
        raise ValueError(f"parameter {writes[bad].hf_name!r} has non-finite values (NaN or Inf)")


@torch.no_grad()
def apply_writes(writes: list[WeightWrite]) -> None:
    for w in writes:
        dst = w.param if w.rows is None else w.param[w.rows]
        dst.copy_(w.tensor, non_blocking=True)


def load_weights(model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]], *, full: bool) -> int:
    writes = plan_writes(model, named_tensors, full=full)
    apply_writes(writes)
    return len(writes)


def iter_checkpoint(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (name, tensor) from a HF checkpoint dir: one or many *.safetensors, with or
    without model.safetensors.index.json. Tensors are read one at a time (mmap)."""
    from safetensors import safe_open

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise FileNotFoundError(f"weight files listed in {index.name} are missing: {missing}")
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weight files in {path}")
    for fname in files:
        with safe_open(str(path / fname), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)
