"""Tests that need the whole GPU run alone, whatever pytest-xdist's -n and --dist.

A test marked `whole_gpu` (device-wide memory figures such as mem_get_info, an engine that
sizes its KV cache from the free device memory, large shapes) holds an exclusive lock for
its whole run: setup, call and teardown, so the module and session fixtures it sets up or
tears down are inside it too. Every other test holds the lock shared: shared holders run
together, an exclusive holder runs with none. The lock is a file lock (fcntl.flock) in the
temporary directory, so it spans xdist's worker processes, and two pytest runs on the same
devices as well. On a machine without CUDA nothing is locked.

Why not xdist_group: a group only sends its tests to one worker, one after another; the
other workers keep running their GPU tests at the same time, on the same device. And it
takes effect only under --dist loadgroup.

A second lock, the turnstile, lets a waiting exclusive holder go first: without it, with
several workers taking the shared lock test after test, the lock would rarely be free of
shared holders, and the whole-GPU tests would wait for the end of the run.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path


class GpuLock:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._main = open(path, "a")  # noqa: SIM115 (held open for the process's life)
        self._turnstile = open(path.with_name(path.name + ".turnstile"), "a")  # noqa: SIM115

    @classmethod
    def for_visible_devices(cls) -> GpuLock:
        """One lock per set of visible devices (CUDA_VISIBLE_DEVICES), so that runs on
        different GPUs of one host do not wait for each other."""
        devices = re.sub(r"[^A-Za-z0-9,-]", "_", os.environ.get("CUDA_VISIBLE_DEVICES", "all")) or "none"
        return cls(Path(tempfile.gettempdir()) / f"rollout-tests-cuda-{devices}.lock")

    @contextlib.contextmanager
    def hold(self, exclusive: bool) -> Iterator[None]:
        fcntl.flock(self._turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._main, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self._main, fcntl.LOCK_UN)
