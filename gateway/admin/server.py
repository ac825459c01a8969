"""The admin listener: serves an ``AdminApp`` over HTTP/1.1 (keep-alive) on the supervisor's loop.

Not a hot path, so clarity wins over speed. The socket is bound by the caller (the supervisor binds
before it forks, so a taken port fails at start); ``move_to`` swaps in another one on a reload that
changes ``admin.listen`` while the connections already open finish on the old one.
"""

from __future__ import annotations

import asyncio
import socket
from http import HTTPStatus

import h11

from gateway.admin.pages import AdminApp, AdminResponse, error_response

_MAX_HEAD_BYTES = 16 * 1024
_MAX_BODY_BYTES = 64 * 1024
_IDLE_TIMEOUT = 30.0


class AdminServer:
    """One per supervisor: the listener serving its ``AdminApp``."""

    def __init__(self, app: AdminApp) -> None:
        self._app = app
        self._sock: socket.socket | None = None
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.StreamWriter] = set()

    def fds(self) -> list[int]:
        """The listening socket and open connections: a forked child must close them."""
        fds = [] if self._sock is None else [self._sock.fileno()]
        for writer in self._connections:
            sock = writer.get_extra_info("socket")
            if sock is not None:
                fds.append(sock.fileno())
        return [fd for fd in fds if fd >= 0]

    async def start(self, sock: socket.socket) -> None:
        """Serve on ``sock`` (bound and listening); a previous listening socket is closed."""
        previous = self._server
        self._sock = sock
        self._server = await asyncio.start_server(self._serve_connection, sock=sock)
        if previous is not None:
            previous.close()
            await previous.wait_closed()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        self._sock = None

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD_BYTES)
        self._connections.add(writer)
        try:
            while True:
                request = await _read_request(conn, reader)
                if request is None:
                    break
                method = request.method.decode("ascii", "replace")
                response = await self._app.handle(method, request.target.decode("ascii", "replace"))
                await _send(conn, writer, response, head_only=method == "HEAD")
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is not h11.DONE:
                    break
                conn.start_next_cycle()
        except h11.RemoteProtocolError as exc:
            if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                status = exc.error_status_hint
                response = error_response(status, f"malformed request: {exc}", "bad_request")
                await _send(conn, writer, response, head_only=False, close=True)
        except (ConnectionError, TimeoutError, h11.LocalProtocolError):
            pass
        finally:
            self._connections.discard(writer)
            writer.close()


async def _read_request(conn: h11.Connection, reader: asyncio.StreamReader) -> h11.Request | None:
    """The next complete request (its body read and dropped), or None when the peer is done."""
    request: h11.Request | None = None
    body_bytes = 0
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await asyncio.wait_for(reader.read(65536), _IDLE_TIMEOUT)
            conn.receive_data(data)
        elif isinstance(event, h11.Request):
            request = event
        elif isinstance(event, h11.Data):
            body_bytes += len(event.data)
            if body_bytes > _MAX_BODY_BYTES:
                raise h11.RemoteProtocolError("request body too large", error_status_hint=413)
        elif isinstance(event, h11.EndOfMessage):
            return request
        else:  # ConnectionClosed or PAUSED after a protocol switch attempt
            return None


async def _send(
    conn: h11.Connection,
    writer: asyncio.StreamWriter,
    response: AdminResponse,
    head_only: bool,
    close: bool = False,
) -> None:
    headers = [
        ("content-type", response.content_type),
        ("content-length", str(len(response.body))),
        ("cache-control", "no-store"),
        *response.headers,
    ]
    if close:
        headers.append(("connection", "close"))
    reason = HTTPStatus(response.status).phrase.encode()
    writer.write(conn.send(h11.Response(status_code=response.status, headers=headers, reason=reason)))
    if response.body and not head_only:
        writer.write(conn.send(h11.Data(data=response.body)))
    writer.write(conn.send(h11.EndOfMessage()))
    await writer.drain()
