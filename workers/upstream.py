"""Upstream side: per endpoint, per worker, a keep-alive pool of HTTP/1.1 client connections.

A connection delivers the response to a *sink* through five callbacks (head, data, flush, end,
failed) instead of async iteration: streaming a chunk costs one method call, not a task switch.

A pooled connection serves every tenant in turn, so it goes back to the pool only when the codec says
its last answer ended beyond doubt (``ClientCodec.reusable``: one framing, a body its status allows,
nothing after the end); bytes that arrive while it sits idle close it too. Everything else (a
protocol error, a timeout, a client that left) closes it. See docs/upstream.md.

Deadlines use fields and one timer per connection that is re-armed only when it fires
(``last_activity`` moves the deadline; the timer re-checks), so a request costs no timer operations:
the response head's deadline, the read timeout (the provider's silence) and, while the client does not
read (its socket paused the relay), ``timeouts.client_stall``.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from typing import Protocol

from gateway.http import client_codec, codec
from gateway.request.failures import Failure
from gateway.request.fair_queue import FairQueue

_monotonic = time.monotonic
_COPY_BODY_BELOW = 65536
_INF = float("inf")
# Requests that may wait for one endpoint's connections in one worker; past it they are turned away at
# once (503), so a flood cannot grow the queue, or the time its last waiter would wait, without bound.
MAX_WAITERS = 4096


class UpstreamSink(Protocol):
    def upstream_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None: ...
    def upstream_data(self, data: bytes) -> None: ...
    def upstream_end(self) -> None: ...
    def upstream_flush(self) -> None: ...
    def upstream_failed(self, failure: Failure, detail: str) -> None: ...


class PoolExhausted(Exception):
    """Every connection of the endpoint is busy and none freed up in time (or too many already wait)."""


class ConnectFailed(Exception):
    def __init__(self, failure: Failure, detail: str) -> None:
        super().__init__(detail)
        self.failure = failure


class UpstreamConnection(asyncio.Protocol):
    __slots__ = (
        "pool", "transport", "codec", "sink", "reused", "closed", "last_activity", "_timer", "_timer_at",
        "_paused", "_loop", "slot_returned", "_head_deadline", "_got_head",
    )

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.codec = client_codec.ClientCodec()
        self.sink: UpstreamSink | None = None
        self.reused = False
        self.closed = False
        self.last_activity = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._head_deadline = _INF  # monotonic time by which the response head must have arrived
        self._got_head = False
        self._paused = False
        self._loop = pool.loop
        self.slot_returned = False

    # -- used by the request path ------------------------------------------------------------
    def send_request(
        self, sink: UpstreamSink, method: bytes, target: bytes, host: bytes, headers: list[tuple[bytes, bytes]],
        body: bytes, head_deadline: float = _INF,
    ) -> None:
        """Write the request; ``headers`` carry Content-Length (when there is a body), not Host.

        ``head_deadline`` (monotonic seconds): fail with TIMEOUT if no response head arrived by then.
        """
        self.sink = sink
        self._got_head = False
        self._head_deadline = head_deadline
        if self.closed:
            # The provider closed it between acquire and send: a retryable failure before any byte.
            self._fail(Failure.RESET, "connection closed before the request was sent")
            return
        head = self.codec.encode_request(method, target, host, headers)
        self.last_activity = _monotonic()
        if len(body) > _COPY_BODY_BELOW:
            self.transport.writelines((head, body))  # no copy of a large body
        else:
            self.transport.write(head + body if body else head)  # one write, one TLS record
        # The timer never sleeps longer than the pool's period, so a deadline at least that far away needs
        # no re-arm: in steady keep-alive traffic a request costs no timer operation.
        wake = min(self.last_activity + self.pool.read_timeout, head_deadline)
        if self._timer is None:
            self._arm(min(wake, self.last_activity + self.pool.timer_period))
        elif self._timer_at > wake:
            self._arm(wake)

    def pause(self) -> None:
        if not self._paused and not self.closed:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and not self.closed:
            self._paused = False
            self.last_activity = _monotonic()
            self.transport.resume_reading()

    def abandon(self) -> None:
        """The client went away mid-exchange: this connection's framing state is unknown, drop it."""
        self.sink = None
        self._finish(reusable=False)

    # -- transport callbacks -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.last_activity = _monotonic()
        sink = self.sink
        if sink is None:
            # Bytes nobody asked for (idle in the pool, or handed over and not yet sent on): they
            # would be read as the next request's answer. The provider is not speaking HTTP as we do.
            self.pool.discard(self)
            return
        parser = self.codec
        parser.feed(data)
        try:
            while self.sink is sink:  # a callback may have let go of this connection (client gone)
                event = parser.next_event()
                kind = type(event)
                if kind is codec.Body:
                    sink.upstream_data(event.data)
                elif kind is codec.ResponseHead:
                    self._on_head(sink, event)
                elif kind is codec.EndOfMessage:
                    self._on_end(sink)
                    return
                elif event is codec.NEED_DATA:
                    sink.upstream_flush()
                    return
                elif kind is codec.Informational:
                    continue
                else:  # ConnectionClosed or PAUSED
                    self._fail(Failure.RESET, "connection closed before the response completed")
                    return
        except client_codec.RefusedResponse as error:
            self._fail(Failure.MALFORMED, str(error))
        except codec.ParseError:
            if data:
                self._fail(Failure.MALFORMED, "malformed response")
            else:  # the provider closed the connection in the middle of a message
                self._fail(Failure.RESET, "connection closed before the response completed")

    def eof_received(self) -> bool | None:
        if self.sink is not None:
            self.data_received(b"")  # an empty feed is how the codec learns about EOF
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        was_closed = self.closed
        self.closed = True
        self._cancel_timer()
        if self.sink is not None:
            self._fail(Failure.RESET, "connection lost before the response completed")
        elif not was_closed:
            self.pool.connection_gone(self)

    # -- internals -----------------------------------------------------------------------------
    def _on_head(self, sink: UpstreamSink, event: codec.ResponseHead) -> None:
        self._got_head = True
        sink.upstream_head(event.status_code, self.codec.head_headers)

    def _on_end(self, sink: UpstreamSink) -> None:
        self.sink = None
        self._finish(self.codec.reusable)
        sink.upstream_end()

    def _fail(self, failure: Failure, detail: str) -> None:
        sink = self.sink
        self.sink = None
        self._finish(reusable=False)
        if sink is not None:
            sink.upstream_failed(failure, detail)

    def _finish(self, reusable: bool) -> None:
        if reusable:
            try:
                self.codec.next_cycle()
            except codec.FramingError:
                reusable = False
        if self._paused and reusable:
            self.resume()
        self.pool.release(self, reusable)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._cancel_timer()
            if self.transport is not None:
                self.transport.abort()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self, when: float) -> None:
        """(Re)arm the one timer of this connection at monotonic time ``when``."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = self._loop.call_later(max(when - _monotonic(), 0.0), self._on_timer)

    def _on_timer(self) -> None:
        """The head, read and client-stall deadlines: idle connections let the timer lapse (the next
        request re-arms it)."""
        self._timer = None
        if self.sink is None or self.closed:
            return
        now = _monotonic()
        if not self._got_head and now >= self._head_deadline:
            self._fail(Failure.TIMEOUT, "no response before the deadline")
            return
        pool = self.pool
        idle = now - self.last_activity  # while paused: since the bytes that filled the client's buffer
        if not self._paused:
            limit = pool.read_timeout
            if idle >= limit:
                self._fail(Failure.TIMEOUT, f"no response bytes for {limit:g}s")
                return
        elif self._got_head:
            # The stream waits on the client, not the provider: a client that reads nothing for this
            # long is cut, so that it cannot hold an upstream connection (a pool slot) forever.
            limit = pool.client_stall
            if idle >= limit:
                self._fail(Failure.CLIENT_STALLED, f"the client read nothing for {limit:g}s")
                return
        else:  # paused before the head (the client is behind on an earlier answer): the head deadline rules
            limit, idle = pool.timer_period, 0.0
        wake = min(max(now + limit - idle, now + 0.05), now + pool.timer_period)
        self._arm(wake if self._got_head else min(wake, self._head_deadline))


class UpstreamPool:
    """LIFO keep-alive pool for one endpoint in one worker, bounded by ``max_connections``.

    When every connection is busy, requests wait in a ``FairQueue``: a connection or a slot that frees
    up goes to interactive waiters before batch ones, and to the tenants of a class in turn.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        max_connections: int,
        connect_timeout: float,
        read_timeout: float,
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        wait_timeout: float | None = None,
        head_wait: float = _INF,
        client_stall: float = 60.0,
        max_waiters: int = MAX_WAITERS,
    ) -> None:
        self.host = host
        self.port = port
        self.max_connections = max_connections
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.ssl_context = ssl_context
        self.server_hostname = server_hostname
        self.wait_timeout = connect_timeout if wait_timeout is None else wait_timeout
        self.client_stall = client_stall  # a stream whose client reads nothing this long is cut
        # The longest a connection timer sleeps: the shortest deadline a request usually gets.
        self.timer_period = min(read_timeout, head_wait, client_stall)
        self.loop = asyncio.get_running_loop()
        self.idle: list[UpstreamConnection] = []
        self.open_count = 0
        self._waiters: FairQueue[asyncio.Future[UpstreamConnection | None]] = FairQueue(max_waiters)

    def try_acquire(self) -> UpstreamConnection | None:
        """An idle keep-alive connection, without awaiting; None when a connect or a wait is needed."""
        idle = self.idle
        while idle:
            conn = idle.pop()
            if not conn.closed:
                conn.reused = True
                return conn
        return None

    async def acquire(
        self, fresh: bool = False, timeout: float = _INF, tenant: str = "", batch: bool = False,
    ) -> UpstreamConnection:
        """A connection for one exchange: idle (unless ``fresh``), newly opened, or handed over by a
        finishing exchange, within ``timeout`` seconds at most. Raises ConnectFailed or PoolExhausted.

        ``tenant`` and ``batch`` place the request among the waiters when every connection is busy.
        """
        idle = self.idle
        if fresh:
            if self.open_count >= self.max_connections and idle:
                self.release(idle.pop(), reusable=False)  # make room for the fresh connection
        else:
            conn = self.try_acquire()
            if conn is not None:
                return conn
        if self.open_count < self.max_connections:
            self.open_count += 1  # reserve the slot before the await
            return await self._connect(timeout)
        waiter: asyncio.Future[UpstreamConnection | None] = self.loop.create_future()
        if not self._waiters.push(waiter, tenant, batch):
            raise PoolExhausted(f"all {self.max_connections} connections busy, {len(self._waiters)} waiting")
        try:
            handed = await asyncio.wait_for(waiter, min(self.wait_timeout, timeout))
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                # Handed something just as we gave up: pass it on rather than leak it.
                got = waiter.result()
                if got is None:
                    self._slot_freed()
                else:
                    self.release(got, reusable=True)
            else:
                waiter.cancel()
                self._waiters.remove(waiter, tenant, batch)
            if isinstance(exc, TimeoutError):
                raise PoolExhausted(f"all {self.max_connections} connections busy") from None
            raise
        if handed is None:
            return await self._connect(timeout)  # a freed slot was handed to us, already counted
        handed.reused = True
        return handed

    async def _connect(self, timeout: float = _INF) -> UpstreamConnection:
        """Open a connection for a slot the caller has already counted in ``open_count``."""
        limit = min(self.connect_timeout, timeout)
        try:
            _transport, conn = await asyncio.wait_for(
                self.loop.create_connection(
                    lambda: UpstreamConnection(self), self.host, self.port,
                    ssl=self.ssl_context, server_hostname=self.server_hostname if self.ssl_context else None,
                ),
                max(limit, 0.0),
            )
        except TimeoutError:
            self._slot_freed()
            detail = f"connect timed out after {max(limit, 0.0):.3g}s"
            raise ConnectFailed(Failure.CONNECT_TIMEOUT, detail) from None
        except ssl.SSLError as error:
            self._slot_freed()
            raise ConnectFailed(Failure.REFUSED, f"TLS handshake failed: {error.reason or 'error'}") from None
        except OSError as error:
            self._slot_freed()
            raise ConnectFailed(Failure.REFUSED, (error.strerror or "connection failed").lower()) from None
        except BaseException:
            self._slot_freed()
            raise
        return conn

    def release(self, conn: UpstreamConnection, reusable: bool) -> None:
        if reusable and not conn.closed:
            if self._waiters.size:
                waiter = self._next_waiter()
                if waiter is not None:
                    waiter.set_result(conn)
                    return
            self.idle.append(conn)
            return
        conn.close()
        if not conn.slot_returned:  # a connection frees its slot once, however many paths end it
            conn.slot_returned = True
            self._slot_freed()

    def discard(self, conn: UpstreamConnection) -> None:
        """Close a connection that must not carry another request, wherever it is (idle or handed over)."""
        try:
            self.idle.remove(conn)
        except ValueError:
            pass
        self.release(conn, reusable=False)

    def connection_gone(self, conn: UpstreamConnection) -> None:
        """An idle connection was closed by the provider: drop it so it is never reused."""
        try:
            self.idle.remove(conn)
        except ValueError:
            return
        if not conn.slot_returned:
            conn.slot_returned = True
            self._slot_freed()

    def _slot_freed(self) -> None:
        """Hand the slot to the next waiter (it stays counted), else give it back."""
        waiter = self._next_waiter()
        if waiter is not None:
            waiter.set_result(None)
            return
        self.open_count -= 1

    def _next_waiter(self) -> asyncio.Future[UpstreamConnection | None] | None:
        """The next waiter in fair order that still waits. A waiter whose wait just ended (timed out or
        cancelled, its task not yet resumed to take itself out of the queue) is skipped."""
        waiters = self._waiters
        while (waiter := waiters.pop()) is not None:
            if not waiter.done():
                return waiter
        return None

    def close(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle.clear()
