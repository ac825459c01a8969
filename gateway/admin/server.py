"""The admin listener: serves an ``AdminApp`` over HTTP/1.1 (keep-alive) on the supervisor's loop.

Not a hot path, so clarity wins over speed. It speaks HTTP through the codec seam and applies the
data plane's strict request checks (gateway/http), never the wire parser itself. The socket is bound
by the caller (the supervisor binds before it forks, so a taken port fails at start); ``start`` with
another socket swaps the listener on a reload that changes ``admin.listen``, while connections
already open finish on the old one.
"""

from __future__ import annotations

import asyncio
import socket

from gateway.admin.pages import AdminApp, AdminResponse
from gateway.http import codec
from gateway.http.errors import ErrorReply, GatewayError, error_headers
from gateway.http.framing import check_request_head

_MAX_HEAD_BYTES = 16 * 1024
_MAX_URL_BYTES = 8 * 1024
_MAX_BODY_BYTES = 64 * 1024
_IDLE_TIMEOUT = 30.0
_NO_STORE = (b"cache-control", b"no-store")


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
        parser = codec.ServerCodec(_MAX_HEAD_BYTES)
        self._connections.add(writer)
        peername = writer.get_extra_info("peername")
        peer = str(peername[0]) if isinstance(peername, tuple) else "local"
        try:
            while True:
                request = await _read_request(parser, reader)
                if request is None:
                    break
                head, body = request
                framing = check_request_head(head.method, head.target, head.http_version, head.headers,
                                             _MAX_URL_BYTES, _MAX_BODY_BYTES, head.plain)
                parser.expect_response(head.method, head.http_version == b"1.1", framing.keep_alive)
                method = head.method.decode("ascii", "replace")
                headers = _headers(head.headers)
                response = await self._app.handle(method, framing.target.decode("ascii", "replace"),
                                                  authorization=headers.get("authorization"),
                                                  body=body, peer=peer, headers=headers)
                writer.write(_encode(parser, response, head_only=head.method == b"HEAD"))
                await writer.drain()
                if parser.must_close:
                    break
                parser.next_cycle()
        except codec.ParseError as error:
            await _refuse(writer, ErrorReply(error.status, "bad_request", f"malformed request: {error}"))
        except GatewayError as error:  # a strict check failed: framing is in doubt
            await _refuse(writer, error.reply)
        except (ConnectionError, TimeoutError):
            pass
        finally:
            self._connections.discard(writer)
            writer.close()


async def _read_request(parser: codec.ServerCodec,
                        reader: asyncio.StreamReader) -> tuple[codec.RequestHead, bytes] | None:
    """The next complete request and its body (at most 64 KiB), or None when the peer is done."""
    head: codec.RequestHead | None = None
    body = bytearray()
    while True:
        event = parser.next_event()
        if event is codec.NEED_DATA:
            parser.feed(await asyncio.wait_for(reader.read(65536), _IDLE_TIMEOUT))
        elif isinstance(event, codec.RequestHead):
            head = event
        elif isinstance(event, codec.Body):
            body += event.data
            if len(body) > _MAX_BODY_BYTES:
                raise codec.ParseError("request body too large", 413)
        elif isinstance(event, codec.EndOfMessage):
            return None if head is None else (head, bytes(body))
        else:  # ConnectionClosed, or PAUSED after a protocol switch attempt
            return None


def _headers(headers: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """Every header by lower-case name, the first of repeated ones (the admin pages read a few)."""
    found: dict[str, str] = {}
    for key, value in headers:
        found.setdefault(key.decode("latin-1").lower(), value.decode("latin-1"))
    return found


def _encode(parser: codec.ServerCodec, response: AdminResponse, head_only: bool) -> bytes:
    headers = [(b"content-type", response.content_type.encode()), _NO_STORE,
               *((name.encode(), value.encode()) for name, value in response.headers)]
    data = parser.response_head(response.status, headers, len(response.body))
    if response.body and not head_only:
        data += parser.response_data(response.body)
    return data + parser.response_end()


async def _refuse(writer: asyncio.StreamWriter, reply: ErrorReply) -> None:
    """Answer a request that cannot be parsed, then close: nothing more is read from this connection."""
    body = reply.body()
    writer.write(codec.raw_response(reply.status, [*error_headers(body), _NO_STORE, (b"connection", b"close")], body))
    try:
        await writer.drain()
    except ConnectionError:
        pass
