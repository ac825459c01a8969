"""A worker's server state, shared by all its client connections (workers/server.py): the settings
resolved once from the config, the request handler, the live connections, and the drain and shutdown
steps over them."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

from gateway.config import Config
from gateway.http.errors import ErrorReply
from workers.exchange import Exchange
from workers.raw_answers import CorsPolicy

# Draining: a connection idle this long between requests (or since it opened) is closed. A client
# that just sent a request is answered (with `Connection: close`) instead.
_DRAIN_IDLE_S = 1.0
# After the graceful deadline: how long the last bytes of ended streams get to leave before exit.
_FLUSH_S = 1.0


class LiveConnection(Protocol):
    """What the state reads of a client connection (workers/server.py's ServerConnection)."""

    exchange: Exchange | None
    transport: asyncio.Transport

    def idle_for(self, now: float) -> float: ...

    def close(self, abort: bool = False) -> None: ...


class ServerSettings:
    """What every connection of a worker needs, resolved once from the config."""

    __slots__ = (
        "max_header_bytes", "max_header_count", "max_body_bytes", "max_url_bytes", "max_connections",
        "max_requests", "max_buffered_body", "header_read_s", "keepalive_idle_s", "body_read_s", "timer_period_s",
    )

    def __init__(self, config: Config) -> None:
        limits, timeouts = config.limits, config.timeouts
        self.max_header_bytes = limits.max_header_bytes
        self.max_header_count = limits.max_header_count
        self.max_body_bytes = limits.max_body_bytes
        self.max_url_bytes = limits.max_url_bytes
        self.max_connections = limits.max_connections_per_worker
        self.max_requests = limits.max_requests_per_connection
        self.max_buffered_body = limits.max_buffered_body_bytes_per_worker
        self.header_read_s = float(timeouts.header_read)
        self.keepalive_idle_s = float(timeouts.keepalive_idle)
        self.body_read_s = float(timeouts.body_read)
        # The connection timer never sleeps longer than the shortest deadline (see the module doc).
        self.timer_period_s = min(self.header_read_s, self.keepalive_idle_s, self.body_read_s)


class ServerState:
    """Per-worker server state shared by all connections: settings, handler, live connections."""

    def __init__(self, settings: ServerSettings, handler: Callable[[Exchange], Awaitable[None] | None]) -> None:
        self.settings = settings
        # Called in the read of each request (workers/server.py ``_dispatch``): None when it answered it at
        # once, else the awaitable of the rest (an ``async def`` handler's coroutine: all of it), run in a task.
        self.handler = handler
        self.connections: set[LiveConnection] = set()
        self.draining = False
        # Request body bytes held by this worker's connections (limits.max_buffered_body_bytes_per_worker).
        self.body_bytes = 0
        # Called with the answer to every request rejected before it reached the handler (metrics, access log).
        self.on_reject: Callable[[ErrorReply], None] | None = None
        # Decides on each request head, before its body is read (workers/head_gate.py): an ErrorReply
        # refuses the request (answered at once, the body never read, the connection closed); anything
        # else admits it and travels to the handler as ``exchange.admitted``.
        self.head_gate: Callable[[LiveConnection, bytes, bytes, list[tuple[bytes, bytes]]], object] | None = None
        self.cors: CorsPolicy | None = None  # the CORS policy (None: off) of the answers written here

    def close_idle(self, now: float) -> None:
        """Draining: close the connections that sat idle between requests for ``_DRAIN_IDLE_S``.

        The others are answered with ``Connection: close`` and closed after that response. Closing a
        connection the client has just sent a request on would reset that request, so an idle one
        gets a moment first (a connection accepted moments ago has not sent its first request yet).
        """
        for conn in list(self.connections):
            if conn.idle_for(now) >= _DRAIN_IDLE_S:
                conn.close()

    async def cut_remaining(self) -> None:
        """The graceful deadline passed: event streams end with an error event, everything else is cut."""
        ending = []
        for conn in list(self.connections):
            exchange = conn.exchange
            if exchange is not None and exchange.end_stream_for_shutdown():
                ending.append(conn)
            else:
                conn.close(abort=True)
        # The process exits next: give the ended streams' last bytes a moment to leave (kernel buffers
        # are sent after exit; only what is still queued in the event loop would be lost).
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _FLUSH_S
        while any(conn.transport.get_write_buffer_size() for conn in ending) and loop.time() < deadline:
            await asyncio.sleep(0.02)
