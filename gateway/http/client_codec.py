"""The client side of the HTTP/1.1 codec seam (see gateway/http/codec.py): requests to a provider
out, its responses in, and whether the connection may carry another request."""

from __future__ import annotations

import sys

import h11

from gateway.http.codec import END, NEED_DATA, PAUSED, Body, ParseError, _head_bytes, header_pairs
from gateway.http.errors import GatewayError
from gateway.http.framing import ChunkedDecoder

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
    beyond the declared length are never kept, only noted. Chunked bodies go through the strict decoder
    of gateway/http/framing.py: h11's chunked reader costs a streamed event several times as much (most of
    a first token's relay when the worker wakes up cold), and the decoder is the one request bodies use.
    """

    __slots__ = ("_parser", "_max_head", "_method", "_primed", "_head_start", "_left", "_chunks", "_pending",
                 "_ended", "_eof", "_reuse", "_tainted", "_informational", "head_headers", "framing_doubt")

    def __init__(self, max_header_bytes: int = 65536) -> None:
        self._max_head = max_header_bytes
        self._parser = h11.Connection(h11.CLIENT, max_incomplete_event_size=max_header_bytes)
        self._method = b"GET"
        # A canned request went through the parser for this response, or none is needed any more.
        self._primed = False
        self._head_start = b""  # the first bytes of a response, until its status class is known
        # A body framed here: the bytes still due of a length-framed one (-1: not length-framed), the
        # decoder of a chunked one (None: not chunked; with both unset h11 frames the response), the
        # bytes received and not yet handed out, and whether the body ended.
        self._left = -1
        self._chunks: ChunkedDecoder | None = None
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
        if self._left >= 0 or self._chunks is not None:  # a body framed here
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
        if self._chunks is not None:
            return self._chunked_body_event(self._chunks)
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

    def _chunked_body_event(self, decoder: ChunkedDecoder):  # -> Body | EndOfMessage | NEED_DATA | PAUSED
        if self._ended:
            return PAUSED
        pending = self._pending
        if decoder.error is not None:  # met after the pieces before it were handed out
            raise ParseError(str(decoder.error), 502)
        if pending and not decoder.done:
            try:
                pieces, used = decoder.feed_until_error(pending)
            except GatewayError as error:
                raise ParseError(str(error), 502) from None
            # The decoder stops at the body's end: what it leaves is after the answer (taints the connection).
            self._pending = pending[used:] if used < len(pending) else b""
            if pieces:
                return Body(pieces[0] if len(pieces) == 1 else b"".join(pieces))
        if decoder.done:
            self._ended = True
            if self._pending:
                self._tainted = True
                self._pending = b""
            return END
        if self._eof:  # the provider closed before the last chunk
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
        if bodiless or doubt or (length < 0 and not chunked):
            return  # h11 frames it: no body, both framings (refused at the relay), or until close
        if chunked:
            self._chunks = ChunkedDecoder(sys.maxsize, self._max_head)  # a stream's length has no bound here
        else:
            self._left = length
        pending, closed = self._parser.trailing_data
        self._pending = bytes(pending)
        self._ended = False
        if closed:
            self._eof = self._tainted = True

    @property
    def reusable(self) -> bool:
        """The response ended cleanly, its framing could be read one way only, and nothing followed it."""
        if not self._reuse or self._tainted:
            return False
        if self._left >= 0 or self._chunks is not None:
            return self._ended
        parser = self._parser
        after, closed = parser.trailing_data
        return parser.their_state is h11.DONE and not after and not closed

    @property
    def buffered(self) -> int:
        """Bytes received and not handed out yet (bounded: a head is at most ``max_header_bytes``)."""
        if self._chunks is not None:
            return len(self._pending) + self._chunks.pending
        if self._left >= 0:
            return len(self._pending)
        return len(self._parser.trailing_data[0]) + len(self._head_start)

    def next_cycle(self) -> None:
        """A fresh parser for the next response on this connection (called only when ``reusable``)."""
        self._parser = h11.Connection(h11.CLIENT, max_incomplete_event_size=self._max_head)
        self._primed = False
        self._left = -1
        self._chunks = None
