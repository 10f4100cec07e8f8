"""Starting an engine process for a client: `python -m rollout.server` on a fresh ipc path
in a private temporary directory, and stopping it again (politely, then not)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout.server.cli import engine_config_argv


@dataclass
class EngineProcess:
    process: subprocess.Popen
    address: str
    tmpdir: str | None  # ours to remove (it holds the ipc socket)

    def exit_code(self) -> int | None:
        return self.process.poll()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Wait for the process to exit (after a shutdown request), then terminate, then kill."""
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.terminate()
            try:
                self.process.wait(5.0)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None


def spawn_engine(model: str | Path, engine_options: dict[str, Any], *, address: str | None = None,
                 server_args: list[str] | None = None, env: dict[str, str] | None = None,
                 stdout: Any = None, stderr: Any = None) -> EngineProcess:
    """Start `python -m rollout.server` (this interpreter) for `model` with EngineConfig
    options; the address defaults to an ipc socket in a new private temporary directory."""
    from rollout.config import EngineConfig

    EngineConfig(model=str(model), **engine_options)  # refuse a bad option here, not after the child imports torch
    tmpdir = None
    if address is None:
        # a short path: ipc socket paths are capped near 100 bytes
        tmpdir = tempfile.mkdtemp(prefix="rollout-", dir="/tmp" if os.path.isdir("/tmp") else None)
        address = f"ipc://{tmpdir}/engine.sock"
    argv = [sys.executable, "-m", "rollout.server", "--model", str(model), "--address", address,
            *(server_args or []), *engine_config_argv(engine_options)]
    child_env = dict(os.environ if env is None else env)
    # the child imports this very package, even when it is run from a source tree
    root = str(Path(__file__).resolve().parents[2])
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (root, child_env.get("PYTHONPATH")) if p)
    process = subprocess.Popen(argv, env=child_env, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL)
    return EngineProcess(process, address, tmpdir)
