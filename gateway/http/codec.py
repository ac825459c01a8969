"""The HTTP/1.1 codec seam: the only module that knows the wire parser (h11 today).

Parsing goes through h11 (sans-IO: bytes in, events out). Serialising does not: the gateway writes
message heads and body framing itself, because every header it emits either came out of the parser
or was built by the gateway, and h11's send path (per-header validation plus its state machine) was
about a third of a request's codec cost. h11 only has to learn what it needs to parse the peer's
next message:

- server side (``ServerCodec``): a fresh parser per request cycle, seeded with the bytes already
  received (pipelining), so responses never pass through it;
- client side (``ClientCodec``, in gateway/http/client_codec.py, also reachable here): a fresh parser
  per response; only a HEAD request (its answer has no body) or a 1xx head needs a canned request
  event passed through h11 first.

Bodies framed by a Content-Length are counted off by ``BodyReader`` instead of h11 (the server asks
for it with ``read_body``; the client counts every length-framed response body itself): h11 then
parses heads only, and its per-event state machine is skipped for the bodies. Chunked request bodies go through the
strict decoder of gateway/http/framing.py the same way; chunked responses stay with h11.

Events: the gateway reads only the attributes documented here, so swapping the parser is a change
to this module alone:

- ``RequestHead``: ``method``, ``target``, ``headers`` (see ``header_pairs``), ``http_version``
  (b"1.0" / b"1.1");
- ``ResponseHead``: ``status_code``, ``headers``; ``Informational``: a 1xx head;
- ``Body``: ``data``; ``EndOfMessage``; ``ConnectionClosed``;
- the sentinels ``NEED_DATA`` (feed more bytes) and ``PAUSED`` (a complete message is waiting for
  the next cycle).
"""

from __future__ import annotations

from collections.abc import Sequence
from http import HTTPStatus

import h11

from gateway.http.framing import ChunkedDecoder

RequestHead = h11.Request
ResponseHead = h11.Response
Informational = h11.InformationalResponse
ConnectionClosed = h11.ConnectionClosed
NEED_DATA = h11.NEED_DATA
PAUSED = h11.PAUSED


class Body:
    """A piece of a message body."""

    __slots__ = ("data",)

    def __init__(self, data: bytes | bytearray) -> None:
        self.data = data


class EndOfMessage:
    """The message ended (one shared instance, ``END``)."""

    __slots__ = ()


END = EndOfMessage()

REASONS = {status.value: status.phrase.encode() for status in HTTPStatus}
CONTINUE_RESPONSE = b"HTTP/1.1 100 Continue\r\n\r\n"

# Response body framing modes.
_NO_BODY, _LENGTH, _CHUNKED, _UNTIL_CLOSE = range(4)
_CHUNKED_HEADER = (b"transfer-encoding", b"chunked")
_CLOSE_HEADER = (b"connection", b"close")
_LAST_CHUNK = b"0\r\n\r\n"


