"""The codec seam: everything the worker knows about HTTP/1.1 wire parsing comes through here.

Today the codec is h11 (sans-IO: bytes in, events out). Keeping the names in one module means a
faster codec can replace it without touching the server or the proxy.
"""

from __future__ import annotations

from http import HTTPStatus

import h11

Request = h11.Request
Response = h11.Response
InformationalResponse = h11.InformationalResponse
Data = h11.Data
EndOfMessage = h11.EndOfMessage
ConnectionClosed = h11.ConnectionClosed
NEED_DATA = h11.NEED_DATA
PAUSED = h11.PAUSED
DONE = h11.DONE
MUST_CLOSE = h11.MUST_CLOSE
ProtocolError = h11.ProtocolError
RemoteProtocolError = h11.RemoteProtocolError
LocalProtocolError = h11.LocalProtocolError


def request_event(method: bytes, target: bytes, headers: list[tuple[bytes, bytes]]) -> h11.Request:
    """An outgoing request whose header names and values are already valid bytes.

    ``_parsed=True`` skips h11's per-header regex validation (about a quarter of its send cost):
    every name and value we emit either came out of h11's parser or was built and checked by us.
    """
    return h11.Request(method=method, target=target, headers=headers, _parsed=True)


def response_event(status: int, headers: list[tuple[bytes, bytes]]) -> h11.Response:
    """An outgoing response head; see ``request_event`` for why validation is skipped."""
    return h11.Response(status_code=status, headers=headers, reason=_PHRASES.get(status, b""), _parsed=True)


def server_codec(max_header_bytes: int) -> h11.Connection:
    return h11.Connection(h11.SERVER, max_incomplete_event_size=max_header_bytes)


def client_codec(max_header_bytes: int = 65536) -> h11.Connection:
    return h11.Connection(h11.CLIENT, max_incomplete_event_size=max_header_bytes)


_PHRASES = {status.value: status.phrase.encode() for status in HTTPStatus}


def raw_response(status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
    """A complete response built without a codec: for answers sent when framing is in doubt."""
    lines = [b"HTTP/1.1 %d %s" % (status, _PHRASES.get(status, b"Error"))]
    lines += [name + b": " + value for name, value in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body
