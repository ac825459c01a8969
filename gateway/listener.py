"""The data-plane listening socket: ``SO_REUSEPORT``, so every worker of a host has its own.

The supervisor binds one per worker position and hands it to each generation's worker at that
position (gateway/supervisor/listeners.py); a worker started without a supervisor binds its own.
"""

from __future__ import annotations

import socket

from gateway.net import parse_host_port

BACKLOG = 2048


def bind_listener(address: str, backlog: int = BACKLOG) -> socket.socket:
    """A non-blocking listening socket on ``address`` that other ``SO_REUSEPORT`` sockets may share."""
    host, port = parse_host_port(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock
