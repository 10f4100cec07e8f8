"""The engine as a service: an engine process (`python -m rollout.server --model DIR`) and
its clients, RolloutClient (blocking) and AsyncRolloutClient (asyncio), with the Engine's API.

pyzmq with msgpack headers and raw tensor frames; nothing is ever unpickled; loopback
(ipc:// or tcp://127.0.0.1) unless the engine is started with --allow-remote.

Layout: requests.py (one dataclass per op), optable.py (each op's Engine method and reply),
protocol.py (the wire), codec.py (bytes <-> checked values), engine_process.py (the loop),
ops.py (what each message does), sessions.py (who owns which request), text_worker.py +
text.py (tokenizing, detokenizing and stop strings off the loop), background.py (waits that
must not hold the loop), client.py / async_client.py / client_core.py (the clients),
launch.py + cli.py (starting the process).
"""

from rollout.server.async_client import AsyncRolloutClient
from rollout.server.client import PendingCall, RolloutClient
from rollout.server.errors import EngineDeadError, EngineError, EngineTimeoutError, ProtocolError
from rollout.server.protocol import HealthInfo, ModelInfo, StreamDelta

__all__ = [
    "AsyncRolloutClient", "EngineDeadError", "EngineError", "EngineTimeoutError", "HealthInfo", "ModelInfo",
    "PendingCall", "ProtocolError", "RolloutClient", "StreamDelta",
]
