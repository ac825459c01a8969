"""One request and the means to answer it: the interface between the client connection
(workers/server.py) and whoever answers (the proxy).

The exchange talks to its connection through a few methods (``ExchangeConnection``): queue the
response's head, data and end (framed by the connection's codec), flush, and hand the connection back
when the exchange is over. The response's end (``end`` or ``abort``) closes the request's record first
(``record``: workers/request_record.py), so the request's metrics and settlement are done before the
client can read its last byte.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from gateway.http import codec
from gateway.http.errors import (
    ANTHROPIC_SHAPE,
    JSON_CONTENT_TYPE,
    OPENAI_SHAPE,
    ErrorReply,
    error_type_for,
    sse_error_event_in,
)
from gateway.http.media import is_event_stream

log = logging.getLogger("gridgate.server")
_perf = time.perf_counter
# By error shape (the request's API: gateway/request/surfaces.py).
_SHUTDOWN_EVENTS = tuple(sse_error_event_in(
    shape, "gateway_shutdown", "the gateway shut down before this stream ended", error_type_for(503),
) for shape in (OPENAI_SHAPE, ANTHROPIC_SHAPE))


class ExchangeListener(Protocol):
    """What the party answering an exchange learns from the client connection."""

    def client_lost(self) -> None: ...
    def pause_writing(self) -> None: ...  # the client reads slower than we write: stop feeding it
    def resume_writing(self) -> None: ...


class RequestEnd(Protocol):
    """The request's record: closed once, when the response ends (or by its handler, for other exits)."""

    error: str | None  # why the response ended early, when the exchange itself ended it

    def close(self) -> None: ...


class ExchangeConnection(Protocol):
    """What an exchange needs from the client connection it answers on (workers/server.py)."""

    peer: bytes  # the client's address

    @property
    def closed(self) -> bool: ...  # the client is gone

    @property
    def writing_paused(self) -> bool: ...  # its socket buffer is above the high-water mark

    # Queue response bytes, framed by the connection's codec (``codec.FramingError`` when the body breaks
    # the declared framing); nothing leaves before ``flush``. ``close_requested``: the last response.
    def queue_head(self, status: int, headers: list[tuple[bytes, bytes]], content_length: int | None,
                   close_requested: bool) -> None: ...
    # A whole response whose head and body were framed once by whoever made it (False: nothing queued, the
    # request needs the general framing: ``ServerCodec.whole_response``).
    def queue_whole(self, head: bytes, body: bytes, close_requested: bool) -> bool: ...
    def queue_data(self, data: bytes) -> None: ...
    def queue_end(self) -> None: ...
    def flush(self) -> None: ...
    def finish_exchange(self, exchange: Exchange, aborted: bool = False) -> None: ...


