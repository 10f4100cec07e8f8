"""How an object's own zmq context and sockets end: `ZmqSockets`, closed once (linger 0) and
the context ended, by the owner's close() or by a finalizer when the owner is dropped without
it, collected in a reference cycle, or left at interpreter exit.

Used by the CUDA IPC sender here and by rollout's engine clients (rollout may import
weightsync, never the reverse). It knows nothing of what the sockets carry.
"""

from __future__ import annotations

import logging
import threading
import weakref

import zmq

log = logging.getLogger(__name__)

# How long the finalizer waits for a thread inside a call to let go of the sockets: a client's
# call holds its lock for one 0.1 s poll, or one send blocked up to its heartbeat timeout.
_CLOSE_LOCK_WAIT_S = 30.0


class ZmqSockets:
    """A context and the sockets made in it, for one owner.

    Why a finalizer that holds these and never the owner: left to pyzmq, an owner collected in
    a cycle takes its context and sockets into the same garbage, and the collector clears the
    context's weak set of its sockets before it runs any __del__; the context's __del__ may
    then run first, find no socket to close, and term() waits forever for the sockets still
    open (issue 49: gc.collect() never returned after a dead engine's client was dropped).
    Held by the finalizer, the context and sockets are never garbage while the owner is, and
    the finalizer runs before any __del__ in that garbage.

    Everything is closed before term(), with linger 0: term() waits only for open sockets and
    for messages lingering on closed ones, and what a gone owner had queued has nobody to go
    to. A monitor socket is one more socket of the context, closed here with the others.

    `lock`, when the owner's sockets are used from several threads: the finalizer closes them
    under it, since a zmq socket closed while another thread polls it can crash libzmq.
    """

    def __init__(self, owner: object, context: zmq.Context, lock: threading.RLock | None = None) -> None:
        self.context = context
        self._sockets: list[zmq.Socket] = []
        self._finalizer = weakref.finalize(owner, close_sockets, context, self._sockets, lock,
                                           type(owner).__name__)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def socket(self, kind: int) -> zmq.Socket:
        # An owner that closes a socket and makes another (a REQ socket reset mid-exchange)
        # would otherwise keep every closed one listed for as long as it lives.
        self._sockets[:] = [socket for socket in self._sockets if not socket.closed]
        socket = self.context.socket(kind)
        self._sockets.append(socket)
        return socket

    def monitor(self, socket: zmq.Socket, events: int) -> zmq.Socket:
        monitor = socket.get_monitor_socket(events)
        self._sockets.append(monitor)
        return monitor

    def close(self) -> None:
        self._finalizer()  # runs once: a later call, or the owner's collection, does nothing


def close_sockets(context: zmq.Context, sockets: list[zmq.Socket], lock: threading.RLock | None,
                  owner_name: str) -> None:
    """ZmqSockets' finalizer. A thread that holds `lock` exists only while the owner is still
    reachable (close() from another thread, or interpreter exit with a daemon thread inside a
    call); if it does not let go, the sockets and context are left as they are (the process's
    exit reclaims them) rather than risk a crash, or a term() that waits."""
    if lock is not None and not lock.acquire(timeout=_CLOSE_LOCK_WAIT_S):
        log.warning("a %s's socket is still in use by another thread after %ss: left open", owner_name,
                    _CLOSE_LOCK_WAIT_S)
        return
    try:
        for socket in sockets:
            if not socket.closed:
                socket.close(linger=0)
        context.destroy(linger=0)  # closes any socket made in it past `sockets` (none today), then terms
    finally:
        if lock is not None:
            lock.release()
