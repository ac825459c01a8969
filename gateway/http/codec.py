"""The HTTP/1.1 codec seam: the only module that knows the wire parser (h11 today).

Parsing goes through h11 (sans-IO: bytes in, events out). Serialising does not: the gateway writes
message heads and body framing itself, because every header it emits either came out of the parser
or was built by the gateway, and h11's send path (per-header validation plus its state machine) was
about a third of a request's codec cost. h11 only has to learn what it needs to parse the peer's
next message:

- server side (``ServerCodec``): a fresh parser per request cycle, seeded with the bytes already
  received (pipelining), so responses never pass through it;
- client side (``ClientCodec``): a fresh parser per response; only a HEAD request (its answer has no
  body) or a 1xx head needs a canned request event passed through h11 first.

Bodies framed by a Content-Length are counted off by ``BodyReader`` instead of h11 (the server asks
for it with ``read_body``; the client counts every length-framed response body itself): h11 then parses heads
only, and its per-event state machine is skipped for the bodies. Chunked request bodies go through the
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


# Parsing a response needs no request event, except to learn that the request was a HEAD (its answer
# has no body) or when a 1xx head arrives (h11 accepts those only after a request): then a canned
# request of the right method is passed through h11 first; its bytes are discarded.
_CANNED_HOST = [(b"host", b"upstream")]
_canned_requests: dict[bytes, h11.Request] = {}
_CANNED_LIMIT = 64
_END = h11.EndOfMessage()
_INFORMATIONAL_PREFIX = len(b"HTTP/1.1 ")  # the status code's first digit follows
# 1xx heads accepted before one final head: the gateway never asks for one (it sends no Expect), so a
# provider sending more is broken or hostile, and parsing them without end would only burn CPU.
MAX_INFORMATIONAL_HEADS = 16
_BODILESS_STATUSES = (204, 304)


class RefusedResponse(ParseError):
    """A response the parser could read but the gateway refuses; the message is in plain words."""


def _canned_request(method: bytes) -> h11.Request:
    event = _canned_requests.get(method)
    if event is None:
        event = h11.Request(method=method, target=b"/", headers=_CANNED_HOST)
        if len(_canned_requests) < _CANNED_LIMIT:
            _canned_requests[method] = event
    return event


class ClientCodec:
    """One upstream connection: serialises requests, parses the responses (a fresh parser per response).

    ``reusable`` decides whether the connection may carry another request, and a pooled connection is
    shared by every tenant: if the gateway and the provider could disagree about where an answer ends,
    the rest of that answer would become the next client's. So it is True only for an HTTP/1.1
    keep-alive answer framed one way beyond doubt (Content-Length or chunked, not both), with a body its
    request and status allow (never after HEAD, 204 or 304: a broken provider may send the body it
    declared anyway), after no 1xx head that declared a body, that ended cleanly with no byte after it.
    Anything else closes the connection (see docs/upstream.md).

    Bodies framed by a Content-Length are counted off here, not by h11 (see the module doc); bytes
    beyond the declared length are never kept, only noted.
    """

    __slots__ = ("_parser", "_max_head", "_method", "_primed", "_head_start", "_left", "_pending", "_ended",
                 "_eof", "_reuse", "_tainted", "_informational", "head_headers", "framing_doubt")

    def __init__(self, max_header_bytes: int = 65536) -> None:
        self._max_head = max_header_bytes
        self._parser = h11.Connection(h11.CLIENT, max_incomplete_event_size=max_header_bytes)
        self._method = b"GET"
        # A canned request went through the parser for this response, or none is needed any more.
        self._primed = False
        self._head_start = b""  # the first bytes of a response, until its status class is known
        # A length-framed body counted off here: the bytes still due (-1: h11 frames this response),
        # the bytes received and not yet handed out, and whether the body ended.
        self._left = -1
        self._pending = b""
        self._ended = False
        self._eof = False  # the provider closed its side
        self._reuse = False  # the final head allows reuse (the end still has to be clean)
        # Never reuse this connection: bytes after an end, a 1xx head with a body, the provider's EOF.
        # Never cleared: such a connection is closed.
        self._tainted = False
        self._informational = 0  # 1xx heads before this response's final head
        self.head_headers: list[tuple[bytes, bytes]] = []  # the last response head's headers, as a plain list
        self.framing_doubt = False  # the last head had both Content-Length and Transfer-Encoding

    def encode_request(self, method: bytes, target: bytes, host: bytes, headers: list[tuple[bytes, bytes]]) -> bytes:
        """The request head bytes: Host first, then ``headers`` (with the body framing, Content-Length);
        the body follows as raw bytes."""
        self._method = method
        if method == b"HEAD":
            self._prime()
        return _head_bytes(method + b" " + target + b" HTTP/1.1\r\nhost: " + host, headers)

    def _prime(self) -> None:
        if not self._primed:
            self._primed = True
            parser = self._parser
            parser.send(_canned_request(self._method))
            parser.send(_END)

    def feed(self, data: bytes) -> None:
        """Bytes received from the provider (b"" means it closed its side)."""
        if self._left >= 0:  # a length-framed body
            if not data:
                self._eof = self._tainted = True  # an error unless the body already ended
            elif self._ended:
                self._tainted = True  # bytes after the end: not kept, the connection is done
            elif self._pending:
                self._pending += data
            else:
                self._pending = data
            return
        if not data and self._head_start:  # the provider closed in the middle of a status line
            self._parser.receive_data(self._head_start)
            self._head_start = b""
        elif not self._primed and data:
            # Until the status code's first digit is known: a 1xx head needs the request passed through
            # h11 first; a final head needs nothing more (so the answer is no longer watched for it).
            head = self._head_start + data
            if len(head) <= _INFORMATIONAL_PREFIX:
                self._head_start = head
                return
            self._head_start = b""
            if head[_INFORMATIONAL_PREFIX:_INFORMATIONAL_PREFIX + 1] == b"1":
                self._prime()
            else:
                self._primed = True
            data = head
        self._parser.receive_data(data)

    def next_event(self):  # -> ResponseHead | Informational | Body | EndOfMessage | ConnectionClosed | ...
        if self._left >= 0:
            return self._length_body_event()
        try:
            event = self._parser.next_event()
        except h11.RemoteProtocolError as error:
            raise ParseError(str(error), 502) from None
        kind = type(event)
        if kind is h11.Data:
            return Body(event.data)
        if kind is h11.EndOfMessage:
            return END
        if kind is h11.Response:
            self._on_head(event)
        elif kind is h11.InformationalResponse:
            self._on_informational(event)
        return event

    def _length_body_event(self):  # -> Body | EndOfMessage | NEED_DATA | PAUSED
        if self._ended:
            return PAUSED
        left = self._left
        pending = self._pending
        if left == 0:
            self._ended = True
            if pending:
                self._tainted = True
                self._pending = b""
            return END
        if pending:
            self._pending = b""
            if len(pending) <= left:
                self._left = left - len(pending)
                return Body(pending)
            self._left = 0
            self._tainted = True  # bytes beyond the declared length (dropped, never someone's answer)
            return Body(pending[:left])
        if self._eof:  # the provider closed before the declared length arrived
            raise ParseError("the connection closed in the middle of the body", 502)
        return NEED_DATA

    def _on_informational(self, event: h11.InformationalResponse) -> None:
        count = self._informational = self._informational + 1
        if count > MAX_INFORMATIONAL_HEADS:
            raise RefusedResponse(f"more than {MAX_INFORMATIONAL_HEADS} informational (1xx) heads", 502)
        for name, _value in header_pairs(event.headers):
            if name == b"content-length" or name == b"transfer-encoding":
                self._tainted = True  # a body on a head that has none: the provider may send it anyway

    def _on_head(self, event: h11.Response) -> None:
        headers = self.head_headers = header_pairs(event.headers)
        self._informational = 0
        length = -1
        chunked = close = False
        for name, value in headers:
            if name == b"content-length":
                length = int(value)  # h11 accepted it: digits
            elif name == b"transfer-encoding":
                chunked = True
            elif name == b"connection" and b"close" in value.lower():
                close = True
        doubt = self.framing_doubt = chunked and length >= 0
        bodiless = self._method == b"HEAD" or event.status_code in _BODILESS_STATUSES
        # Reused only when both sides agree where the answer ends: one framing, a body it may carry
        # (bodiless answers and close-delimited bodies close the connection).
        self._reuse = (event.http_version == b"1.1" and not close and not bodiless and not doubt
                       and (chunked or length >= 0))
        if length >= 0 and not chunked and not bodiless:
            pending, closed = self._parser.trailing_data
            self._left = length
            self._pending = bytes(pending)
            self._ended = False
            if closed:
                self._eof = self._tainted = True

    @property
    def reusable(self) -> bool:
        """The response ended cleanly, its framing could be read one way only, and nothing followed it."""
        if not self._reuse or self._tainted:
            return False
        if self._left >= 0:
            return self._ended
        parser = self._parser
        after, closed = parser.trailing_data
        return parser.their_state is h11.DONE and not after and not closed

    @property
    def buffered(self) -> int:
        """Bytes received and not handed out yet (bounded: a head is at most ``max_header_bytes``)."""
        if self._left >= 0:
            return len(self._pending)
        return len(self._parser.trailing_data[0]) + len(self._head_start)

    def next_cycle(self) -> None:
        """A fresh parser for the next response on this connection (called only when ``reusable``)."""
        self._parser = h11.Connection(h11.CLIENT, max_incomplete_event_size=self._max_head)
        self._primed = False
        self._left = -1
