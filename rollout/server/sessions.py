"""Which client owns which request: the loop's bookkeeping, one owner for it.

A client is known by its zmq routing id (random, set by the client). Its request ids
are prefixed with that id in hex inside the engine, so two clients may use the same ids,
and a client can abort or cancel only its own. A session exists while it owns requests;
when its client is found gone (a send to it fails: the connection closed, or zmq's
heartbeats timed out) the loop aborts what it owns.

Invariant: a request id is in `requests` of exactly one session and in `calls` of that
session under exactly one call id, from the moment the engine accepts it until its output
leaves the engine (finished or aborted).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field


@dataclass
class Tracked:
    """A request in the engine, from the loop's side."""

    rid: str  # the engine's id: session prefix + the client's id
    session: Session
    call_id: int
    base: str  # the client's id for the whole prompt (its samples are base-0, base-1, ... when n > 1)
    needs_deltas: bool  # streamed, or watched for stop strings: the text thread sees every step's tokens
    sent: int = 0  # tokens handed to the text thread so far


@dataclass
class Session:
    identity: bytes
    prefix: str
    requests: dict[str, Tracked] = field(default_factory=dict)
    calls: dict[int, set[str]] = field(default_factory=dict)  # call id -> its requests still in the engine
    last_sent: float = field(default_factory=time.monotonic)  # when a message last went to it
    _ids: itertools.count = field(default_factory=itertools.count)

    def new_base(self) -> str:
        return f"req-{next(self._ids)}"


def prefix_of(identity: bytes) -> str:
    return identity.hex() + "/"


class Sessions:
    def __init__(self) -> None:
        self._by_identity: dict[bytes, Session] = {}
        self.by_rid: dict[str, Tracked] = {}
        self.with_deltas: dict[str, Tracked] = {}  # the subset the loop reads every step

    def __len__(self) -> int:
        return len(self._by_identity)

    def __iter__(self):
        return iter(list(self._by_identity.values()))

    def get(self, identity: bytes) -> Session | None:
        return self._by_identity.get(identity)

    def open(self, identity: bytes) -> Session:
        session = self._by_identity.get(identity)
        if session is None:
            session = self._by_identity[identity] = Session(identity, prefix_of(identity))
        return session

    def discard_if_idle(self, identity: bytes) -> None:
        session = self._by_identity.get(identity)
        if session is not None and not session.requests:
            del self._by_identity[identity]

    def track(self, session: Session, rid: str, call_id: int, base: str, needs_deltas: bool) -> Tracked:
        tracked = Tracked(rid, session, call_id, base, needs_deltas)
        session.requests[rid] = tracked
        session.calls.setdefault(call_id, set()).add(rid)
        self.by_rid[rid] = tracked
        if needs_deltas:
            self.with_deltas[rid] = tracked
        return tracked

    def untrack(self, rid: str) -> Tracked | None:
        """The request left the engine; its session goes when it owns nothing more."""
        tracked = self.by_rid.pop(rid, None)
        if tracked is None:
            return None
        self.with_deltas.pop(rid, None)
        session = tracked.session
        session.requests.pop(rid, None)
        call = session.calls.get(tracked.call_id)
        if call is not None:
            call.discard(rid)
            if not call:
                del session.calls[tracked.call_id]
        if not session.requests:
            self._by_identity.pop(session.identity, None)
        return tracked

    def drop(self, identity: bytes) -> list[str]:
        """Forget a client; returns the engine ids of its requests (the caller aborts them)."""
        session = self._by_identity.pop(identity, None)
        if session is None:
            return []
        rids = list(session.requests)
        for rid in rids:
            self.by_rid.pop(rid, None)
            self.with_deltas.pop(rid, None)
        return rids

    def find(self, session: Session, request_id: str) -> list[str]:
        """A client's request id -> engine ids: that sample, or every sample of a prompt."""
        rid = session.prefix + request_id
        if rid in session.requests:
            return [rid]
        return [t.rid for t in session.requests.values() if t.base == request_id]
