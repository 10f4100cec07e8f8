"""The op table (rollout/server/optable.py) against the four places that restate the
Engine's API: every public Engine method is served (or named in-process only, with its
reason), the wire has one request per op, the engine process a way to run each, and both
clients a method with the Engine method's parameters and defaults. No engine is built."""

from __future__ import annotations

import dataclasses
import inspect
import typing

import pytest

from lora.flat import FlatLoraAdapter
from lora.manager import LoraAdapterInfo
from rollout.engine import Engine
from rollout.server import AsyncRolloutClient, RolloutClient, protocol
from rollout.server.ops import EngineOps
from rollout.server.optable import BACKGROUND, CALL, ENGINE_ONLY_ARGS, HANDLER, IN_PROCESS_ONLY, OPS

# Public client methods that serve no op of their own, and why.
CLIENT_ONLY = {
    "stream": "add_request's outputs as they are made (op add, stream=True); in-process, step() hands them out",
    "poll_outputs": "collects add_request's outputs, which in-process come from step()",
    "get_outputs": "waits for add_request's outputs, which in-process come from step()",
    "launch": "starts an engine process",
    "connect": "the asyncio client's checked connection (the blocking one connects in __init__)",
    "close": "disconnects (and stops a launched engine process)",
}
ROWS = sorted(OPS.values(), key=lambda op: op.name)
SERVED = [op for op in ROWS if op.method is not None]


def _public_methods(cls: type) -> set[str]:
    return {name for name, value in vars(cls).items()
            if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, (staticmethod, classmethod)))}


def _params(fn) -> dict[str, inspect.Parameter]:
    return {name: p for name, p in inspect.signature(fn).parameters.items() if name != "self"}


def test_every_public_engine_method_is_served_or_in_process_only() -> None:
    served = [op.engine for op in ROWS if op.engine is not None]
    assert len(served) == len(set(served)), "an Engine method served by two ops"
    public = _public_methods(Engine)
    missing = public - set(served) - set(IN_PROCESS_ONLY)
    assert not missing, f"public Engine methods with no op (add a row, or a reason in IN_PROCESS_ONLY): {sorted(missing)}"
    assert not set(served) - public, "a row names no public Engine method"
    assert set(IN_PROCESS_ONLY) <= public and not set(IN_PROCESS_ONLY) & set(served)
    assert all(reason.strip() for reason in IN_PROCESS_ONLY.values())


def test_the_wire_has_one_request_per_op() -> None:
    assert set(OPS) == set(protocol.REQUESTS)
    for op in ROWS:
        assert protocol.REQUESTS[op.name] is op.request
        assert dataclasses.is_dataclass(op.request) and op.request.__dataclass_params__.frozen, op.name


def test_the_engine_process_runs_every_op() -> None:
    for op in ROWS:
        handler = getattr(EngineOps, op.name, None)
        if op.run == HANDLER:
            assert callable(handler), f"{op.name}: a HANDLER row needs EngineOps.{op.name}"
            assert list(_params(handler)) == ["identity", "call_id", "request"], op.name
        else:
            assert handler is None, f"{op.name}: EngineOps.{op.name} would never run (the row calls the engine)"


@pytest.mark.parametrize("op", [op for op in ROWS if op.run in (CALL, BACKGROUND)], ids=lambda op: op.name)
def test_a_call_rows_request_fields_are_its_engine_methods_parameters(op) -> None:
    engine = _params(getattr(Engine, op.engine))
    fields = {f.name: f for f in dataclasses.fields(op.request)}
    assert set(fields) == set(engine), op.name
    for name, f in fields.items():
        if engine[name].default is not inspect.Parameter.empty:
            assert f.default == engine[name].default, f"{op.name}.{name}: default differs from Engine.{op.engine}"


@pytest.mark.parametrize("op", [op for op in ROWS if op.engine is not None and op.read is None],
                         ids=lambda op: op.name)
def test_a_reply_is_what_the_engine_method_returns(op) -> None:
    hints = typing.get_type_hints(getattr(Engine, op.engine),
                                  localns={"LoraAdapterInfo": LoraAdapterInfo, "FlatLoraAdapter": FlatLoraAdapter})
    assert (type(None) if op.reply is None else op.reply) == hints["return"], op.name


@pytest.mark.parametrize("client", [RolloutClient, AsyncRolloutClient], ids=lambda c: c.__name__)
@pytest.mark.parametrize("op", SERVED, ids=lambda op: op.name)
def test_each_client_has_the_ops_method_with_the_engines_parameters(op, client) -> None:
    method = getattr(client, op.method, None)
    assert method is not None, f"{client.__name__}.{op.method} is missing (op {op.name!r})"
    if client is AsyncRolloutClient:
        assert inspect.iscoroutinefunction(method), f"{client.__name__}.{op.method} must be async"
    got = _params(method)
    extras = {"timeout"} | ({"wait"} if op.waits_on_trainer and client is RolloutClient else set())
    assert extras <= set(got) and all(got[name].kind == inspect.Parameter.KEYWORD_ONLY for name in extras)
    if op.engine is not None:
        want = {name: p for name, p in _params(getattr(Engine, op.engine)).items()
                if (op.engine, name) not in ENGINE_ONLY_ARGS}
    else:  # the engine process's own: the request's fields
        want = {f.name: inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default)
                for f in dataclasses.fields(op.request)}
    assert set(got) - extras == set(want), f"{client.__name__}.{op.method}: parameters"
    for name, p in want.items():
        assert got[name].kind == p.kind, f"{client.__name__}.{op.method}({name}): positional or keyword as the Engine's"
        assert got[name].default == p.default, f"{client.__name__}.{op.method}({name}): default differs"


def test_engine_only_arguments_are_engine_parameters() -> None:
    for (method, name), reason in ENGINE_ONLY_ARGS.items():
        assert name in _params(getattr(Engine, method)) and reason.strip(), (method, name)


def test_both_clients_offer_the_same_methods_and_nothing_unaccounted_for() -> None:
    sync, asynchronous = _public_methods(RolloutClient), _public_methods(AsyncRolloutClient)
    assert sync - {"connect"} == asynchronous - {"connect"}
    unaccounted = (sync | asynchronous) - {op.method for op in SERVED} - set(CLIENT_ONLY)
    assert not unaccounted, f"client methods that serve no op: {sorted(unaccounted)}"
