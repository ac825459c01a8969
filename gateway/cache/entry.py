"""A cached answer as stored in Valkey: one msgpack value, what a hit needs to answer and to record what
it saved. Pure."""

from __future__ import annotations

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
