"""The data-plane listening sockets, owned by the supervisor: one per listen address and worker position.

Closing a ``SO_REUSEPORT`` listener resets the connections waiting in its accept queue (unless the
kernel migrates them, ``net.ipv4.tcp_migrate_req=1``). So, as nginx does with ``reuseport``, the
supervisor binds each socket once, before fork, and every generation's worker at that position
inherits the same socket: a reload or a crashed worker's replacement never closes a listener, and
what waits in its queue is accepted by whichever worker holds it next. A socket is closed only when
no serving worker holds its position any more (SIGTTOU, fewer workers after a reload, a moved
``listen``, a replacement that has to wait for its crash backoff, shutdown).
"""

from __future__ import annotations

import socket
from collections.abc import Iterable

from gateway.listener import bind_listener

# (listen address, worker position in its generation)
ListenerKey = tuple[str, int]


class ListenerSockets:
    """The bound sockets by key; the worker set decides which keys are held."""

    def __init__(self) -> None:
        self._sockets: dict[ListenerKey, socket.socket] = {}

    def acquire(self, key: ListenerKey) -> socket.socket:
        """The socket for ``key``, bound now if it is not yet; raises OSError when it cannot be bound."""
        sock = self._sockets.get(key)
        if sock is None:
            sock = self._sockets[key] = bind_listener(key[0])
        return sock

    def keep_only(self, held: Iterable[ListenerKey]) -> None:
        """Close every socket whose key is not ``held`` (a worker that still has it closes its own copy)."""
        keep = set(held)
        for key in [key for key in self._sockets if key not in keep]:
            self._sockets.pop(key).close()

    def fds(self, *, but: ListenerKey | None = None) -> list[int]:
        """Descriptors a forked child must close: all, except the one it serves on."""
        return [sock.fileno() for key, sock in self._sockets.items() if key != but]

    def keys(self) -> list[ListenerKey]:
        return sorted(self._sockets)


def lowest_free_position(taken: Iterable[int]) -> int:
    """The lowest worker position not in ``taken``: positions stay dense, so sockets are reused."""
    used = set(taken)
    position = 0
    while position in used:
        position += 1
    return position
