"""Strict-intermediary checks that h11 does not make (RFC 9112 §§2.2, 3.2, 5, 6, 7.1; RFC 9110 §7.6.1).

Pure functions over the parsed request head, plus a raw scanner for chunked request bodies: h11
accepts absurd chunk sizes and unbounded chunk extensions when a chunk header arrives in one piece.
Every rejection here closes the connection: once framing is in doubt nothing more is read from it.
"""

from __future__ import annotations

from gateway.http.errors import ErrorReply, GatewayError

MAX_CHUNK_LINE = 4096  # chunk-size line including extensions
MAX_CHUNK_SIZE_DIGITS = 16
_HEX_DIGITS = b"0123456789abcdefABCDEF"


def _reject(status: int, code: str, message: str) -> GatewayError:
    return GatewayError(ErrorReply(status, code, message, close=True))


class RequestFraming:
    """The framing facts of a validated request head."""

    __slots__ = ("target", "content_length", "chunked", "keep_alive")

    def __init__(self, target: bytes, content_length: int, chunked: bool, keep_alive: bool) -> None:
        self.target = target
        self.content_length = content_length
        self.chunked = chunked
        self.keep_alive = keep_alive  # HTTP/1.1 without `Connection: close`


def check_request_head(
    method: bytes,
    target: bytes,
    version: bytes,
    headers: list[tuple[bytes, bytes]],
    max_url_bytes: int,
    max_body_bytes: int,
) -> RequestFraming:
    """Validate what h11 let through; return the origin-form target and body framing, or raise."""
    if version != b"1.1" and version != b"1.0":
        raise _reject(505, "http_version_not_supported", "only HTTP/1.0 and HTTP/1.1 are supported")
    if len(target) > max_url_bytes:
        raise _reject(414, "uri_too_long", f"request target longer than {max_url_bytes} bytes")
    if method == b"CONNECT":
        raise _reject(405, "method_not_allowed", "CONNECT is not supported by this gateway")
    if target[:1] != b"/":
        target = _origin_form(target)
    content_length = -1
    chunked = False
    hosts = 0
    keep_alive = version == b"1.1"
    for name, value in headers:
        if name == b"host":
            hosts += 1
            if not value or b"," in value or b" " in value or b"\t" in value:
                raise _reject(400, "invalid_host", "Host must be a single non-empty authority")
        elif name == b"content-length":
            content_length = int(value)
        elif name == b"transfer-encoding":
            chunked = True
        elif name == b"connection" and keep_alive and b"close" in value.lower():
            keep_alive = not any(token.strip() == b"close" for token in value.lower().split(b","))
    if hosts == 0 and version == b"1.1":
        raise _reject(400, "invalid_host", "HTTP/1.1 requests need a Host header")
    if chunked:
        if content_length >= 0:
            raise _reject(400, "invalid_framing", "both Content-Length and Transfer-Encoding are present")
        if version == b"1.0":
            raise _reject(400, "invalid_framing", "Transfer-Encoding is not allowed in HTTP/1.0")
    if content_length > max_body_bytes:
        raise _reject(413, "request_too_large", f"request body larger than {max_body_bytes} bytes")
    return RequestFraming(target, content_length, chunked, keep_alive)


def _origin_form(target: bytes) -> bytes:
    """Absolute-form (RFC 9112 §3.2.2) becomes origin-form; asterisk and authority forms are refused."""
    lowered = target.lower()
    for scheme in (b"http://", b"https://"):
        if lowered.startswith(scheme):
            rest = target[len(scheme):]
            slash = rest.find(b"/")
            query = rest.find(b"?")
            if slash < 0 and query < 0:
                return b"/"
            if slash < 0 or (0 <= query < slash):
                return b"/" + rest[query:]
            return rest[slash:]
    if target == b"*":
        raise _reject(400, "invalid_target", "asterisk-form request targets are not supported")
    raise _reject(400, "invalid_target", "request target must be origin-form or absolute-form")


class ChunkedBodyGuard:
    """Scans a chunked request body on the wire before h11 sees it.

    Rejects chunk-size lines that are too long (oversized extensions), sizes with too many digits,
    a declared total above the body limit, and oversized trailer sections. Bytes after the final
    chunk belong to the next pipelined request and are ignored.
    """

    __slots__ = ("_max_body", "_max_trailers", "_line", "_remaining", "_state", "_total", "_trailer_bytes")

    _SIZE, _DATA, _DATA_CRLF, _TRAILERS, _DONE = range(5)

    def __init__(self, max_body_bytes: int, max_trailer_bytes: int) -> None:
        self._max_body = max_body_bytes
        self._max_trailers = max_trailer_bytes
        self._line = b""
        self._remaining = 0
        self._state = self._SIZE
        self._total = 0
        self._trailer_bytes = 0

    @property
    def done(self) -> bool:
        return self._state == self._DONE

    def feed(self, data: bytes) -> None:
        """Inspect the next body bytes; raise GatewayError (close) on a framing violation."""
        pos, end = 0, len(data)
        while pos < end and self._state != self._DONE:
            state = self._state
            if state == self._DATA:
                step = min(self._remaining, end - pos)
                self._remaining -= step
                pos += step
                if self._remaining == 0:
                    self._state = self._DATA_CRLF
                    self._remaining = 2
                continue
            if state == self._DATA_CRLF:
                step = min(self._remaining, end - pos)
                self._remaining -= step
                pos += step
                if self._remaining == 0:
                    self._state = self._SIZE
                continue
            newline = data.find(b"\n", pos)
            piece = data[pos:] if newline < 0 else data[pos:newline + 1]
            pos += len(piece)
            self._line += piece
            if state == self._SIZE:
                if len(self._line) > MAX_CHUNK_LINE:
                    raise _reject(400, "invalid_chunk", "chunk header or extension too long")
                if newline >= 0:
                    self._end_size_line()
            else:
                self._trailer_bytes += len(piece)
                if self._trailer_bytes > self._max_trailers:
                    raise _reject(431, "trailers_too_large", "chunked trailer section too large")
                if newline >= 0:
                    if self._line in (b"\r\n", b"\n"):
                        self._state = self._DONE
                    self._line = b""

    def _end_size_line(self) -> None:
        size_text = self._line.split(b";", 1)[0].strip()
        self._line = b""
        if not size_text or len(size_text) > MAX_CHUNK_SIZE_DIGITS or size_text.strip(_HEX_DIGITS):
            raise _reject(400, "invalid_chunk", "invalid chunk size")
        size = int(size_text, 16)
        self._total += size
        if self._total > self._max_body:
            raise _reject(413, "request_too_large", f"request body larger than {self._max_body} bytes")
        if size == 0:
            self._state = self._TRAILERS
        else:
            self._state = self._DATA
            self._remaining = size
