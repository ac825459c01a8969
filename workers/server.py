"""The client-facing HTTP/1.1 server: one asyncio Protocol per connection driving the codec.

It reads a request head (with the strict checks h11 does not make), reads the bounded body, then
hands an ``Exchange`` to the proxy. Responses go out through the same codec, so keep-alive,
pipelining (answered in order) and HTTP/1.0 close semantics come from one state machine. When the
framing of a request is in doubt the answer is written raw and the connection is closed: nothing
else is read from it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from workers import codec
from workers.codec import raw_response
from workers.errors import GatewayError, error_body, error_headers
from workers.framing import ChunkedBodyGuard, check_request_head

log = logging.getLogger("gridgate.server")

_perf = time.perf_counter
# Pipelined bytes buffered while a request is being answered before we stop reading the socket.
_PIPELINE_BUFFER_LIMIT = 65536
_HEAD, _BODY, _HANDLING, _CLOSED = range(4)
_LINGER_S = 2.0
_FRESH_GRACE_S = 1.0


class ServerSettings:
    """What every connection of a worker needs, resolved once from the config."""

    __slots__ = (
        "max_header_bytes", "max_body_bytes", "max_url_bytes", "max_connections",
        "header_read_s", "keepalive_idle_s",
    )

    def __init__(self, config: Any) -> None:
        limits, timeouts = config.limits, config.timeouts
        self.max_header_bytes = limits.max_header_bytes
        self.max_body_bytes = limits.max_body_bytes
        self.max_url_bytes = limits.max_url_bytes
        self.max_connections = limits.max_connections_per_worker
        self.header_read_s = float(timeouts.header_read)
        self.keepalive_idle_s = float(timeouts.keepalive_idle)


class ServerState:
    """Per-worker server state shared by all connections: settings, handler, live connections."""

    def __init__(self, settings: ServerSettings, handler: Callable[[Exchange], Awaitable[None]]) -> None:
        self.settings = settings
        self.handler = handler
        self.connections: set[ServerConnection] = set()
        self.draining = False
        self.in_flight = 0
        # Called with the status of every request rejected before it reached the proxy (metrics).
        self.on_reject: Callable[[int], None] | None = None

    def close_idle(self, now: float) -> None:
        """Draining: close keep-alive connections between requests.

        A connection accepted moments ago has not had the chance to send its first request: it keeps
        ``_FRESH_GRACE_S`` to do so (and is then answered with ``Connection: close``).
        """
        for conn in list(self.connections):
            if conn.exchange is None and conn.state == _HEAD and not conn.head_started:
                if conn.served or now - conn.opened_at > _FRESH_GRACE_S:
                    conn.close()

    def has_fresh_connections(self, now: float) -> bool:
        return any(not conn.served and now - conn.opened_at <= _FRESH_GRACE_S for conn in self.connections)


class Exchange:
    """One request and the means to answer it. The proxy owns it until ``end``/``abort``."""

    __slots__ = (
        "conn", "method", "target", "version", "headers", "body", "t_start", "started", "finished",
        "close_after", "on_client_lost", "on_pause_writing", "on_resume_writing", "peer",
    )

    def __init__(
        self, conn: ServerConnection, method: bytes, target: bytes, version: bytes,
        headers: list[tuple[bytes, bytes]], body: bytes, t_start: float,
    ) -> None:
        self.conn = conn
        self.method = method
        self.target = target
        self.version = version
        self.headers = headers
        self.body = body
        self.t_start = t_start
        self.started = False
        self.finished = False
        self.close_after = False
        self.on_client_lost: Callable[[], None] | None = None
        self.on_pause_writing: Callable[[], None] | None = None
        self.on_resume_writing: Callable[[], None] | None = None
        self.peer = conn.peer

    @property
    def client_gone(self) -> bool:
        return self.conn.state == _CLOSED

    @property
    def client_paused(self) -> bool:
        """The client's socket buffer is above its high-water mark (it reads slower than we write)."""
        return self.conn.writing_paused

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Queue the response head; bytes leave on ``flush`` or ``end`` (one syscall per burst)."""
        self.started = True
        conn = self.conn
        if conn.server.draining or self.close_after:
            headers.append((b"connection", b"close"))
        conn.pending.append(conn.codec.send(codec.response_event(status, headers)))

    def write(self, data: bytes) -> None:
        if data and not self.finished:
            conn = self.conn
            try:
                conn.pending.append(conn.codec.send(codec.Data(data=data)))
            except codec.LocalProtocolError:
                # More bytes than the declared Content-Length (or no head yet): the framing we
                # promised cannot be kept, so the client must see a cut, not a false end.
                self.abort()

    def flush(self) -> None:
        self.conn.flush()

    def end(self) -> None:
        if self.finished:
            return
        conn = self.conn
        try:
            end_bytes = conn.codec.send(codec.EndOfMessage())
        except codec.LocalProtocolError:
            self.abort()  # fewer bytes than the declared Content-Length: cut, never a false end
            return
        self.finished = True
        conn.pending.append(end_bytes)
        conn.flush()
        conn.finish_exchange(self)

    def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        headers.append((b"content-length", b"%d" % len(body)))
        self.start(status, headers)
        if self.method != b"HEAD":  # a HEAD answer announces the length but carries no body
            self.write(body)
        self.end()

    def send_error(self, error: GatewayError, extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
        """Answer with an OpenAI-style error, or abort if the response already started."""
        if self.started:
            self.abort()
            return
        body = error_body(error.status, error.code, error.message, error.error_type)
        headers = [(b"content-type", b"application/json"), *error.headers, *(extra_headers or ())]
        if error.close:
            self.close_after = True
        self.respond(error.status, headers, body)

    def abort(self) -> None:
        """Drop the connection mid-response: the client sees truncated framing, never a false end."""
        if not self.finished:
            self.finished = True
            self.conn.flush()
            self.conn.finish_exchange(self, aborted=True)


class ServerConnection(asyncio.Protocol):
    __slots__ = (
        "server", "settings", "transport", "codec", "state", "exchange", "peer", "_timer",
        "_head_bytes", "_t_head", "_body", "_body_len", "_guard", "_framing", "_request",
        "_reading_paused", "_writing_paused", "_loop", "pending", "served", "opened_at", "_eof",
    )

    def __init__(self, server: ServerState) -> None:
        self.server = server
        self.settings = server.settings
        self.transport: asyncio.Transport | None = None
        self.codec = codec.server_codec(server.settings.max_header_bytes)
        self.state = _HEAD
        self.exchange: Exchange | None = None
        self.peer = b""
        self._timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        self._t_head = 0.0
        self._body: list[bytes] = []
        self._body_len = 0
        self._guard: ChunkedBodyGuard | None = None
        self._framing: Any = None
        self._request: Any = None
        self._reading_paused = False
        self._writing_paused = False
        self._loop = asyncio.get_running_loop()
        self.pending: list[bytes] = []
        self.served = 0
        self.opened_at = self._loop.time()
        self._eof = False

    # -- transport callbacks -------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        server = self.server
        if len(server.connections) >= self.settings.max_connections:
            body = error_body(503, "too_many_connections", "worker connection limit reached, retry")
            headers = [*error_headers(body), (b"retry-after", b"1"), (b"connection", b"close")]
            transport.write(raw_response(503, headers, body))  # type: ignore[attr-defined]
            self._linger_close()
            return
        server.connections.add(self)
        peer = transport.get_extra_info("peername")
        self.peer = peer[0].encode() if isinstance(peer, tuple) else b""
        self._arm(self.settings.header_read_s, self._on_idle_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self.state = _CLOSED
        self._cancel_timer()
        self.server.connections.discard(self)
        exchange = self.exchange
        if exchange is not None and not exchange.finished and exchange.on_client_lost is not None:
            exchange.on_client_lost()

    def eof_received(self) -> bool | None:
        """The client half-closed: answer what it already sent, then close."""
        self._eof = True
        if self.exchange is None and not self.codec.trailing_data[0]:
            self.close()
            return None
        return True  # keep our side open until the answer is written

    def pause_writing(self) -> None:
        self._writing_paused = True
        exchange = self.exchange
        if exchange is not None and exchange.on_pause_writing is not None:
            exchange.on_pause_writing()

    def resume_writing(self) -> None:
        self._writing_paused = False
        exchange = self.exchange
        if exchange is not None and exchange.on_resume_writing is not None:
            exchange.on_resume_writing()

    def data_received(self, data: bytes) -> None:
        state = self.state
        if state == _HANDLING:
            # Pipelined bytes: keep them in the codec until the current answer is done.
            self.codec.receive_data(data)
            if len(self.codec.trailing_data[0]) > _PIPELINE_BUFFER_LIMIT and not self._reading_paused:
                self._reading_paused = True
                self.transport.pause_reading()
            return
        if state == _HEAD:
            if self._head_bytes == 0:
                self._t_head = _perf()
                self._arm(self.settings.header_read_s, self._on_header_timeout)
            self._head_bytes += len(data)
        elif state == _BODY:
            # An idle deadline, not a total one: a steady upload of a large body keeps going.
            self._arm(self.settings.keepalive_idle_s, self._on_idle_timeout)
            if self._guard is not None:
                try:
                    self._guard.feed(data)
                except GatewayError as error:
                    self._reject(error)
                    return
        elif state == _CLOSED:
            return
        self.codec.receive_data(data)
        self._process()

    # -- parsing ---------------------------------------------------------------------------
    def _process(self) -> None:
        conn = self.codec
        try:
            while True:
                event = conn.next_event()
                kind = type(event)
                if kind is codec.Data:
                    self._body_len += len(event.data)
                    if self._body_len > self.settings.max_body_bytes:
                        raise GatewayError(413, "request_too_large",
                                           f"request body larger than {self.settings.max_body_bytes} bytes",
                                           close=True)
                    self._body.append(event.data)
                elif kind is codec.Request:
                    self._on_request_head(event)
                elif kind is codec.EndOfMessage:
                    self._dispatch()
                    return
                elif event is codec.NEED_DATA:
                    if self.state == _HEAD and self._head_bytes > self.settings.max_header_bytes:
                        raise GatewayError(431, "headers_too_large", "request header block too large", close=True)
                    return
                elif kind is codec.ConnectionClosed or event is codec.PAUSED:
                    self.close()
                    return
        except GatewayError as error:
            self._reject(error)
        except codec.RemoteProtocolError as error:
            status = error.error_status_hint
            code = "headers_too_large" if status == 431 else "invalid_request"
            self._reject(GatewayError(status, code, f"malformed HTTP request: {error}", close=True))

    def _on_request_head(self, event: Any) -> None:
        head_size = self._head_bytes - len(self.codec.trailing_data[0])
        settings = self.settings
        if head_size > settings.max_header_bytes:
            raise GatewayError(431, "headers_too_large", "request header block too large", close=True)
        self._cancel_timer()
        self._framing = check_request_head(
            event.method, event.target, event.http_version, event.headers,
            settings.max_url_bytes, settings.max_body_bytes,
        )
        self._request = event
        self.state = _BODY
        self._arm(settings.keepalive_idle_s, self._on_idle_timeout)
        if self._framing.chunked:
            self._guard = ChunkedBodyGuard(settings.max_body_bytes, settings.max_header_bytes)
            self._guard.feed(bytes(self.codec.trailing_data[0]))
        if self.codec.they_are_waiting_for_100_continue:
            self.write(self.codec.send(codec.InformationalResponse(status_code=100, headers=[])))

    def _dispatch(self) -> None:
        event = self._request
        body = self._body
        exchange = Exchange(
            self, event.method, self._framing.target, event.http_version, event.headers,
            bytes(body[0]) if len(body) == 1 else b"".join(body), self._t_head,
        )
        self._body = []
        self._body_len = 0
        self._guard = None
        self._request = None
        self.state = _HANDLING
        self.exchange = exchange
        self.server.in_flight += 1
        self._loop.create_task(self._run(exchange))

    async def _run(self, exchange: Exchange) -> None:
        try:
            await self.server.handler(exchange)
        except GatewayError as error:
            exchange.send_error(error)
        except Exception:
            log.exception("request handler failed")
            exchange.send_error(GatewayError(500, "internal_error", "the gateway failed to handle the request"))
        finally:
            if not exchange.finished:
                exchange.abort()

    # -- answering -------------------------------------------------------------------------
    def write(self, data: bytes) -> None:
        if self.state != _CLOSED:
            self.transport.write(data)

    def flush(self) -> None:
        pending = self.pending
        if pending:
            if self.state != _CLOSED:
                self.transport.write(pending[0] if len(pending) == 1 else b"".join(pending))
            pending.clear()

    @property
    def writing_paused(self) -> bool:
        return self._writing_paused

    @property
    def head_started(self) -> bool:
        return self._head_bytes > 0

    def finish_exchange(self, exchange: Exchange, aborted: bool = False) -> None:
        self.server.in_flight -= 1
        self.served += 1
        self.exchange = None
        if self.state == _CLOSED:
            return
        conn = self.codec
        if aborted or exchange.close_after or conn.our_state is codec.MUST_CLOSE or self.server.draining:
            self.close(abort=aborted)
            return
        try:
            conn.start_next_cycle()
        except codec.LocalProtocolError:
            self.close()
            return
        self.state = _HEAD
        self._head_bytes = len(conn.trailing_data[0])
        if self._eof and not self._head_bytes:
            self.close()
            return
        if self._reading_paused:
            self._reading_paused = False
            self.transport.resume_reading()
        if self._head_bytes:
            self._t_head = _perf()
            self._arm(self.settings.header_read_s, self._on_header_timeout)
            self._process()
        else:
            self._arm(self.settings.keepalive_idle_s, self._on_idle_timeout)

    def _reject(self, error: GatewayError) -> None:
        """Answer a request whose framing is in doubt, then close without reading more."""
        if self.state == _CLOSED:
            return
        if self.server.on_reject is not None:
            self.server.on_reject(error.status)
        body = error_body(error.status, error.code, error.message)
        headers = [*error_headers(body), *error.headers, (b"connection", b"close")]
        self.write(raw_response(error.status, headers, body))
        self._linger_close()

    def _linger_close(self) -> None:
        """Half-close and discard input for a moment before closing.

        Closing a socket with unread input makes the kernel send RST, which can destroy the error
        response we just wrote before the client reads it (the classic lingering-close problem).
        """
        self.state = _CLOSED
        self.server.connections.discard(self)
        transport = self.transport
        if transport.can_write_eof():
            transport.write_eof()
        self._arm(_LINGER_S, transport.close)

    def close(self, abort: bool = False) -> None:
        if self.state == _CLOSED:
            return
        self.state = _CLOSED
        self._cancel_timer()
        self.server.connections.discard(self)
        if abort:
            self.transport.abort()
        else:
            self.transport.close()

    # -- timers ----------------------------------------------------------------------------
    def _arm(self, delay: float, callback: Callable[[], None]) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(delay, callback)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_header_timeout(self) -> None:
        self._timer = None
        if self.state == _HEAD:
            self._reject(GatewayError(408, "request_timeout", "request header block not received in time"))

    def _on_idle_timeout(self) -> None:
        self._timer = None
        if self.state == _BODY:
            self._reject(GatewayError(408, "request_timeout", "request body not received in time"))
        elif self.state == _HEAD and self._head_bytes:
            self._on_header_timeout()
        elif self.state == _HEAD:
            self.close()
