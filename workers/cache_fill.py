"""A leader's flight (the requests waiting on its answer), ``CacheFill``, the capture of its answer as
the relay writes it (workers/response_cache.py, its ``cache``, stores what it captured), and the in-flight
cells of the keys a worker just stored (``HeldCells``)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from gateway.cache.entry import CacheEntry
from gateway.cache.key import CacheKey
from gateway.http.media import is_event_stream

if TYPE_CHECKING:
    from shm.cache_index import CacheIndex
    from workers.exchange import Exchange
    from workers.request_record import RequestRecord

_DONE = b"data: [DONE]"
_OPENAI_STREAMS = frozenset(("chat_completions", "completions"))  # end with [DONE] when complete
_CONTENT_TYPE = b"content-type"
_STREAM_TYPES: dict[bytes | None, bool] = {}  # an answer's content type -> whether it is an event stream


class Flight:
    """The leader of one key in flight on this worker (or, ``remote``, this worker's poll of another
    worker's or host's leader), and the requests waiting for its answer."""

    __slots__ = ("waiters", "marker", "remote", "cell", "hosted")

    def __init__(self, marker: bytes | None = None, remote: bool = False, cell: int = -1,
                 hosted: bytes | None = None) -> None:
        self.waiters: list[asyncio.Future[CacheEntry | None]] = []
        self.marker = marker  # the leader's pending marker in Valkey (None: it claimed nothing)
        self.remote = remote
        self.cell = cell  # a leader's own cell in the host's in-flight table (-1: none)
        self.hosted = hosted  # a poll of another worker of this host: the key's digest (its cell says it leads)

    def release(self, entry: CacheEntry | None) -> None:
        for waiter in self.waiters:
            if not waiter.done():
                waiter.set_result(entry)
        self.waiters = []


class HeldCells:
    """A worker's in-flight cells (shm/cache_index.py) of keys it just stored, held ``hold_s`` more: meanwhile
    the other workers of the host wait for the key and read its entry, instead of taking it for unknown
    while its announcement may still be on its way to the supervisor. Released by generation: every
    ``hold_s`` while any are held, those held since the last time (each cell one to two periods; one
    timer and one call for all of them, no clock read per key)."""

    __slots__ = ("index", "hold_s", "held", "aging")

    def __init__(self, index: CacheIndex, hold_s: float) -> None:
        self.index = index
        self.hold_s = hold_s
        self.held: list[int] = []  # this period's
        self.aging: list[int] = []  # the last period's: released at the next timer

    def hold(self, cell: int) -> None:
        held = self.held
        if not held and not self.aging:
            asyncio.get_running_loop().call_later(self.hold_s, self._release)
        held.append(cell)

    def _release(self) -> None:
        self.index.release_all(self.aging)
        self.aging, self.held = self.held, []
        if self.aging:
            asyncio.get_running_loop().call_later(self.hold_s, self._release)


class CacheFill:
    """A leader's answer, captured as the relay writes it: the relay's sink in front of the exchange (it
    reads only what the relay writes to the client, so a stream rewritten for usage is stored as the
    client saw it). Past ``max_entry`` it stops keeping bytes; the answer is then not stored."""

    __slots__ = ("cache", "exchange", "key", "flight", "status", "content_type", "parts", "size")

    def __init__(self, cache: Any, exchange: Exchange, key: CacheKey, flight: Flight | None) -> None:
        self.cache = cache
        self.exchange = exchange
        self.key = key
        self.flight = flight
        self.status = 0
        self.content_type: bytes | None = None
        self.parts: list[bytes] | None = []
        self.size = 0

    # -- what the relay uses of its exchange: the common ones here, anything else from the exchange itself
    def __getattr__(self, name: str) -> Any:
        return getattr(self.exchange, name)

    @property
    def admitted(self) -> Any:
        return self.exchange.admitted

    @property
    def client_gone(self) -> bool:
        return self.exchange.client_gone

    @property
    def error_shape(self) -> int:
        return self.exchange.error_shape

    def start(self, status: int, headers: list[tuple[bytes, bytes]], content_length: int | None = None) -> None:
        self.status = status
        self.content_type = dict(headers).get(_CONTENT_TYPE)  # one C call, not a loop over the headers
        self.exchange.start(status, headers, content_length)

    def write(self, data: bytes) -> None:
        parts = self.parts
        if parts is not None:
            self.size += len(data)
            if self.size > self.cache.max_entry:
                self.parts = None
            else:
                parts.append(data)
        self.exchange.write(data)

    def flush(self) -> None:
        self.exchange.flush()

    def end(self) -> None:
        self.exchange.end()

    def abort(self) -> None:
        self.parts = None  # a cut answer is never stored
        self.exchange.abort()

    # -- the end
    def entry(self, record: RequestRecord, expires_at: float) -> CacheEntry | None:
        """What to store: a 200 that ended well, whole and under the cap (a complete stream: its [DONE])."""
        parts = self.parts
        if parts is None or self.status != 200 or record.status != 200 or record.error is not None:
            return None
        body = b"".join(parts)
        content_type = self.content_type
        stream = _STREAM_TYPES.get(content_type)
        if stream is None:
            if len(_STREAM_TYPES) >= 64:  # (content types are few; a bound all the same)
                _STREAM_TYPES.clear()
            stream = _STREAM_TYPES[content_type] = is_event_stream(content_type)
        if stream:
            if self.key.stream is False and not body:
                return None
            admitted = self.exchange.admitted
            if admitted is not None and admitted.route.surface.name in _OPENAI_STREAMS and _DONE not in body[-64:]:
                return None  # a stream cut before its [DONE]
        return CacheEntry(200, content_type, body, stream, record.tokens_prompt, record.tokens_completion,
                          record.cost_nusd, record.served, expires_at)
