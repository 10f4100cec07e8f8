"""TPEngine against Engine's public API, without starting any rank: every Engine method is
a TPEngine method, a command TPEngine.call runs on every rank, a tensor command, or named in
NOT_CARRIED with its reason (as tests/server/test_op_table.py checks the engine process's)."""

from __future__ import annotations

import inspect

from rollout.distributed import tp_engine
from rollout.distributed.tp_engine import NOT_CARRIED, TPEngine
from rollout.engine import Engine


def _public(cls: type) -> set[str]:
    return {name for name, value in vars(cls).items() if not name.startswith("_") and inspect.isfunction(value)}


def test_every_public_engine_method_is_carried_or_named_with_its_reason() -> None:
    engine = _public(Engine)
    carried = (_public(TPEngine) & engine) | set(tp_engine._CALLS) | set(tp_engine._TENSOR_CALLS)
    missing = engine - carried - set(NOT_CARRIED)
    assert not missing, f"Engine methods TPEngine neither carries nor names in NOT_CARRIED: {sorted(missing)}"
    assert not carried & set(NOT_CARRIED), "a method both carried and named as not carried"
    assert set(NOT_CARRIED) <= engine and all(reason.strip() for reason in NOT_CARRIED.values())
    assert (set(tp_engine._CALLS) | set(tp_engine._TENSOR_CALLS)) <= engine, "a command names no Engine method"
