"""The errors a RolloutClient raises besides the engine's own ValueError / TypeError.

A bad argument is refused by the engine with a ValueError or TypeError naming the field
(FileNotFoundError for a path that is not there), and the client raises that same type
with the same message, as in-process. Everything else the engine refuses arrives as
EngineError (its type named in the message), a RuntimeError as most such refusals are
in-process (e.g. a new request while the engine is asleep). The two failures that are not the
engine's answer, a dead engine and a slow one, have types of their own so that a caller
can tell "retry later" from "start a new engine".
"""

from __future__ import annotations


class ProtocolError(ValueError):
    """A message that does not follow the wire format: malformed, oversized, wrong types."""


class EngineError(RuntimeError):
    """The engine refused or failed a call (its exception type leads the message)."""

    def __init__(self, error_type: str, message: str) -> None:
        super().__init__(f"{error_type}: {message}")
        self.error_type = error_type


class EngineDeadError(ConnectionError):
    """The engine process is gone (exited, killed, or stopped answering heartbeats)."""


class EngineTimeoutError(TimeoutError):
    """The engine is alive but did not answer a call within its timeout."""
