"""The one small probe client: a TCP connect, or one HTTP/1.1 GET, within one deadline.

Used by the health process (endpoint checks) and by the control plane (provider health and metrics
pages). One request per connection with ``Connection: close``; the deadline covers everything from
connect to the last byte read. The response is either read to EOF (bounded) and its body decoded
(``Content-Length`` or chunked), or, when only the status matters, read up to its status line.
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

from gateway.net import client_tls_context

MAX_RESPONSE_BYTES = 4 * 1024 * 1024  # a metrics page is kilobytes; anything bigger is not one


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

    ``status_only`` reads just the status line and returns an empty body.
    """
    if isinstance(target, str):
        target = ProbeTarget.from_url(target)
    request = (f"GET {target.path} HTTP/1.1\r\nHost: {target.authority}\r\nUser-Agent: {user_agent}\r\n"
               "Accept: */*\r\nConnection: close\r\n\r\n").encode("ascii")
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
                if status_only:
                    return parse_status_line(await _read_status_line(reader)), b""
                data = bytearray()
                while chunk := await reader.read(65536):
                    data += chunk
                    if len(data) > MAX_RESPONSE_BYTES:
                        raise ProbeError(f"response larger than {MAX_RESPONSE_BYTES} bytes")
            finally:
                await _close(writer)
    return parse_response(bytes(data))


async def _read_status_line(reader: asyncio.StreamReader) -> bytes:
    try:
        return await reader.readline()
    except ValueError:  # longer than the reader's buffer limit: no status line
        raise ProbeError("malformed status line") from None


def parse_status_line(line: bytes) -> int:
    """The status code of ``HTTP/1.x NNN reason``; raises :class:`ProbeError`."""
    if not line:
        raise ProbeError("empty response")
    parts = line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or len(parts[1]) != 3 or not parts[1].isdigit():
        raise ProbeError("malformed status line")
    return int(parts[1])


def _dechunk(body: bytes) -> bytes:
    pieces: list[bytes] = []
    pos = 0
    while True:
        line_end = body.find(b"\r\n", pos)
        if line_end < 0:
            raise ProbeError("truncated chunked body")
        try:
            size = int(body[pos:line_end].split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise ProbeError("bad chunk size") from None
        if size == 0:
            return b"".join(pieces)
        start = line_end + 2
        if len(body) < start + size:
            raise ProbeError("truncated chunked body")
        pieces.append(body[start : start + size])
        pos = start + size + 2


def parse_response(data: bytes) -> tuple[int, bytes]:
    """(status, body) of a complete HTTP/1.1 response read to EOF; raises :class:`ProbeError`."""
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        raise ProbeError("incomplete response head" if data else "empty response")
    lines = head.split(b"\r\n")
    status = parse_status_line(lines[0])
    headers: dict[bytes, bytes] = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
        body = _dechunk(body)
    elif (length := headers.get(b"content-length")) is not None:
        if not length.isdigit() or len(body) < int(length):
            raise ProbeError("truncated body")
        body = body[: int(length)]
    return status, body
