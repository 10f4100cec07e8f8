"""A free TCP port on this host, for rendezvous stores and weight-sync endpoints.

The port is free when asked; nothing reserves it until the caller binds it.
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
