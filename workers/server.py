"""The client-facing HTTP/1.1 server: one asyncio Protocol per connection driving the codec.

It reads a request head (with the strict checks h11 does not make), reads the bounded body, then
hands an ``Exchange`` to the request handler. Responses are framed by the same connection's codec, so
keep-alive, pipelining (answered in order) and HTTP/1.0 close semantics live in one place. When the
framing of a request is in doubt the answer is written raw and the connection is closed: nothing
else is read from it.

Keep-alive ends on purpose in two cases (docs/operations.md, "Drains and listening sockets"): the
response that reaches ``limits.max_requests_per_connection`` says ``Connection: close`` (so clients
reconnect and spread onto replaced or added workers), and so does every response of a draining
worker. A drain closes a connection only after such a response or once it sat idle for
``_DRAIN_IDLE_S`` (workers/server_state.py): a client that is sending a request is never cut. Streams
still open at the graceful deadline end with an SSE error event.

Deadlines: one timer per connection, re-armed only when it fires. A connection keeps a deadline
(header block, whole body, keep-alive idle, answers left unread) in a field; the timer never sleeps
longer than the shortest timeout, so moving the deadline later or earlier by at least that much never
needs a re-arm, and a request costs no timer operations at all.

Bounds (docs/conformance.md): one request is parsed at a time, and the next one only once the answer
before it ended and the client reads its answers (the transport is below its write high-water mark);
bytes received beyond the request being read stop the reading of the socket past
``_PIPELINE_BUFFER_LIMIT``; the body bytes a worker holds are counted against
``limits.max_buffered_body_bytes_per_worker``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable

from gateway.http import codec
from gateway.http.errors import ErrorReply, GatewayError, HeadWait
from gateway.http.framing import ChunkedDecoder, RequestFraming, check_request_head
from workers.exchange import Exchange
from workers.raw_answers import raw_answer
from workers.server_state import ServerState

log = logging.getLogger("gridgate.server")

_perf = time.perf_counter
_INF = float("inf")
# Bytes of later requests (pipelined) buffered before the socket is no longer read: in every state but
# the reading of a head (bounded by limits.max_header_bytes) or a body (consumed as it arrives).
_PIPELINE_BUFFER_LIMIT = 65536
# A transport may deliver what it had read after pause_reading (TLS records already decrypted): past
# this, the connection is dropped rather than buffering on (a plain socket stays below 320 KiB).
_PIPELINE_HARD_LIMIT = 1048576
# _UNREAD: between requests, the client has not read its answers; nothing is parsed until it does.
# _GATED: the head gate waits before it judges the head (``HeadWait``); nothing is read or parsed meanwhile.
_HEAD, _BODY, _HANDLING, _UNREAD, _CLOSED, _GATED = range(6)
_LINGER_S = 2.0
_HANDLER_FAILED = ErrorReply(500, "internal_error", "the gateway failed to handle the request")
# What a deadline means when it passes.
_ON_IDLE, _ON_HEADER, _ON_BODY, _ON_UNREAD = range(4)


class ServerConnection(asyncio.Protocol):
    __slots__ = (
        "server", "settings", "transport", "codec", "state", "exchange", "peer", "_timer", "_deadline",
        "_on_deadline", "_head_bytes", "_t_head", "_body", "_body_len", "_body_counted", "_framing", "_request",
        "_headers", "_reading_paused", "writing_paused", "_loop", "pending", "served", "_eof", "auth_memo", "jwt_memo",
        "admitted", "peer_identity", "head_waited", "_answering", "_next_ready",
    )

    def __init__(self, server: ServerState) -> None:
        self.server = server
        self.settings = server.settings
        self.transport: asyncio.Transport | None = None
        self.codec = codec.ServerCodec(server.settings.max_header_bytes, server.settings.max_header_count)
        self.state = _HEAD
        self.exchange: Exchange | None = None
        self.peer = b""
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = _INF
        self._on_deadline = _ON_IDLE
        self._head_bytes = 0
        self._t_head = 0.0
        self._body: list[bytes] = []
        self._body_len = 0
        self._body_counted = 0  # this request's share of ServerState.body_bytes
        self._framing: RequestFraming | None = None
        self._request: codec.RequestHead | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self.auth_memo: tuple[bytes, bytes, str] | None = None  # the head gate's: the last key admitted here
        self.jwt_memo: tuple[bytes, bytes, object] | None = None  # the head gate's: the last token granted here
        self.admitted: object = None  # the head gate's verdict on the current request (exchange.admitted)
        self.peer_identity: object = False  # the mTLS identity (workers/cert_gate.py); False: not read yet
        self.head_waited = False  # the head gate judges the current head again after its wait
        self._reading_paused = False
        self.writing_paused = False
        self._loop = asyncio.get_running_loop()
        self.pending: list[bytes] = []
        self.served = 0
        self._eof = False
        # Inside the handler's call in _dispatch; the request was answered inside it (parse the next one).
        self._answering = self._next_ready = False

    # -- transport callbacks -------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        server = self.server
        if len(server.connections) >= self.settings.max_connections:
            reply = ErrorReply(503, "too_many_connections", "worker connection limit reached, retry",
                               [(b"retry-after", b"1")])
            transport.write(raw_answer(reply))  # type: ignore[attr-defined]
            self._linger_close()
            return
        server.connections.add(self)
        peer = transport.get_extra_info("peername")
        self.peer = peer[0].encode() if isinstance(peer, tuple) else b""
        self._set_deadline(self.settings.header_read_s, _ON_IDLE)

    def connection_lost(self, exc: Exception | None) -> None:
        self.state = _CLOSED
        self._cancel_timer()
        self.server.connections.discard(self)
        self._uncount_body()
        exchange = self.exchange
        if exchange is not None and not exchange.finished and exchange.listener is not None:
            exchange.listener.client_lost()

    def eof_received(self) -> bool | None:
        """The client half-closed: answer the requests it sent whole, then close. A request cut short
        by the half-close is answered 400 (it can never complete)."""
        self._eof = True
        self.codec.feed(b"")
        if self.state == _HEAD or self.state == _BODY:
            self._process()
        # Keep our side open until the answers are written (an idle connection is closed already).
        return None if self.state == _CLOSED else True

    def pause_writing(self) -> None:
        self.writing_paused = True
        exchange = self.exchange
        if exchange is not None and exchange.listener is not None:
            exchange.listener.pause_writing()

    def resume_writing(self) -> None:
        self.writing_paused = False
        exchange = self.exchange
        if exchange is not None and exchange.listener is not None:
            exchange.listener.resume_writing()
        if self.state == _UNREAD and self._next_request():  # the client reads its answers again: on to the next
            self._process()

    def data_received(self, data: bytes) -> None:
        state = self.state
        if state == _HEAD:
            if self._head_bytes == 0:
                self._t_head = _perf()
                self._set_deadline(self.settings.header_read_s, _ON_HEADER)
            self._head_bytes += len(data)
        elif state != _BODY:  # the body deadline is a total one: arriving bytes do not renew it
            if state != _CLOSED:
                # Pipelined bytes: kept in the codec until the current answer is done and read.
                self.codec.feed(data)
                self._bound_backlog()
            return
        self.codec.feed(data)
        self._process()

    def _bound_backlog(self) -> None:
        """Bytes of later requests past the ceiling: stop reading the socket until they are parsed."""
        buffered = self.codec.buffered
        if buffered > _PIPELINE_BUFFER_LIMIT and not self._reading_paused:
            self._reading_paused = True
            self.transport.pause_reading()
        if buffered > _PIPELINE_HARD_LIMIT:
            log.warning("closing a connection that kept sending after reading was paused (%d bytes)", buffered)
            self.close(abort=True)

    # -- parsing ---------------------------------------------------------------------------
    def _process(self) -> None:
        parser = self.codec
        try:
            while True:
                event = parser.next_event()
                kind = type(event)
                if kind is codec.Body:
                    self._body_len += len(event.data)
                    if self._body_len > self._body_counted:  # chunked: its size is learnt as it arrives
                        self._count_body(self._body_len)
                    self._body.append(event.data)
                elif kind is codec.RequestHead:
                    self._on_request_head(event)
                elif kind is codec.EndOfMessage:
                    if self._dispatch() and self._next_request():  # answered at once: on to the next request
                        continue
                    return
                elif event is codec.NEED_DATA:
                    return
                else:  # ConnectionClosed, or PAUSED (cannot happen before the request ended)
                    self.close()
                    return
        except GatewayError as error:
            self._reject(error.reply)
        except HeadWait as wait:  # (the refusal path of an unknown kid only: never a request admitted at once)
            self._wait_on_gate(wait.until)
        except codec.NotHttp:
            self.close()  # e.g. https:// to the plain listener: nothing to answer, no request to log
        except codec.ParseError as error:
            code = "headers_too_large" if error.status == 431 else "invalid_request"
            self._reject(ErrorReply(error.status, code, f"malformed HTTP request: {error}", close=True))

    def _on_request_head(self, event: codec.RequestHead) -> None:
        self._request = event  # first: a refusal of this head is answered in its API's error shape
        settings = self.settings
        headers = self._headers = event.headers
        framing = self._framing = check_request_head(
            event.method, event.target, event.http_version, headers, settings.max_url_bytes, settings.max_body_bytes,
            event.plain,
        )
        gate = self.server.head_gate
        if gate is not None:
            # Key and route are decided before the body is read (and before any 100 Continue): a refusal
            # is answered at once and the connection closed, none of its body ever buffered.
            admitted = gate(self, event.method, framing.target, headers)
            if isinstance(admitted, ErrorReply):
                raise GatewayError(admitted)
            self.admitted = admitted
        if framing.content_length > 0:
            self._count_body(framing.content_length)  # counted whole before a byte of it is read
        self.state = _BODY
        self._set_deadline(settings.body_read_s, _ON_BODY)
        parser = self.codec
        if parser.expects_continue:
            self.write(codec.CONTINUE_RESPONSE)
        # The body is framed by the codec's own reader (h11 parses heads only): chunked bodies go through
        # the strict decoder, which accepts zero-padded sizes and limits the value.
        chunked = ChunkedDecoder(settings.max_body_bytes, settings.max_header_bytes) if framing.chunked else None
        parser.read_body(framing.content_length, chunked)

    def _wait_on_gate(self, until: Awaitable[None]) -> None:
        """The head gate needs a wait before its verdict (an unknown kid: docs/identity.md). The head is
        kept, nothing more is read from the socket or parsed (the body, pipelined requests: they stay in
        order behind it), and the gate judges the head again once ``until`` is done."""
        self.state = _GATED
        self._deadline = _INF  # the wait is bounded by the gate (unknown_kid_wait)
        if not self._reading_paused:
            self._reading_paused = True
            self.transport.pause_reading()
        self._loop.create_task(self._judge_after_wait(until))

    async def _judge_after_wait(self, until: Awaitable[None]) -> None:
        try:
            await asyncio.shield(until)  # shared by every request waiting on it: never cancel it for all
        except Exception:  # the wait itself failed: judge the head as it stands
            log.exception("head gate wait failed")
        if self.state != _GATED:  # the connection closed meanwhile
            return
        self.state = _HEAD
        self.head_waited = True
        try:
            self._on_request_head(self._request)  # type: ignore[arg-type]
        except GatewayError as error:
            self._reject(error.reply)
            return
        finally:
            self.head_waited = False
        if self._reading_paused and self.codec.buffered <= _PIPELINE_BUFFER_LIMIT:
            self._reading_paused = False
            self.transport.resume_reading()
        self._process()  # its body, as it was going to be read

    def _dispatch(self) -> bool:
        """Hand the request to the handler here and now: it returns None when it is over (a hit from the worker's
        copy, a refusal: no task), else the awaitable of the rest, which a task runs. True: it was answered
        at once and the next request may be parsed (by the caller's loop: no recursion per pipelined one)."""
        event = self._request
        framing = self._framing
        assert event is not None and framing is not None
        body = self._body
        exchange = Exchange(
            self, event.method, framing.target, event.http_version, self._headers,
            bytes(body[0]) if len(body) == 1 else b"".join(body), self._t_head, self.admitted,
        )
        self.admitted = None  # an idle keep-alive connection holds nothing of its last request
        self.codec.expect_response(event.method, event.http_version == b"1.1", framing.keep_alive)
        self._body = []
        self._body_len = 0
        self._request = None
        self.state = _HANDLING
        self._deadline = _INF
        self.exchange = exchange
        pending = None
        self._answering = True  # finish_exchange leaves the next request to this call's caller
        try:
            pending = self.server.handler(exchange)
        except Exception:
            log.exception("request handler failed")
            exchange.send_error(_HANDLER_FAILED)
        finally:
            if pending is None and not exchange.finished:
                exchange.abort()
            self._answering = False
        if pending is not None:
            self._loop.create_task(self._run(exchange, pending))
        if self._next_ready:
            self._next_ready = False
            return True
        if self.codec.buffered > _PIPELINE_BUFFER_LIMIT:  # later requests came with this one
            self._bound_backlog()
        return False

    def _count_body(self, size: int) -> None:
        """Count ``size`` bytes of the current request's body against the worker's budget, or refuse it."""
        settings = self.settings
        if size > settings.max_body_bytes:
            raise GatewayError(ErrorReply(
                413, "request_too_large", f"request body larger than {settings.max_body_bytes} bytes", close=True,
            ))
        server = self.server
        held = server.body_bytes + size - self._body_counted
        if held > settings.max_buffered_body:
            raise GatewayError(ErrorReply(
                503, "server_busy", "the gateway holds too many request bodies right now, retry",
                ((b"retry-after", b"1"),), close=True,
            ))
        server.body_bytes = held
        self._body_counted = size

    def _uncount_body(self) -> None:
        """The request ended or its connection died: its body no longer counts."""
        if self._body_counted:
            self.server.body_bytes -= self._body_counted
            self._body_counted = 0

    async def _run(self, exchange: Exchange, pending: Awaitable[None]) -> None:
        """The rest of a request the handler could not answer at once."""
        try:
            await pending
        except Exception:
            log.exception("request handler failed")
            exchange.send_error(_HANDLER_FAILED)
        finally:
            if not exchange.finished:
                exchange.abort()

    # -- answering -------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self.state == _CLOSED

    def write(self, data: bytes) -> None:
        if self.state != _CLOSED:
            self.transport.write(data)

    # The exchange's side (workers/exchange.py ExchangeConnection): framed, queued, written by ``flush``.
    def queue_head(self, status: int, headers: list[tuple[bytes, bytes]], content_length: int | None,
                   close_requested: bool) -> None:
        # The last response of a connection: asked for, draining, or the per-connection request cap.
        close = close_requested or self.server.draining or self.served + 1 >= self.settings.max_requests
        self.pending.append(self.codec.response_head(status, headers, content_length, close))

    def queue_whole(self, head: bytes, body: bytes, close_requested: bool) -> bool:
        """A whole response framed once (``ServerCodec.whole_response``); False: queued nothing."""
        close = close_requested or self.server.draining or self.served + 1 >= self.settings.max_requests
        data = self.codec.whole_response(head, body, close)
        if data is None:
            return False
        self.pending.append(data)
        return True

    def queue_data(self, data: bytes) -> None:
        self.pending.append(self.codec.response_data(data))

    def queue_end(self) -> None:
        end = self.codec.response_end()
        if end:
            self.pending.append(end)

    def flush(self) -> None:
        pending = self.pending
        if pending:
            if self.state != _CLOSED:
                self.transport.write(pending[0] if len(pending) == 1 else b"".join(pending))
            pending.clear()

    def idle_for(self, now: float) -> float:
        """Seconds this connection has waited for a request without receiving a byte of one; -1 when busy."""
        if self.state != _HEAD or self._head_bytes or self._on_deadline != _ON_IDLE:
            return -1.0
        # The idle deadline was set when the wait began (at open, or after the last response), so that
        # moment is the deadline minus its timeout: no per-request bookkeeping for a drain-only question.
        settings = self.settings
        return now - self._deadline + (settings.keepalive_idle_s if self.served else settings.header_read_s)

    def finish_exchange(self, exchange: Exchange, aborted: bool = False) -> None:
        self.served += 1
        self.exchange = None
        if self._body_counted:
            self._uncount_body()
        if self.state == _CLOSED:
            return
        parser = self.codec
        if aborted or exchange.close_after or parser.must_close:
            self.close(abort=aborted)
            return
        parser.next_cycle()
        if self.writing_paused:
            # The client does not read its answers: parse nothing more until it does (resume_writing),
            # and give up on it after the keep-alive timeout.
            self.state = _UNREAD
            self._set_deadline(self.settings.keepalive_idle_s, _ON_UNREAD)
            return
        if self._answering:  # answered inside _dispatch: its caller parses on (no recursion)
            self._next_ready = True
        elif self._next_request():
            self._process()

    def _next_request(self) -> bool:
        """Ready the connection for its next request; True: bytes of it (or the client's EOF) are there to parse."""
        parser = self.codec
        self.state = _HEAD
        buffered = self._head_bytes = parser.buffered
        if self._reading_paused and buffered <= _PIPELINE_BUFFER_LIMIT:
            self._reading_paused = False
            self.transport.resume_reading()
        if buffered or self._eof:
            self._t_head = _perf()
            self._set_deadline(self.settings.header_read_s, _ON_HEADER)
            return True
        self._set_deadline(self.settings.keepalive_idle_s, _ON_IDLE)
        return False

    def _reject(self, reply: ErrorReply) -> None:
        """Answer a request whose framing is in doubt, then close without reading more."""
        if self.state == _CLOSED:
            return
        if self.server.on_reject is not None:
            self.server.on_reject(reply)
        request = self._request  # the request this answers, when its head was read (its API, its Origin)
        target = None if request is None else request.target
        self.write(raw_answer(reply, target, self._headers, self.server.cors))
        self._linger_close()

    def _linger_close(self) -> None:
        """Half-close and discard input for a moment before closing.

        Closing a socket with unread input makes the kernel send RST, which can destroy the error
        response we just wrote before the client reads it (the classic lingering-close problem).
        """
        self.state = _CLOSED
        self.server.connections.discard(self)
        self._cancel_timer()
        self._uncount_body()
        transport = self.transport
        if transport.can_write_eof():
            transport.write_eof()
        self._timer = self._loop.call_later(_LINGER_S, transport.close)

    def close(self, abort: bool = False) -> None:
        if self.state == _CLOSED:
            return
        self.state = _CLOSED
        self._cancel_timer()
        self.server.connections.discard(self)
        self._uncount_body()
        if abort:
            self.transport.abort()
        else:
            self.transport.close()

    # -- deadlines -------------------------------------------------------------------------
    def _set_deadline(self, delay: float, meaning: int) -> None:
        now = self._loop.time()
        self._deadline = now + delay
        self._on_deadline = meaning
        if self._timer is None:
            self._timer = self._loop.call_at(now + min(delay, self.settings.timer_period_s), self._on_timer)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self) -> None:
        self._timer = None
        if self.state == _CLOSED or self._deadline == _INF:
            return  # re-armed by the next _set_deadline
        now = self._loop.time()
        if now < self._deadline:
            wake = min(self._deadline, now + self.settings.timer_period_s)
            self._timer = self._loop.call_at(wake, self._on_timer)
            return
        self._deadline = _INF
        meaning = self._on_deadline
        if meaning == _ON_BODY and self.state == _BODY:
            self._reject(ErrorReply(408, "request_timeout", "request body not received in time"))
        elif self.state == _HEAD and (meaning == _ON_HEADER or self._head_bytes):
            self._reject(ErrorReply(408, "request_timeout", "request header block not received in time"))
        elif self.state == _HEAD:
            self.close()
        elif meaning == _ON_UNREAD and self.state == _UNREAD:
            self.close(abort=True)  # its unread answers are dropped with it: no flush to a client that never reads
