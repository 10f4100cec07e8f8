"""`python -m rollout.server --model DIR [--address ADDR] [engine options]`: the engine
process's command line.

Every EngineConfig field is an option (`--max-total-tokens 4096`, `--enable-lora`,
`--no-enable-radix-cache`, `--lora-target-modules q_proj v_proj`), read from the dataclass,
so a field added there is an option here; options left out keep EngineConfig's defaults.
The address is checked before the model loads: a non-loopback one is refused in a second
unless --allow-remote is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import tempfile
import types
import typing
from typing import Any

from rollout.config import EngineConfig


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _engine_fields() -> list[tuple[str, Any]]:
    hints = typing.get_type_hints(EngineConfig)
    # kernel_options: benchmarks' and tests' (a Python object), not a command-line option
    return [(f.name, hints[f.name]) for f in dataclasses.fields(EngineConfig) if f.name not in ("model", "kernel_options")]


def _base_type(hint: Any) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        return options[0], len(options) < len(typing.get_args(hint))
    return hint, False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m rollout.server", description="Serve one rollout Engine over zmq.")
    parser.add_argument("--model", required=True, help="checkpoint directory (HF layout)")
    server = parser.add_argument_group("server")
    server.add_argument("--address", default=None,
                        help="ipc:///path or tcp://127.0.0.1:PORT (default: an ipc path in the temp dir, printed)")
    server.add_argument("--allow-remote", action="store_true", help="accept a non-loopback tcp address")
    server.add_argument("--client-timeout-s", type=float, default=10.0,
                        help="a client whose connection answers no heartbeat this long is gone: its requests are aborted")
    server.add_argument("--max-header-bytes", type=int, default=64 << 20, help="largest header frame accepted")
    server.add_argument("--max-tensor-bytes", type=int, default=4 << 30, help="largest tensor frame accepted")
    server.add_argument("--log-level", default="INFO")
    engine = parser.add_argument_group("engine (EngineConfig fields)")
    for name, hint in _engine_fields():
        base, _ = _base_type(hint)
        if base is bool:
            engine.add_argument(_flag(name), dest=name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS)
        elif typing.get_origin(base) is tuple:
            engine.add_argument(_flag(name), dest=name, nargs="+", default=argparse.SUPPRESS)
        else:
            engine.add_argument(_flag(name), dest=name, type=base, default=argparse.SUPPRESS)
    return parser


def engine_config_argv(options: dict[str, Any]) -> list[str]:
    """EngineConfig keyword arguments as this command line's options (for launching)."""
    known = dict(_engine_fields())
    argv: list[str] = []
    for name, value in options.items():
        if name not in known:
            raise TypeError(f"{name!r} is not an EngineConfig field (expected one of {sorted(known)})")
        if value is None:
            continue  # None is every optional field's default
        if isinstance(value, bool):
            argv.append(_flag(name) if value else "--no-" + name.replace("_", "-"))
        elif isinstance(value, (list, tuple)):
            argv += [_flag(name), *map(str, value)]
        else:
            argv += [_flag(name), str(value)]
    return argv


def default_address() -> str:
    return f"ipc://{tempfile.gettempdir()}/rollout-engine-{os.getpid()}.sock"


def main(argv: list[str] | None = None) -> int:
    from rollout.server.engine_process import EngineServer, ServerConfig
    from rollout.server.protocol import Limits

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    engine_options = {name: getattr(args, name) for name, _ in _engine_fields() if hasattr(args, name)}
    try:
        server_config = ServerConfig(args.address or default_address(), allow_remote=args.allow_remote,
                                     limits=Limits(args.max_header_bytes, args.max_tensor_bytes),
                                     client_timeout_s=args.client_timeout_s)
        engine_config = EngineConfig(model=args.model, **engine_options)
    except (TypeError, ValueError) as error:
        print(f"rollout.server: {error}", file=sys.stderr)
        return 2
    from rollout.engine import Engine

    server = EngineServer(Engine(engine_config), server_config)
    print(f"rollout.server: serving {engine_config.model} on {server_config.address}", file=sys.stderr, flush=True)
    server.serve_forever()
    return 0
