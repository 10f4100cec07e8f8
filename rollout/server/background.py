"""How other threads reach the step loop: an inbox the loop drains after a doorbell wakes
its poll, and background operations (a weight-sync rendezvous, a CUDA IPC update waiting
for its trainer) that block a thread instead of the loop.

The engine is not thread-safe, so a background operation never touches it from its own
thread: it waits there (for peers to join, for the trainer's first message) and hands
the engine work to the loop with `run_on_loop`, which blocks the thread until the loop has
run it. Other clients are served the whole time the operation waits; the loop is held only
for the update itself.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class Doorbell:
    """A pipe the loop's zmq poller watches: ringing it from any thread wakes the poll."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)

    def fileno(self) -> int:
        return self._read

    def ring(self) -> None:
        try:
            os.write(self._write, b"\0")
        except BlockingIOError:
            pass  # the pipe is full of rings already: the loop will wake

    def clear(self) -> None:
        try:
            while os.read(self._read, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self._read)
        os.close(self._write)


class Inbox:
    """Items for the loop from other threads, in order."""

    def __init__(self) -> None:
        self.doorbell = Doorbell()
        self._items: queue.SimpleQueue = queue.SimpleQueue()

    def post(self, item: object) -> None:
        self._items.put(item)
        self.doorbell.ring()

    def drain(self) -> list[object]:
        self.doorbell.clear()  # first: an item posted after this rings again
        items = []
        while True:
            try:
                items.append(self._items.get_nowait())
            except queue.Empty:
                return items


@dataclass
class LoopCall:
    """Engine work a background thread asks the loop to run; the thread waits for it."""

    fn: Callable[[], Any]
    done: threading.Event
    result: Any = None
    error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as error:  # handed to the waiting thread, which re-raises
            self.error = error
        finally:
            self.done.set()


@dataclass(frozen=True)
class BackgroundDone:
    identity: bytes
    call_id: int
    op: str
    result: Any = None
    error: BaseException | None = None


class Background:
    """At most one blocking operation at a time, on a daemon thread (a trainer that never
    shows up must not keep the process from exiting)."""

    def __init__(self, inbox: Inbox) -> None:
        self._inbox = inbox
        self.running: str | None = None  # the op in flight

    def start(self, identity: bytes, call_id: int, op: str, job: Callable[[], Any]) -> None:
        if self.running is not None:
            raise RuntimeError(f"{op}: {self.running} is still in progress; one weight-sync operation at a time")
        self.running = op

        def target() -> None:
            try:
                self._inbox.post(BackgroundDone(identity, call_id, op, result=job()))
            except BaseException as error:
                self._inbox.post(BackgroundDone(identity, call_id, op, error=error))

        threading.Thread(target=target, name=f"rollout-{op}", daemon=True).start()

    def finished(self) -> None:
        self.running = None

    def run_on_loop(self, fn: Callable[[], Any]) -> Any:
        """From a background thread: run `fn` on the loop, wait, return its result."""
        call = LoopCall(fn, threading.Event())
        self._inbox.post(call)
        call.done.wait()
        if call.error is not None:
            raise call.error
        return call.result
