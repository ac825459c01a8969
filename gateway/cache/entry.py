"""A cached answer as stored in Valkey: one msgpack value, what a hit needs to answer and to record what
it saved. Pure."""

from __future__ import annotations

from http import HTTPStatus

import msgspec


class CacheEntry(msgspec.Struct, array_like=True, gc=False):
    """The answer (its status, content type and body bytes exactly as the client received them: a
    stream's SSE events whole), and its usage and cost when it was made (the savings of every hit)."""

    status: int
    content_type: bytes | None
    body: bytes
    stream: bool
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cost_nusd: int | None = None
    model: str | None = None  # the model that served it
    expires_at: float = 0.0  # epoch seconds it expires at in Valkey (a worker's local copy dies with it)

    @property
    def saved_tokens(self) -> int | None:
        prompt, completion = self.prompt_tokens, self.completion_tokens
        if prompt is None and completion is None:
            return None
        return (prompt or 0) + (completion or 0)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(CacheEntry)


def encode_entry(entry: CacheEntry) -> bytes:
    return _encoder.encode(entry)


def decode_entry(data: bytes) -> CacheEntry | None:
    """The stored entry, or None for a value this version cannot read (treated as a miss)."""
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


_STATUS_LINES = {status.value: b"HTTP/1.1 %d %s\r\n" % (status.value, status.phrase.encode()) for status in HTTPStatus}


class ReadyAnswer:
    """An entry made ready to answer with, once per copy (gateway/cache/local.py): a hit then formats its
    head from one template (its request id and the fields only it has go in) and writes head and body at
    once, with no framing step per hit. ``head``: the start line and fields of an HTTP/1.1 response
    (``%b`` for the request id and for the hit's own fields), its framing field last; ``body``: the
    entry's body framed to match (a stream as one chunk and the last chunk: the same events, byte for
    byte). A client the template cannot answer (HTTP/1.0, a browser's CORS fields) gets the entry framed
    the general way."""

    __slots__ = ("entry", "status", "saved_tokens", "saved_nusd", "model", "size", "head", "body")

    def __init__(self, entry: CacheEntry) -> None:
        self.entry = entry
        # What every hit of it records (read here, not from the entry: one attribute each).
        self.status = entry.status
        self.saved_tokens = entry.saved_tokens
        self.saved_nusd = entry.cost_nusd
        self.model = entry.model
        body = entry.body
        self.size = len(body)
        # A 200: the only status stored (workers/response_cache.py).
        start = _STATUS_LINES.get(entry.status) or b"HTTP/1.1 %d \r\n" % entry.status
        if entry.content_type is not None:
            start += b"content-type: " + entry.content_type.replace(b"%", b"%%") + b"\r\n"
        if entry.stream:
            framing = b"transfer-encoding: chunked\r\n"
            self.body = (b"%x\r\n%b\r\n" % (len(body), body) if body else b"") + b"0\r\n\r\n"
        else:
            framing = b"content-length: %d\r\n" % len(body)
            self.body = body
        self.head = start + b"x-request-id: %b\r\nx-gridgate-cache: hit\r\n%b" + framing