class ParseError(Exception):
    """The peer sent bytes that are not valid HTTP/1.1; ``status`` is the answer a server gives."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class NotHttp(ParseError):
    """The peer speaks another protocol: a TLS handshake sent to a plain HTTP listener (a client that
    expected https://). No HTTP answer can help it, and it made no request to log."""


# A TLS record of type handshake, protocol version 3.x (SSL 3.0 up to TLS 1.3): how every ClientHello starts.
_TLS_HANDSHAKE = b"\x16\x03"
# How h11 (pinned to 0.16) names a request line it took whole before refusing it: a ClientHello whose
# random bytes happen to hold a blank line ("\n\n") is refused this way instead of at its first byte.
_TLS_REQUEST_LINE = "illegal request line: bytearray(b'\\x16\\x03"


def _is_tls_handshake(parser: h11.Connection, error: h11.RemoteProtocolError) -> bool:
    """The bytes h11 refused begin a TLS handshake. Asked only once a request failed to parse, so
    recognising TLS costs the requests that do parse nothing."""
    return parser.trailing_data[0][:2] == _TLS_HANDSHAKE or str(error).startswith(_TLS_REQUEST_LINE)


class FramingError(Exception):
    """A message we send would break its own framing (more or fewer bytes than promised)."""


_FIELD_LINE = b": ".join  # (name, value) -> b"name: value", in C: no Python step per header


def _head_bytes(start_line: bytes, headers: list[tuple[bytes, bytes]]) -> bytes:
    return b"\r\n".join([start_line, *map(_FIELD_LINE, headers), b"", b""])


def raw_response(status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
    """A complete response built without any framing state: for answers sent when framing is in doubt."""
    return _head_bytes(b"HTTP/1.1 %d %s" % (status, REASONS.get(status, b"Error")), headers) + body


def header_pairs(headers: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """A parsed head's headers as a plain list of (lowercase name, value): h11 keeps them in a
    ``Sequence`` whose iteration costs a Python call per item, and the gateway reads them several
    times per request. Reads h11's item list directly (this module is where h11 knowledge lives),
    with the public iteration as the fallback for another h11 layout."""
    items = getattr(headers, "_full_items", None)
    if items is None:
        return list(headers)
    return [(name, value) for _raw, name, value in items]


class BodyReader:
    """Frames one message body after h11 parsed its head: ``length`` bytes, or a chunked body through
    ``chunked`` (gateway/http/framing.py ChunkedDecoder). Bytes after the body stay in ``stash``:
    they belong to the next message."""

    __slots__ = ("stash", "left", "chunked", "closed", "ended")

    def __init__(self, initial: bytes | bytearray, length: int, chunked: ChunkedDecoder | None) -> None:
        self.stash = bytearray(initial)
        self.left = length
        self.chunked = chunked
        self.closed = False
        self.ended = False

    def feed(self, data: bytes) -> None:
        if data:
            self.stash += data
        else:
            self.closed = True

    def next_event(self):  # -> Body | EndOfMessage | NEED_DATA | PAUSED
        if self.ended:
            return PAUSED
        chunked = self.chunked
        if chunked is not None:
            if self.stash:
                pieces = chunked.feed(bytes(self.stash))  # raises GatewayError on a framing violation
                self.stash = bytearray(chunked.leftover)
                if pieces:
                    return Body(pieces[0] if len(pieces) == 1 else b"".join(pieces))
            if chunked.done:
                self.ended = True
                return END
        elif self.left == 0:
            self.ended = True
            return END
        elif self.stash:
            stash = self.stash
            if len(stash) <= self.left:
                self.left -= len(stash)
                self.stash = bytearray()
                return Body(stash)
            data = stash[:self.left]
            del stash[:self.left]
            self.left = 0
            return Body(data)
        if self.closed:
            raise ParseError("the connection closed in the middle of the body")
        return NEED_DATA


class ServerCodec:
    """One client connection: parses requests, frames the responses to them (one at a time, in order)."""

    __slots__ = (
        "_parser", "_max_head", "_body", "_at_start", "_held_cr", "_mode", "_remaining", "must_close", "_method",
        "_http11", "_keep_alive",
    )

    def __init__(self, max_header_bytes: int) -> None:
        self._max_head = max_header_bytes
        self._parser = h11.Connection(h11.SERVER, max_incomplete_event_size=max_header_bytes)
        # Set by ``read_body``: the body is framed here, not by h11; later bytes wait for the next cycle.
        self._body: BodyReader | None = None
        self._at_start = True  # no byte of the current request reached the parser yet
        self._held_cr = False
        self._mode = _NO_BODY
        self._remaining = 0
        self.must_close = False  # after the current response, the connection cannot be reused
        self._method = b"GET"
        self._http11 = True
        self._keep_alive = True

    # -- parsing ------------------------------------------------------------------------------
    def feed(self, data: bytes) -> None:
        """Bytes received from the client (b"" means the client half-closed)."""
        if self._body is not None:
            self._body.feed(data)
            return
        if self._at_start and data:
            data = self._skip_empty_line(data)
            if not data:
                return
        self._parser.receive_data(data)

    def _skip_empty_line(self, data: bytes) -> bytes:
        """RFC 9112 §2.2: ignore one empty line (CRLF) received before the request line."""
        if self._held_cr:
            self._held_cr = False
            data = b"\r" + data
        if data == b"\r":
            self._held_cr = True
            return b""
        self._at_start = False
        return data[2:] if data[:2] == b"\r\n" else data

    def next_event(self):  # -> RequestHead | Body | EndOfMessage | ConnectionClosed | NEED_DATA | PAUSED
        if self._body is not None:
            return self._body.next_event()
        try:
            event = self._parser.next_event()
        except h11.RemoteProtocolError as error:
            if _is_tls_handshake(self._parser, error):
                raise NotHttp("a TLS handshake on a plain HTTP listener") from None
            raise ParseError(str(error), error.error_status_hint) from None
        return _own_event(event)

    def read_body(self, content_length: int, chunked: ChunkedDecoder | None = None) -> None:
        """After a request head: frame its body here (``content_length`` bytes, -1 for none, or chunked)
        instead of in h11. Without this call, h11 frames the body."""
        self._body = BodyReader(self._parser.trailing_data[0], max(content_length, 0), chunked)

    @property
    def buffered(self) -> int:
        """Bytes received but not parsed yet (the rest of a pipelined stream)."""
        body = self._body
        return len(self._parser.trailing_data[0]) if body is None else len(body.stash)

    @property
    def expects_continue(self) -> bool:
        """The request announced ``Expect: 100-continue`` and has not sent its body yet."""
        return self._parser.they_are_waiting_for_100_continue

    def next_cycle(self) -> None:
        """Start parsing the next request on this connection (after its response ended)."""
        body = self._body
        if body is not None:
            data, closed = bytes(body.stash), body.closed
            self._body = None
        else:
            pending, closed = self._parser.trailing_data
            data = bytes(pending)
        self._parser = h11.Connection(h11.SERVER, max_incomplete_event_size=self._max_head)
        self._at_start = True
        self._held_cr = False
        if data:
            self.feed(data)
        if closed:
            self._parser.receive_data(b"")

    # -- responding ---------------------------------------------------------------------------
    def expect_response(self, method: bytes, http11: bool, keep_alive: bool) -> None:
        """The request about to be answered: its method decides body framing, its version chunking."""
        self._method = method
        self._http11 = http11
        self._keep_alive = keep_alive

    def response_head(
        self, status: int, headers: list[tuple[bytes, bytes]], content_length: int | None, close: bool = False
    ) -> bytes:
        """The head bytes; ``headers`` must hold no framing or Connection headers (they are added here).

        ``content_length`` None frames the body as chunked (HTTP/1.1) or until close (HTTP/1.0).
        """
        no_body = self._method == b"HEAD" or status in (204, 304)
        if content_length is not None:
            headers.append((b"content-length", b"%d" % content_length))
            mode = _NO_BODY if no_body else _LENGTH
            self._remaining = content_length
        elif status in (204, 304):
            mode = _NO_BODY
        elif self._http11:
            headers.append(_CHUNKED_HEADER)  # a HEAD answer carries the headers a GET would get
            mode = _NO_BODY if no_body else _CHUNKED
        else:
            mode = _NO_BODY if no_body else _UNTIL_CLOSE
        self._mode = mode
        must_close = close or not self._keep_alive or mode == _UNTIL_CLOSE
        if must_close:
            headers.append(_CLOSE_HEADER)
        self.must_close = must_close
        return _head_bytes(b"HTTP/1.1 %d %s" % (status, REASONS.get(status, b"")), headers)

    def response_data(self, data: bytes) -> bytes:
        mode = self._mode
        if mode == _CHUNKED:
            return b"%x\r\n%b\r\n" % (len(data), data)
        if mode == _LENGTH:
            if len(data) > self._remaining:
                raise FramingError("more body bytes than the declared Content-Length")
            self._remaining -= len(data)
            return data
        if mode == _UNTIL_CLOSE:
            return data
        raise FramingError("this response has no body")

    def response_end(self) -> bytes:
        mode = self._mode
        self._mode = _NO_BODY
        if mode == _CHUNKED:
            return _LAST_CHUNK
        if mode == _LENGTH and self._remaining:
            raise FramingError("fewer body bytes than the declared Content-Length")
        return b""


def _own_event(event):  # h11's body events become the codec's own; heads pass as they are
    kind = type(event)
    if kind is h11.Data:
        return Body(event.data)
    if kind is h11.EndOfMessage:
        return END
    return event


def __getattr__(name: str):  # -> the client side's public names, which live in their own module
    if name in _CLIENT_NAMES:
        from gateway.http import client_codec

        return getattr(client_codec, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_CLIENT_NAMES = frozenset(("ClientCodec", "RefusedResponse", "MAX_INFORMATIONAL_HEADS"))