class Exchange:
    """One request and the means to answer it. The handler owns it until ``end``/``abort``.

    A handler may set ``listener`` (an ``ExchangeListener``) to learn that the client went away
    mid-exchange, or reads slower than we write, and ``record`` (a ``RequestEnd``), closed when the
    response ends, before its last bytes are flushed.
    """

    __slots__ = (
        "conn", "method", "target", "version", "headers", "body", "t_start", "started", "finished",
        "close_after", "listener", "peer", "t_first_byte", "bytes_out", "response_headers", "admitted",
        "record",
    )

    def __init__(
        self, conn: ExchangeConnection, method: bytes, target: bytes, version: bytes,
        headers: list[tuple[bytes, bytes]], body: bytes, t_start: float, admitted: object = None,
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
        self.listener: ExchangeListener | None = None
        self.peer = conn.peer
        self.admitted = admitted  # the head gate's verdict (workers/head_gate.py; None without a gate)
        self.t_first_byte = 0.0  # when the response head was queued (the access log's first_byte_ms)
        self.bytes_out = 0  # response body bytes written
        self.record: RequestEnd | None = None

    @property
    def client_gone(self) -> bool:
        return self.conn.closed

    @property
    def client_paused(self) -> bool:
        """The client's socket buffer is above its high-water mark (it reads slower than we write)."""
        return self.conn.writing_paused

    def start(self, status: int, headers: list[tuple[bytes, bytes]], content_length: int | None = None) -> None:
        """Queue the response head; bytes leave on ``flush`` or ``end`` (one syscall per burst).

        ``headers`` hold no framing headers: ``content_length`` None means chunked (or until close).
        """
        self.started = True
        self.t_first_byte = _perf()
        admitted = self.admitted
        if admitted is not None and admitted.cors:  # an allowed origin's page may read it (docs/cors.md)
            headers = [*headers, *admitted.cors]
        self.conn.queue_head(status, headers, content_length, self.close_after)
        self.response_headers = headers  # as sent, framing included (read only at shutdown)

    def write(self, data: bytes) -> None:
        if data and not self.finished:
            self.bytes_out += len(data)
            try:
                self.conn.queue_data(data)
            except codec.FramingError:
                # More bytes than the declared Content-Length: the framing we promised cannot be
                # kept, so the client must see a cut, not a false end.
                self.abort()

    def flush(self) -> None:
        self.conn.flush()

    def answer_whole(self, head: bytes, body: bytes, body_bytes: int) -> bool:
        """``start``, ``write`` and ``end`` in one step, for a response the gateway made ready itself: ``head``
        and ``body`` framed already (``ServerCodec.whole_response``; ``body_bytes``: the body's own length).
        False, nothing done: the request takes the general framing (HTTP/1.0, HEAD, an allowed origin's
        CORS fields)."""
        admitted = self.admitted
        conn = self.conn
        if (self.started or (admitted is not None and admitted.cors)
                or not conn.queue_whole(head, body, self.close_after)):
            return False
        self.started = self.finished = True
        self.t_first_byte = _perf()
        self.bytes_out = body_bytes
        self.response_headers = []  # (read only for an unfinished stream at shutdown)
        self._over(conn, False)
        return True

    def end(self) -> None:
        if self.finished:
            return
        conn = self.conn
        try:
            conn.queue_end()
        except codec.FramingError:
            self.abort()  # fewer bytes than the declared Content-Length: cut, never a false end
            return
        self.finished = True
        self._over(conn, False)

    def _over(self, conn: ExchangeConnection, aborted: bool) -> None:
        """The response is complete or cut: close the request's record, then let the bytes go. A failure
        to account for the request never keeps its answer (or the relay that ends it) from finishing."""
        record = self.record
        try:
            if record is not None:
                self.record = None
                record.close()
        except Exception:
            log.exception("closing a request's record failed")
        finally:
            conn.flush()
            conn.finish_exchange(self, aborted)

    def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.start(status, headers, len(body))
        if self.method != b"HEAD":  # a HEAD answer announces the length but carries no body
            self.write(body)
        self.end()

    @property
    def error_shape(self) -> int:
        """The shape of the gateway's errors for this request's API (``route.surface.errors``)."""
        admitted = self.admitted
        return OPENAI_SHAPE if admitted is None else admitted.route.surface.errors

    def send_error(self, reply: ErrorReply, extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
        """Answer with an error in the shape of the request's API, or abort if the response already started."""
        if self.started:
            self.abort()
            return
        headers = [JSON_CONTENT_TYPE, *reply.headers, *(extra_headers or ())]
        if reply.close:
            self.close_after = True
        self.respond(reply.status, headers, reply.body(self.error_shape))

    def end_stream_for_shutdown(self) -> bool:
        """End an unfinished event stream with the ``gateway_shutdown`` error event and a proper last
        chunk; False (nothing done) for anything else, which can only be cut."""
        if self.finished or not self.started:
            return False
        content_type = None
        for name, value in self.response_headers:
            if name == b"content-length":
                return False  # a length-framed body cannot take an extra event
            if name == b"content-type":
                content_type = value
        if not is_event_stream(content_type):
            return False
        self.close_after = True  # the connection closes after this last chunk
        if self.record is not None:
            self.record.error = "gateway_shutdown"  # the access line says why the stream ended here
        self.write(_SHUTDOWN_EVENTS[self.error_shape])
        self.end()
        return True

    def abort(self) -> None:
        """Drop the connection mid-response: the client sees truncated framing, never a false end."""
        if not self.finished:
            self.finished = True
            self._over(self.conn, True)
