"""Checks that a dropped object never hangs its process (issue 49): it is dropped inside a
reference cycle and gc.collect() runs in a thread with a time limit, so a regression (a
finalizer that blocks, zmq's term() waiting on a socket still open) fails the test instead of
hanging whatever allocates next."""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Iterator

import pytest

COLLECT_LIMIT_S = 1.0  # beyond what a collection with nothing of ours in it takes


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    """No automatic collection inside: the test decides when the cycle is collected."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def ordinary_collection_s() -> float:
    """How long a full collection of this process takes with nothing of ours to collect (torch
    and transformers loaded: 0.3-0.7 s on a loaded 2-core VM)."""
    start = time.monotonic()
    gc.collect()
    return time.monotonic() - start


def collect_within_limit(refs: list[weakref.ref], ordinary_s: float, what: str = "object") -> None:
    """gc.collect() in a thread returns within COLLECT_LIMIT_S of an ordinary collection's
    time, and the objects behind `refs` are gone."""
    limit = COLLECT_LIMIT_S + 2 * ordinary_s
    thread = threading.Thread(target=gc.collect, daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        stack = "".join(traceback.format_stack(sys._current_frames()[thread.ident]))
        pytest.fail(f"gc.collect() has not returned after {limit:.2f}s:\n{stack}")
    assert all(ref() is None for ref in refs), f"a dropped {what} was not collected"


def drop_in_cycle(*objects: object) -> None:
    """Leave `objects` referenced only from a cycle (as a thread's closure and an exception's
    traceback do), for the collector to find."""
    cycle = list(objects)
    cycle.append(cycle)
