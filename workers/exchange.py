"""One request and the means to answer it: the interface between the client connection
(workers/server.py) and whoever answers (the proxy)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

from gateway.http import codec
from gateway.http.errors import JSON_CONTENT_TYPE, ErrorReply, error_type_for, sse_error_event
from gateway.http.media import is_event_stream

if TYPE_CHECKING:
    from workers.server import ServerConnection

_perf = time.perf_counter
_SHUTDOWN_EVENT = sse_error_event(
    "gateway_shutdown", "the gateway shut down before this stream ended", error_type_for(503),
)


class ExchangeListener(Protocol):
    """What the party answering an exchange learns from the client connection."""

    def client_lost(self) -> None: ...
    def pause_writing(self) -> None: ...  # the client reads slower than we write: stop feeding it
    def resume_writing(self) -> None: ...


class Exchange:
    """One request and the means to answer it. The handler owns it until ``end``/``abort``.

    A handler may set ``listener`` (an ``ExchangeListener``) to learn that the client went away
    mid-exchange, or reads slower than we write.
    """

    __slots__ = (
        "conn", "method", "target", "version", "headers", "body", "t_start", "started", "finished",
        "close_after", "listener", "peer", "t_first_byte",
        "bytes_out", "response_headers", "admitted",
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
        self.listener: ExchangeListener | None = None
        self.peer = conn.peer
        # The head gate's verdict (workers/head_gate.py; None without a gate), taken off the connection so
        # an idle keep-alive connection holds nothing of its last request.
        self.admitted = conn.admitted
        conn.admitted = None
        self.t_first_byte = 0.0  # when the response head was queued (the access log's first_byte_ms)
        self.bytes_out = 0  # response body bytes written

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
        conn = self.conn
        # The last response of a connection: asked for, draining, or the per-connection request cap.
        close = self.close_after or conn.server.draining or conn.served + 1 >= conn.settings.max_requests
        conn.pending.append(conn.codec.response_head(status, headers, content_length, close))
        self.response_headers = headers  # as sent, framing included (read only at shutdown)

    def write(self, data: bytes) -> None:
        if data and not self.finished:
            self.bytes_out += len(data)
            conn = self.conn
            try:
                conn.pending.append(conn.codec.response_data(data))
            except codec.FramingError:
                # More bytes than the declared Content-Length: the framing we promised cannot be
                # kept, so the client must see a cut, not a false end.
                self.abort()

    def flush(self) -> None:
        self.conn.flush()

    def end(self) -> None:
        if self.finished:
            return
        conn = self.conn
        try:
            end_bytes = conn.codec.response_end()
        except codec.FramingError:
            self.abort()  # fewer bytes than the declared Content-Length: cut, never a false end
            return
        self.finished = True
        if end_bytes:
            conn.pending.append(end_bytes)
        conn.flush()
        conn.finish_exchange(self)

    def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.start(status, headers, len(body))
        if self.method != b"HEAD":  # a HEAD answer announces the length but carries no body
            self.write(body)
        self.end()

    def send_error(self, reply: ErrorReply, extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
        """Answer with an OpenAI-style error, or abort if the response already started."""
        if self.started:
            self.abort()
            return
        headers = [JSON_CONTENT_TYPE, *reply.headers, *(extra_headers or ())]
        if reply.close:
            self.close_after = True
        self.respond(reply.status, headers, reply.body())

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
        self.write(_SHUTDOWN_EVENT)
        self.end()
        return True

    def abort(self) -> None:
        """Drop the connection mid-response: the client sees truncated framing, never a false end."""
        if not self.finished:
            self.finished = True
            self.conn.flush()
            self.conn.finish_exchange(self, aborted=True)
