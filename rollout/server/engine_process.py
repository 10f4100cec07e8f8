"""The engine process's loop: one zmq ROUTER socket, many clients, one Engine.

Each turn of the loop polls the socket (without waiting while requests run), handles
every message that came in, runs what other threads handed it (the text thread's frames
and stop hits, background weight-sync work), then steps the engine and hands the step's
new tokens and finished outputs to the text thread. Nothing here tokenizes, decodes or
encodes an output: the step loop's critical path is token ids, a poll and a queue put.

Guarantees:
- bound to loopback (an ipc:// path or tcp://127.0.0.1 / localhost / [::1]) unless the
  operator passes allow_remote: a client can load adapters from paths and point the
  engine at trainers, so the socket is not for the network by accident;
- a malformed, oversized or unknown message gets an error reply naming what is wrong (or,
  above max_frame_bytes, zmq drops that connection unread); nothing is unpickled; every
  other client keeps being served;
- a client found gone (a send to it fails: its connection closed, or zmq heartbeats
  went unanswered for client_timeout_s) has its requests aborted and their KV freed;
  clients owning requests are probed every probe_interval_s so that a silent one is noticed.

Which message does what is in optable.py (one row per op) and ops.py; who owns which
request in sessions.py.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass

import zmq

from rollout.server import protocol
from rollout.server.background import Background, BackgroundDone, Inbox, LoopCall
from rollout.server.errors import ProtocolError
from rollout.server.ops import DEFERRED, EngineOps
from rollout.server.optable import OPS
from rollout.server.sessions import Sessions
from rollout.server.text_worker import Outbound, StopHit, TextWorker, Tokenized
from rollout.validate import check_bool, check_float, check_int

log = logging.getLogger("rollout.server")

_LOOPBACK_TCP = ("tcp://127.0.0.1:", "tcp://localhost:", "tcp://[::1]:")


@dataclass(frozen=True)
class ServerConfig:
    address: str
    allow_remote: bool = False
    limits: protocol.Limits = protocol.Limits()
    client_timeout_s: float = 10.0  # zmq heartbeats unanswered this long: the client is gone
    probe_interval_s: float = 0.2  # how often clients owning requests are probed
    max_messages_per_turn: int = 256  # a flood of messages still lets the engine step

    def __post_init__(self) -> None:
        check_bool(self.allow_remote, "allow_remote")
        check_server_address(self.address, self.allow_remote)
        for name in ("client_timeout_s", "probe_interval_s"):
            if check_float(getattr(self, name), name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be > 0")
        check_int(self.max_messages_per_turn, "max_messages_per_turn", min=1)


def check_server_address(address: str, allow_remote: bool = False) -> str:
    """ipc:// or loopback tcp, unless allow_remote (then any tcp:// address zmq accepts)."""
    from weightsync.transports.ipc_wire import check_loopback_endpoint

    if not isinstance(address, str):
        raise TypeError(f"address={address!r}: expected a str")
    try:
        return check_loopback_endpoint(address)
    except ValueError:
        if allow_remote and address.startswith("tcp://"):
            return address
        if allow_remote:
            raise ValueError(f"address {address!r}: expected ipc:///path or tcp://HOST:PORT") from None
        raise ValueError(f"address {address!r} is not loopback: the engine serves ipc:///path or "
                         "tcp://127.0.0.1:PORT (localhost, [::1]) unless started with --allow-remote") from None


