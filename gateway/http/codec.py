"""The HTTP/1.1 codec seam: the only module that knows the wire parser (h11 today).

Parsing goes through h11 (sans-IO: bytes in, events out). Serialising does not: the gateway writes
message heads and body framing itself, because every header it emits either came out of the parser
or was built by the gateway, and h11's send path (per-header validation plus its state machine) was
about a third of a request's codec cost. h11 only has to learn what it needs to parse the peer's
next message:

- server side (``ServerCodec``): the codec keeps the connection's receive buffer, finds each request
  head in it (size and line count checked first) and parses that head alone: a plainly valid one (almost
  all) by gateway/http/request_head.py, any other by h11 in a fresh parser per request (same errors, same
  words as h11 alone), so responses never pass through h11 and pipelined bytes are never copied per
  request;
- client side (``ClientCodec``, in gateway/http/client_codec.py): a fresh parser
  per response; only a HEAD request (its answer has no
  body) or a 1xx head needs a canned request event passed through h11 first.

Request bodies are framed by ``BodyReader``, never by h11 (the server says how with ``read_body``;
Content-Length bodies are counted off, chunked ones go through the strict decoder of
gateway/http/framing.py). The client does the same for every response body (gateway/http/client_codec.py):
h11 parses only response heads.

Events: the gateway reads only the attributes documented here, so swapping the parser is a change
to this module alone:

- ``RequestHead`` (gateway/http/request_head.py, whichever parser made it): ``method``, ``target``,
  ``headers`` (a plain list of (lowercase name, value)), ``http_version`` (b"1.0" / b"1.1");
- ``ResponseHead``: ``status_code``, ``headers``; ``Informational``: a 1xx head;
- ``Body``: ``data``; ``EndOfMessage``; ``ConnectionClosed``;
- the sentinels ``NEED_DATA`` (feed more bytes) and ``PAUSED`` (a complete message is waiting for
  the next cycle).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from http import HTTPStatus

import h11

from gateway.http.credential_line import MIN_SET_ASIDE_BYTES, STAND_IN, SetAside, set_aside
from gateway.http.framing import ChunkedDecoder
from gateway.http.request_head import RequestHead, parse_plain_head

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
_CLOSE_LINE = b"connection: close\r\n"


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


def _restore(headers: Sequence[tuple[bytes, bytes]], aside: SetAside, field_lines: int) -> bool:
    """Put the value set aside back in its stand-in's place in h11's parsed fields (False: not found
    where expected, the head must be parsed as it came). ``field_lines``: the head's; h11 made fewer
    fields when it joined an obs-fold line (credential_line.py), and every index after it moved."""
    items = getattr(headers, "_full_items", None)
    _, index, value = aside
    if items is not None and len(items) == field_lines:
        field = items[index]
        if field[1] == b"authorization" and field[2] == STAND_IN:
            items[index] = (field[0], b"authorization", value)
            return True
    return False


class BodyReader:
    """Frames one message body after its head: ``length`` bytes, or a chunked body through ``chunked``
    (gateway/http/framing.py ChunkedDecoder).

    It owns ``stash``, the bytes received and not framed yet (a bytearray passed in is adopted, not
    copied). Once the body ended, ``stash`` holds exactly the bytes after it: they belong to the next
    message and are never framed as this one's.
    """

    __slots__ = ("stash", "left", "chunked", "closed", "ended")

    def __init__(self, initial: bytes | bytearray, length: int, chunked: ChunkedDecoder | None) -> None:
        self.stash = initial if type(initial) is bytearray else bytearray(initial)
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
        stash = self.stash
        chunked = self.chunked
        if chunked is not None:
            if not chunked.done and stash:
                # The decoder consumes up to the end of the body, never beyond: what it leaves in the
                # stash is the next message, and a done decoder is never fed again.
                pieces, used = chunked.feed(stash)  # raises GatewayError on a framing violation
                del stash[:used]
                if pieces:
                    return Body(pieces[0] if len(pieces) == 1 else b"".join(pieces))
            if chunked.done:
                self.ended = True
                return END
        elif self.left == 0:
            self.ended = True
            return END
        elif stash:
            if len(stash) <= self.left:
                self.left -= len(stash)
                self.stash = bytearray()
                return Body(stash)  # handed over whole: no copy
            data = stash[:self.left]
            del stash[:self.left]
            self.left = 0
            return Body(data)
        if self.closed:
            raise ParseError("the connection closed in the middle of the body")
        return NEED_DATA


# h11 quotes the line it refused ("illegal header line: bytearray(b'Authorization: Bearer ...')"): cut from
# the quote on, so an error never echoes a credential (or any request bytes) back or into a log.
_ECHOED = re.compile(r":? ?(?:bytearray\()?b['\"].*\Z", re.DOTALL)
# The end of a request head, found the way h11 finds it (a bare LF is a line end too).
_HEAD_END = re.compile(rb"\n\r?\n")
_CONNECTION_CLOSED = h11.ConnectionClosed()


class ServerCodec:
    """One client connection: parses requests, frames the responses to them (one at a time, in order).

    The codec owns the connection's receive buffer. A request head is found in it (and its size and
    line count checked) before h11 sees it; h11 then parses that head alone, in a fresh parser per
    request. The body is framed from the same buffer by a ``BodyReader``, which hands the buffer back
    holding exactly the bytes after the body. Per request only the head (for h11) and the body (handed
    on) are copied, never the bytes that follow, so n pipelined bytes cost O(n) however many requests
    they hold.
    """

    __slots__ = (
        "_buf", "_closed", "_parser", "_head", "_body", "_scan", "_at_start", "_first_request", "_max_head", "_max_lines",
        "_mode", "_remaining", "must_close", "_method", "_http11", "_keep_alive", "_set_aside_bytes", "_plain_heads",
    )

    def __init__(self, max_header_bytes: int, max_header_count: int = 100,
                 set_aside_bytes: int = MIN_SET_ASIDE_BYTES, plain_heads: bool = True) -> None:
        """``set_aside_bytes``: an Authorization value at least this long is validated here, not by h11
        (gateway/http/credential_line.py); ``plain_heads``: a plainly valid head is parsed by
        gateway/http/request_head.py. ``sys.maxsize`` and False give every head to h11 as it is."""
        self._buf = bytearray()  # received and not parsed yet (while no body is being read)
        self._closed = False  # the client half-closed
        self._parser: h11.Connection | None = None  # parsed the current request's head (None: not h11)
        self._head: RequestHead | None = None
        # The current request's body framing (``read_body``); later bytes wait for the next cycle.
        self._body: BodyReader | None = None
        self._scan = 0  # where the search for the end of the head resumes
        self._at_start = True  # no byte of the current request looked at yet
        self._first_request = True  # no head parsed yet: a TLS hello can only be a connection's first bytes
        self._max_head = max_header_bytes
        self._max_lines = max_header_count + 2  # the request line and the empty line that ends the head
        self._mode = _NO_BODY
        self._remaining = 0
        self.must_close = False  # after the current response, the connection cannot be reused
        self._method = b"GET"
        self._http11 = True
        self._keep_alive = True
        self._set_aside_bytes = set_aside_bytes
        self._plain_heads = plain_heads

    # -- parsing ------------------------------------------------------------------------------
    def feed(self, data: bytes) -> None:
        """Bytes received from the client (b"" means the client half-closed)."""
        body = self._body
        if body is not None:
            body.feed(data)
        elif data:
            self._buf += data
        else:
            self._closed = True

    def next_event(self):  # -> RequestHead | Body | EndOfMessage | ConnectionClosed | NEED_DATA | PAUSED
        body = self._body
        if body is not None:
            return body.next_event()
        if self._head is not None:  # a head was returned and the caller did not ask for ``read_body``
            self._frame_body_as_declared()
            return self._body.next_event()
        return self._next_head()

    def _next_head(self):
        buf = self._buf
        if self._at_start and buf:
            if buf[0] == 13:  # RFC 9112 §2.2: one empty line (CRLF) before the request line is ignored
                if len(buf) == 1:
                    if not self._closed:
                        return NEED_DATA
                elif buf[1] == 10:
                    del buf[:2]
            self._at_start = False
        match = _HEAD_END.search(buf, self._scan)
        if match is None:
            if self._closed:
                if buf:
                    raise ParseError("the connection closed in the middle of a request head")
                return _CONNECTION_CLOSED
            if len(buf) > self._max_head:
                raise ParseError("request header block too large", 431)
            if buf and buf[0] < 0x21:  # no request line starts so (a TLS hello on the plain port...)
                if self._first_request and buf[0] == _TLS_HANDSHAKE[0]:
                    if buf[:2] == _TLS_HANDSHAKE:
                        raise NotHttp("a TLS handshake on a plain HTTP listener")
                    if len(buf) == 1 and not self._closed:
                        return NEED_DATA  # the record's second byte decides, however the bytes arrive
                raise ParseError("illegal request line")
            self._scan = max(0, len(buf) - 2)
            return NEED_DATA
        end = match.end()
        if end > self._max_head:
            raise ParseError("request header block too large", 431)
        head = bytes(buf[:end])
        del buf[:end]
        self._scan = 0
        # A plain head's lines are its CRLFs, counted by its parse's split (in C); it parses nothing past the
        # limit. Any other head is counted here, in C, before h11 spends Python time per line: a block of many
        # tiny fields is refused for the price of one scan.
        event = parse_plain_head(head, self._max_lines) if self._plain_heads else None
        if event is None:
            lines = head.count(b"\n")
            if lines > self._max_lines:
                raise ParseError("too many header fields", 431)
            event = self._h11_head(head, lines)
        self._head = event
        self._first_request = False
        return event

    def _h11_head(self, head: bytes, lines: int) -> RequestHead:
        """``head`` parsed by h11 (with a long credential set aside first: credential_line.py), or raise."""
        end = len(head)
        aside = set_aside(head, self._set_aside_bytes) if end > self._set_aside_bytes else None
        if aside is None:
            event = self._parse_head(head, head)
        else:
            event = self._parse_head(aside[0], head)
            if not _restore(event.headers, aside, lines - 2):  # less the request line and the empty one
                event = self._parse_head(head, head)  # cannot happen for a head set_aside accepted: h11 decides
        return RequestHead(event.method, event.target, event.http_version, header_pairs(event.headers))

    def _parse_head(self, data: bytes, head: bytes) -> h11.Request:
        """h11's Request for ``data`` (``head``, or its stand-in form), in a fresh parser, or raise."""
        parser = self._parser = h11.Connection(h11.SERVER, max_incomplete_event_size=self._max_head)
        parser.receive_data(data)
        try:
            event = parser.next_event()
        except h11.RemoteProtocolError as error:
            if head[:2] == _TLS_HANDSHAKE and self._first_request:  # a ClientHello holding a blank line
                raise NotHttp("a TLS handshake on a plain HTTP listener") from None
            raise ParseError(_ECHOED.sub("", str(error)), error.error_status_hint) from None
        if type(event) is not h11.Request:  # a complete head is a request or an error
            raise ParseError("malformed request head")
        return event

    def read_body(self, content_length: int, chunked: ChunkedDecoder | None = None) -> None:
        """After a request head: frame its body (``content_length`` bytes, -1 for none, or chunked).
        Without this call the body is framed as the head declares it, with no size limit."""
        reader = self._body = BodyReader(self._buf, max(content_length, 0), chunked)
        reader.closed = self._closed
        self._buf = bytearray()  # the reader owns the received bytes until ``next_cycle``

    def _frame_body_as_declared(self) -> None:
        length, chunked = 0, False
        for name, value in self._head.headers:  # validated (and merged, by h11) when parsed
            if name == b"transfer-encoding":
                chunked = True
            elif name == b"content-length":
                length = int(value)
        self.read_body(-1 if chunked else length, ChunkedDecoder(sys.maxsize, self._max_head) if chunked else None)

    @property
    def buffered(self) -> int:
        """Bytes received but not parsed yet (the rest of the current body, or a pipelined stream)."""
        body = self._body
        return len(self._buf) if body is None else len(body.stash)

    @property
    def expects_continue(self) -> bool:
        """The request announced ``Expect: 100-continue`` and has not sent its body yet."""
        parser = self._parser
        return parser is not None and parser.they_are_waiting_for_100_continue

    def next_cycle(self) -> None:
        """Start parsing the next request on this connection (after its response ended): the bytes
        after the body are the next request's, taken over as they are (no copy)."""
        body = self._body
        if body is None or not body.ended:
            raise RuntimeError("next_cycle before the request was read to its end")
        self._buf = body.stash
        self._closed = body.closed
        self._body = None
        self._parser = None
        self._head = None
        self._at_start = True
        self._scan = 0

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

    def whole_response(self, head: bytes, body: bytes, close: bool = False) -> bytes | None:
        """A whole response in one piece, framed once by whoever made it ready (a response cache hit:
        gateway/cache/entry.py ``ReadyAnswer``): ``head`` its start line and fields, its framing field
        (a Content-Length, or chunked with ``body`` framed so) included, without the Connection field and
        the blank line. Only for an HTTP/1.1 request other than HEAD; None: frame it with ``response_head``."""
        if not self._http11 or self._method == b"HEAD":
            return None
        must_close = self.must_close = close or not self._keep_alive
        self._mode = _NO_BODY
        return b"%b%b\r\n%b" % (head, _CLOSE_LINE if must_close else b"", body)

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

