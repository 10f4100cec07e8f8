"""A CUDA IPC sender never hangs its process (issue 49, trainer side): dropped without close()
inside a reference cycle, in any state (idle, after an update, flat or bucketed, after send()
refused its input or timed out with no engine there), the next gc.collect() returns at once,
and nothing it exported stays referenced. Before, pyzmq's Context.__del__ could run before
its socket's in the cycle's garbage and wait forever in term(). The same at interpreter exit:
ipc_lifecycle_child.py, in a process of its own. CUDA's calls are faked (_ipc_fakes.py); the
sockets are real.

The collections run with the automatic collector off and in a thread with a time limit, so a
regression fails the test instead of hanging whatever allocates next.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _ipc_fakes import _endpoint, _model, cpu_ipc  # noqa: F401
from gc_checks import collect_within_limit, collector_off, ordinary_collection_s
from ipc_lifecycle_child import STATES

from weightsync.transports import WeightSyncError
from weightsync.transports.cuda_ipc import CudaIpcSender

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("ipc_lifecycle_child.py")
EXIT_LIMIT_S = 60.0  # the child's imports (torch) included, on a loaded machine


@pytest.fixture(scope="module")
def ordinary_s() -> float:
    return ordinary_collection_s()


@pytest.mark.parametrize("state", list(STATES))
def test_a_dropped_sender_is_collected_at_once(cpu_ipc, ordinary_s: float, state: str) -> None:
    with collector_off():
        refs = STATES[state]()
        collect_within_limit(refs, ordinary_s, "sender or receiver")
    cpu_ipc.assert_balanced()


def test_senders_left_at_exit() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), str(CHILD.parent), os.environ.get("PYTHONPATH")) if p))
    try:
        child = subprocess.run([sys.executable, str(CHILD)], env=env, capture_output=True, text=True,
                               timeout=EXIT_LIMIT_S)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"a process that left CUDA IPC senders in cycles did not exit within {EXIT_LIMIT_S}s: "
                    f"{error.stdout!r} {error.stderr!r}")
    assert child.returncode == 0 and f"leaving {len(STATES)} senders for the exit" in child.stdout, \
        child.stdout + child.stderr
    assert "Traceback" not in child.stderr and "Exception ignored" not in child.stderr, child.stderr


def test_a_closed_sender_says_so(cpu_ipc) -> None:
    sender = CudaIpcSender(_endpoint(), timeout_s=10)
    sender.close()
    sender.close()  # a second close does nothing
    with pytest.raises(WeightSyncError, match="CUDA IPC sender for .* is closed"):
        sender.send(_model(0))
    assert cpu_ipc.exported == []


@pytest.mark.parametrize("flat", [True, False])
def test_a_non_tensor_is_refused_by_name(cpu_ipc, flat: bool) -> None:
    """The stream's byte count must not touch an item before it is checked: a list where a
    tensor belongs is refused by its name, not with an AttributeError from the counter."""
    sender = CudaIpcSender(_endpoint(), flat=flat, timeout_s=0.2)
    try:
        with pytest.raises(TypeError, match="weight 'w': expected a torch.Tensor, got list"):
            sender.send([("w", [1.0, 2.0])])
    finally:
        sender.close()