class EngineServer:
    def __init__(self, engine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.started = time.monotonic()
        self.sessions = Sessions()
        self.inbox = Inbox()
        self.background = Background(self.inbox)
        self.keep_text_off_loop()
        self.text = TextWorker(engine.tokenizer, self.inbox.post)
        self.ops = EngineOps(engine, self, self.sessions, self.text, self.background, config.limits, self.started)
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self._configure(self.socket)
        self.socket.bind(config.address)
        self.poller = zmq.Poller()
        self.poller.register(self.socket, zmq.POLLIN)
        self.poller.register(self.inbox.doorbell, zmq.POLLIN)
        self.running = True
        self.step_pending = False  # outputs may be waiting in the engine (a paused update aborted requests)
        self._last_probe = 0.0
        log.info("engine serving %s on %s", engine.config.model, config.address)

    def _configure(self, socket: zmq.Socket) -> None:
        c = self.config
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone client raises instead of vanishing
        socket.setsockopt(zmq.SNDHWM, 0)  # never drop an output for a slow reader
        socket.setsockopt(zmq.MAXMSGSIZE, c.limits.max_frame_bytes)
        socket.setsockopt(zmq.LINGER, 1000)
        timeout_ms = int(c.client_timeout_s * 1000)
        socket.setsockopt(zmq.HEARTBEAT_IVL, max(10, min(1000, timeout_ms // 4)))
        socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
        socket.setsockopt(zmq.HEARTBEAT_TTL, max(timeout_ms, 100))
        if c.address.startswith("tcp://["):
            socket.setsockopt(zmq.IPV6, 1)

    def keep_text_off_loop(self) -> None:
        """The engine's step decodes text for finished requests when it holds a tokenizer
        (rollout/core/outputs.py); here the text thread does it, so the step's outputs must
        come without. Prompts and stop strings never reach the engine as text either
        (ops.py tokenizes in the text thread and strips `stop`), so the intake's tokenizer
        is never used. Called again after wake(), in case waking rebuilt the outputs."""
        outputs = getattr(self.engine, "outputs", None)
        if outputs is not None:
            outputs.tokenizer = None

    # ---- the loop ------------------------------------------------------------------------------
    def serve_forever(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self.stop())
        try:
            while self.running:
                self.turn()
        finally:
            self.close()

    def stop(self) -> None:
        self.running = False

    def turn(self) -> None:
        ready = dict(self.poller.poll(0 if self._can_step() else int(self.config.probe_interval_s * 1000)))
        if self.socket in ready:
            self._receive()
        self._run_inbox()
        if self._can_step():
            self._step()
        now = time.monotonic()
        if now - self._last_probe >= self.config.probe_interval_s:
            self._last_probe = now
            self._probe(now)

    def _can_step(self) -> bool:
        if self.step_pending:
            return True
        if not self.engine.has_unfinished():
            return False
        # Asleep, accepted requests wait for wake() and a step does nothing: polling without
        # a wait then would spin a core.
        memory = getattr(self.engine, "memory", None)
        return memory is None or not (memory.asleep or memory.weights_discarded)

    def _receive(self) -> None:
        for _ in range(self.config.max_messages_per_turn):
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity, body = frames[0].bytes, [f.buffer for f in frames[1:]]
            self._handle(identity, body)

    def _handle(self, identity: bytes, body: list) -> None:
        try:
            call_id, request = protocol.decode_request(body, self.config.limits)
        except (ProtocolError, ValueError, TypeError) as error:
            log.info("refused a message from %s: %s", identity.hex(), error)
            self.send_error(identity, getattr(error, "call_id", None), error)
            return
        op = OPS[request.op]
        if op.finishes_requests:  # their outputs wait in the engine for the next step
            self.step_pending = True
        try:
            result = self.ops.run(op, identity, call_id, request)
        except Exception as error:
            self.send_error(identity, call_id, error)
            return
        if result is not DEFERRED:
            self.send(identity, protocol.Reply(call_id, result))

    def _run_inbox(self) -> None:
        for item in self.inbox.drain():
            if isinstance(item, Outbound):
                self.send_frames(item.identity, item.frames)
            elif isinstance(item, StopHit):
                self.abort_rids([item.rid])
            elif isinstance(item, Tokenized):
                self.ops.continue_tokenized(item)
            elif isinstance(item, LoopCall):
                item.run()
                self.step_pending = True
            elif isinstance(item, BackgroundDone):
                self.background.finished()
                if item.error is None:
                    self.send(item.identity, protocol.Reply(item.call_id, item.result))
                else:
                    self.send_error(item.identity, item.call_id, item.error)

    def _step(self) -> None:
        self.step_pending = False
        try:
            finished = self.engine.step()
        except Exception as error:
            log.exception("engine step failed")
            self._fail_all(error)
            return
        deltas = []
        with_deltas = self.sessions.with_deltas
        if with_deltas:
            # Reads the running requests' token lists (the one place the server looks inside
            # the engine's requests): new tokens since the last step, for streams and stop strings.
            for req in self.engine.scheduler.running:
                tracked = with_deltas.get(req.rid)
                if tracked is not None and len(req.output_ids) > tracked.sent:
                    deltas.append((req.rid, req.output_ids[tracked.sent :], req.logprobs[tracked.sent :]))
                    tracked.sent = len(req.output_ids)
        mine = [out for out in finished if self.sessions.untrack(out.request_id) is not None]
        if deltas or mine:
            self.text.step(deltas, mine)

    def _probe(self, now: float) -> None:
        """Clients that own requests but heard nothing lately get a probe: a send to a client
        whose connection is gone fails (ROUTER_MANDATORY), and that is how we learn of it."""
        for session in self.sessions:
            if now - session.last_sent >= self.config.probe_interval_s:
                self.send(session.identity, protocol.Probe())

    # ---- sending -------------------------------------------------------------------------------
    def send(self, identity: bytes, message: protocol.Message) -> None:
        self.send_frames(identity, protocol.encode_message(message))

    def send_error(self, identity: bytes, call_id: int | None, error: BaseException) -> None:
        message = str(error).replace(identity.hex() + "/", "")  # the client's ids, not the engine's
        self.send(identity, protocol.ErrorReply(call_id, type(error).__name__, message))

    def send_frames(self, identity: bytes, frames: list) -> None:
        try:
            self.socket.send_multipart([identity, *frames], zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as error:
            if error.errno != zmq.EHOSTUNREACH:
                raise
            self.client_gone(identity)
            return
        session = self.sessions.get(identity)
        if session is not None:
            session.last_sent = time.monotonic()

    # ---- requests leaving ----------------------------------------------------------------------
    def client_gone(self, identity: bytes) -> None:
        rids = self.sessions.drop(identity)
        if not rids:
            return
        for rid in rids:
            self.engine.abort(rid)  # frees its KV now; nobody is left to read the output
        self.text.forget(rids)
        log.info("client %s is gone: aborted its %d request(s)", identity.hex(), len(rids))

    def abort_rids(self, rids: list[str]) -> list[str]:
        """Abort requests that clients still follow: their outputs (finish_reason "abort", or
        "stop" for a stop-string hit) go to whoever waits for them. Returns those aborted."""
        aborted, outputs = [], []
        for rid in rids:
            if self.sessions.untrack(rid) is None:
                continue
            output = self.engine.abort(rid)
            if output is not None:
                aborted.append(rid)
                outputs.append(output)
        if outputs:
            self.text.step([], outputs)
        return aborted

    def _fail_all(self, error: Exception) -> None:
        """The engine's step raised: every request in it is suspect. Each client with calls
        open gets the error; the requests are aborted."""
        for session in self.sessions:
            for call_id in list(session.calls):
                self.send_error(session.identity, call_id, RuntimeError(f"the engine's step failed: {error}"))
            rids = self.sessions.drop(session.identity)
            for rid in rids:
                try:
                    self.engine.abort(rid)
                except Exception:
                    log.exception("abort of %s after a failed step", rid)
            self.text.forget(rids)

    def close(self) -> None:
        """Tell every client with calls open, then close the socket and end the context. The
        socket's linger (1 s) bounds how long term() waits to deliver those last errors: a
        client gone with its connection closed has them dropped at once, one that stopped
        reading with its connection up (stopped, or dropped and not yet collected) gets them
        only if it reads within that time. Telling failing leaves neither open behind it."""
        try:
            for session in self.sessions:
                for call_id in list(session.calls):
                    self.send_error(session.identity, call_id, RuntimeError("the engine process is shutting down"))
                for rid in self.sessions.drop(session.identity):
                    self.engine.abort(rid)
            for item in self.inbox.drain():
                if isinstance(item, LoopCall):  # a background thread waits on it: let it go
                    item.error = RuntimeError("the engine process is shutting down")
                    item.done.set()
            self.text.close()
        finally:
            self.socket.close(linger=1000)
            self.context.term()
            self.inbox.doorbell.close()
        log.info("engine process on %s stopped", self.config.address)

