"""The one small probe client: a TCP connect, or one HTTP/1.1 GET, within one deadline.

Used by the health process (endpoint checks) and by the control plane (provider health and metrics
pages). One request per connection with ``Connection: close``; the deadline covers everything from
connect to the last byte read. The HTTP is the data plane's own client codec
(:class:`gateway.http.client_codec.ClientCodec`): one parser and one chunked decoder for every response the
gateway reads. A response is read to its end (bounded), or, when only the status matters, to its head.
Failures raise :class:`ProbeError` with a short message fit for logs and observations.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from urllib.parse import urlsplit

from gateway.http.client_codec import ClientCodec
from gateway.http.codec import (
    NEED_DATA,
    Body,
    ConnectionClosed,
    EndOfMessage,
    ParseError,
    ResponseHead,
)
from gateway.net import client_tls_context

MAX_RESPONSE_BYTES = 4 * 1024 * 1024  # a metrics page is kilobytes; anything bigger is not one
MAX_HEAD_BYTES = 64 * 1024


class ProbeError(Exception):
    """A failed probe; the message is short and says why (``connection refused``, ``HTTP 503`` ...)."""


@dataclass(frozen=True, slots=True)
class ProbeTarget:
    """Where a GET goes: built once per probed thing, reused for every probe."""

    host: str
    port: int
    path: str  # the request target, sent as given
    authority: str  # the Host header
    ssl_context: ssl.SSLContext | None = None
    server_name: str | None = None  # TLS server name; None: the host

    @classmethod
    def from_url(cls, url: str) -> ProbeTarget:
        """An ``http://`` or ``https://`` URL (https verified against the system CAs)."""
        parts = urlsplit(url)
        https = parts.scheme == "https"
        host = parts.hostname or ""
        port = parts.port or (443 if https else 80)
        authority = f"[{host}]" if ":" in host else host
        if parts.port is not None:
            authority += f":{port}"
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return cls(host, port, path, authority, _system_tls() if https else None)


@cache
def _system_tls() -> ssl.SSLContext:
    return client_tls_context()


@contextlib.contextmanager
def _explained(timeout_s: float) -> Iterator[None]:
    """Turn socket, TLS and deadline errors into a ProbeError that says what happened."""
    try:
        yield
    except TimeoutError:
        raise ProbeError(f"timed out after {timeout_s:g}s") from None
    except ConnectionRefusedError:
        raise ProbeError("connection refused") from None
    except ssl.SSLError as exc:
        raise ProbeError(f"TLS: {exc.reason or exc}") from None
    except OSError as exc:
        raise ProbeError(exc.strerror or type(exc).__name__) from None


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError, ssl.SSLError):
        await writer.wait_closed()


async def tcp_connect(host: str, port: int, timeout_s: float) -> None:
    """Open (and close) a TCP connection within the deadline; raises :class:`ProbeError`."""
    with _explained(timeout_s):
        async with asyncio.timeout(timeout_s):
            _, writer = await asyncio.open_connection(host, port)
            await _close(writer)


async def http_get(target: ProbeTarget | str, timeout_s: float, *, status_only: bool = False,
                   user_agent: str = "gridgate") -> tuple[int, bytes]:
    """``GET`` a target (or URL) within ``timeout_s``: (status, body); raises :class:`ProbeError`.

    ``status_only`` returns at the response head, with an empty body.
    """
    if isinstance(target, str):
        target = ProbeTarget.from_url(target)
    codec = ClientCodec(MAX_HEAD_BYTES)
    request = codec.encode_request(b"GET", target.path.encode("ascii"), target.authority.encode("ascii"), [
        (b"user-agent", user_agent.encode("ascii")), (b"accept", b"*/*"), (b"connection", b"close"),
    ])
    tls = target.ssl_context
    with _explained(timeout_s):
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(
                target.host, target.port, ssl=tls,
                server_hostname=(target.server_name or target.host) if tls is not None else None,
            )
            try:
                writer.write(request)
                await writer.drain()
                return await _read_response(reader, codec, status_only)
            finally:
                await _close(writer)


async def _read_response(reader: asyncio.StreamReader, codec: ClientCodec, status_only: bool) -> tuple[int, bytes]:
    """Feed the codec until the response ended (or, ``status_only``, until its head)."""
    response = _Response()
    received = 0
    while True:
        data = await reader.read(65536)
        received += len(data)
        if received > MAX_RESPONSE_BYTES:
            raise ProbeError(f"response larger than {MAX_RESPONSE_BYTES} bytes")
        codec.feed(data)
        try:
            done = response.take(codec, status_only)
        except ParseError:
            raise ProbeError(response.problem(eof=not data, received=received)) from None
        if done:
            return response.status, b"".join(response.body)
        if not data:  # cannot happen: the codec ends or raises at the end of the input
            raise ProbeError(response.problem(eof=True, received=received))


class _Response:
    """What the events of one response said so far."""

    __slots__ = ("status", "body")

    def __init__(self) -> None:
        self.status = 0  # 0 until the head arrived
        self.body: list[bytes] = []

    def take(self, codec: ClientCodec, status_only: bool) -> bool:
        """Consume the codec's events; True once the response (or its head, ``status_only``) is complete."""
        while True:
            event = codec.next_event()
            kind = type(event)
            if event is NEED_DATA:
                return False
            if kind is ResponseHead:
                self.status = event.status_code
                if status_only:
                    return True
            elif kind is Body:
                self.body.append(bytes(event.data))
            elif kind is EndOfMessage:
                return True
            elif kind is ConnectionClosed:  # the peer closed before a response began
                raise ParseError("closed")
            # an Informational (1xx) head: the final one follows

    def problem(self, *, eof: bool, received: int) -> str:
        """Why the bytes so far are no response, in plain words."""
        if not self.status:
            if eof:
                return "incomplete response head" if received else "empty response"
            return "malformed response head"
        return "truncated body" if eof else "malformed body"
