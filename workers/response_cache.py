"""The exact response cache on the request path (docs/cache.md): one per worker, a step of the proxy only
when ``cache.enabled``.

``look_up`` (the step, before quota admission) decides what the request is to the cache:

- **bypass**: not cacheable (another API, not deterministic, ``Cache-Control: no-store``,
  ``x-gridgate-cache: bypass``) or the cache's Valkey failed lately: the request goes on as if there were
  no cache, and nothing is stored;
- **hit**: the entry is in Valkey (the lookup), or an identical request in flight (on this worker: no
  command; on another worker or host: this worker's poll of the key) has just made it. The request takes
  the quota's admission without tokens (it counts against request limits, and the deny set of revoked
  keys), is answered from the entry (the same bytes, a stream's SSE events whole), reaches no provider;
- **miss**: the request goes on to its provider as the *leader* of its key: its answer is captured as it
  is relayed (``CacheFill``, the relay's sink in front of the exchange) and, when it ended well, stored
  (one SET with the TTL, off the response path) and handed to the requests that waited on it.

The lookup is one command that also claims the key for coalescing across workers and hosts
(``SET key marker NX PX <wait> GET``: the entry, or nothing and the request leads, or another leader's
marker and the request waits); with coalescing off a plain GET. With the host index (shm/cache_index.py,
authoritative: the supervisor follows every host's announcements of its claims) a key nobody in the fleet
has is led at once: its claim (``SET NX PX``) and announcement (``PUBLISH``) leave with the tick's write,
nothing is awaited; a key the index knows, or an index that cannot tell, takes the awaited lookup. The
commands nobody waits for (claims, announcements, SETs) mostly get no reply (valkey/quiet_writer.py).
Valkey down: bypass, never an error (left alone ``_BACKOFF_S`` after a failure).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from gateway.cache.announce import announcement
from gateway.cache.commands import _CLAIM, _CLAIM_QUIET, _GET, _PING, _PUBLISH, _RELEASE, _SET, PENDING
from gateway.cache.entry import CacheEntry, ReadyAnswer, decode_entry, encode_entry
from gateway.cache.key import BYPASS, CacheKey, cache_key, key_parts, request_bypasses, request_digest
from gateway.cache.local import LocalEntries
from gateway.config.cache import Cache
from gateway.http.errors import ErrorReply
from gateway.metrics.writer import WorkerMetrics
from gateway.valkey.client import BACKEND_ERRORS, DEFAULT_TIMEOUT_S, create_client
from gateway.valkey.quiet_writer import QuietWriter
from gateway.valkey.tick_batch import TickBatch
from shm.cache_index import H_VALID_UNTIL, HOSTED, KNOWN, CacheIndex
from workers.cache_fill import _CONTENT_TYPE, CacheFill, Flight, HeldCells
from workers.outcomes import HitEnds, served_model_headers

if TYPE_CHECKING:
    from workers.exchange import Exchange
    from workers.request_record import RequestRecord

log = logging.getLogger("gridgate.cache")
_monotonic = time.monotonic
_time = time.time
HIT, MISS = "hit", "miss"
CACHE_HEADERS = {state: (b"x-gridgate-cache", state.encode()) for state in (HIT, MISS, BYPASS)}
# The verdict of a step that answered the request itself (a hit): the proxy ends the request there.
ANSWERED = ErrorReply(200, "answered_from_cache", "")
_BACKOFF_S = 1.0  # after a failed Valkey call the cache is bypassed this long (no timeout per request)
_FIELD_LINE = b"%b: %b\r\n".__mod__  # (name, value) -> its field line
_POLL_FIRST_S, _POLL_MAX_S = 0.002, 0.05  # a remote waiter's GETs: 2 ms apart at first, doubling to 50 ms
_AWAIT = object()
_CELL_HOLD_S = 0.05  # a stored key's cell is held this long (up to twice) when the index may not know it yet
_MAX_KNOWN = 8192  # request digests -> keys a worker remembers (of requests whose entry it stored or read)


class ResponseCache:
    """One worker's cache: its Valkey client, its flights in progress, its counters."""

    def __init__(self, config: Cache, client: Any, metrics: WorkerMetrics,
                 admit_hit: Callable[[Any], Any] | None = None, index: CacheIndex | None = None,
                 worker: int = 0, quiet: QuietWriter | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.client = client
        # Every GET and SET of a loop tick in one write; those nobody waits for mostly on ``quiet``'s
        # connection, which gets no replies (gateway/valkey/quiet_writer.py).
        self.quiet = quiet
        if quiet is not None:
            quiet.on_error = self._failed
        self.commands = TickBatch(client, quiet)
        self.commands.on_detached = self._written
        self.ttl_ms = int(config.ttl * 1000)
        self.ttl_text = b"%d" % self.ttl_ms
        self.ttl_s = self.ttl_ms / 1000
        self.max_entry = config.max_entry_bytes
        self.coalesce = config.coalesce.enabled
        self.max_waiters = config.coalesce.max_waiters
        self.wait_s = float(config.coalesce.wait)
        # The quota's admission of a hit, without tokens (the proxy's ``admit_hit``): None, an ErrorReply,
        # or an awaitable of either.
        self.admit_hit = admit_hit
        # How a hit's record closes (the proxy's ``HitEnds`` of its outcomes).
        self.ends: HitEnds | None = None
        local = config.local
        # A worker's own copies of recent entries (None: every hit reads Valkey).
        self.local = None if local is None else LocalEntries(local.max_bytes_int, float(local.ttl))
        self.flights: dict[bytes, Flight] = {}
        # The keys of requests whose entry this worker stored or read, by ``request_digest``: the same bytes
        # again (a repeated request: the likely next hit) skip making the key (a decode and a sorted encode).
        self.known_keys: dict[int, CacheKey] = {}
        # (tenant, API, model) -> its request_seed and its key_prefix
        self.seeds: dict[tuple[str | None, str, str], tuple[int, bytes]] = {}
        # How long a leader's claim lives in Valkey at most (a crashed leader holds nobody longer).
        self.lead_ms = b"%d" % max(1, int(self.wait_s * 1000))
        self.marker_base = PENDING + b"%d:" % os.getpid()
        self.claims = 0  # leaders' markers made (the marker's per-leader part)
        self.down_until = 0.0
        self.hits = self.misses = self.bypasses = self.coalesced = self.stored = self.backend_errors = 0
        self.local_hits = self.led_at_once = 0  # led at once: misses the host index let go with no awaited lookup
        self.known_ms = int(self.lead_ms) + self.ttl_ms  # a claim's key may exist this long: its wait, its TTL
        self._join_index(index if hasattr(client, "send_each") else None, worker)

    def _join_index(self, index: CacheIndex | None, worker: int) -> None:
        """The host index (shm.cache_index; None: every miss awaits its lookup; its commands go out with a
        single node's batched writes only), this worker's row in it, and the keys claimed this tick,
        announced in one PUBLISH as the tick's commands are written."""
        self.index = index
        self.worker = worker
        self.announced: list[bytes] = []
        # Stored keys' cells the index may not know yet, held a little longer (workers/cache_fill.py).
        self.held_cells = None if index is None else HeldCells(index, _CELL_HOLD_S)
        if index is not None:
            index.clear_worker(worker)  # a previous worker of this row may have died leading
            self.commands.before_flush = self._announce

    @classmethod
    def from_config(cls, config: Cache, quota_url: str | None, metrics: WorkerMetrics,
                    index: CacheIndex | None = None, worker: int = 0) -> ResponseCache:
        """The cache of ``config`` on its backend: its own URL, else the quota's Valkey; ``index``: the host
        index the supervisor made for it (when ``cache.index`` is on), ``worker`` this worker's row in it."""
        url = config.backend.url if config.backend is not None else quota_url
        if not url:
            raise ValueError("cache.backend: the cache needs a Valkey (cache.backend.url, or a quota block)")
        if config.index is None:
            index = None
        elif index is not None and not 0 <= worker < index.workers:
            index = None  # a row the index was not made for (cannot happen from the supervisor): no index
        client = create_client(url)
        quiet = QuietWriter.from_url(url, DEFAULT_TIMEOUT_S) if hasattr(client, "send_each") else None
        return cls(config, client, metrics, index=index, worker=worker, quiet=quiet)

    # -- the step -------------------------------------------------------------------------------------
    def look_up(self, flow: Any) -> ErrorReply | Awaitable[ErrorReply | None] | None:
        """The proxy's cache step: None (bypass: go on), ``ANSWERED`` (a hit from the worker's own copy,
        admitted at once), a refusal, or the awaitable of the lookup's verdict."""
        record = flow.record
        exchange = flow.exchange
        key = self._key(flow, exchange)
        now = _monotonic()
        if key is None or now < self.down_until:
            record.cache = BYPASS
            self.bypasses += 1
            self.metrics.cache_bypass()
            return None
        local = self.local
        if local is not None and (ready := local.get(key.key, now, _time())) is not None:
            self.local_hits += 1
            if key.digest not in self.known_keys:  # (a key made anew: its digest's was forgotten)
                self._remember(key)
            return self._serve_ready(flow, ready)
        flight = self.flights.get(key.key) if self.coalesce else None
        if flight is not None:
            if len(flight.waiters) < self.max_waiters:
                return self._wait(flow, key, flight)
            return self._alone(flow.record)  # beyond the bound of waiters: upstream on its own
        index = self.index
        if index is not None and index.header[H_VALID_UNTIL] > now:
            verdict = self._by_index(flow, key, index, now)
            if verdict is not _AWAIT:
                return verdict  # type: ignore[return-value]
        return self._get(flow, key) if not self.coalesce else self._claim(flow, key)

    def _by_index(self, flow: Any, key: CacheKey, index: CacheIndex, now: float) -> object:
        """An authoritative host index: a key nobody in the fleet stored or claimed, and no other worker of
        this host leads, is led at once (None: go on, nothing awaited); a key another worker of this host
        leads is waited for (its poll); anything else ``_AWAIT``s the lookup."""
        raw = key.raw
        if not self.coalesce:  # nothing to coalesce: only whether the key may exist matters
            if not raw or index.known(raw, now):
                return _AWAIT
            self._lead(flow.record, flow.exchange, key)
            self._announce_later(raw)
            self.led_at_once += 1
            return None
        cell = index.take(raw, self.worker, now) if raw else KNOWN
        if cell >= 0:
            self.claims += 1
            marker = self.marker_base + b"%d" % self.claims
            name = key.key
            self._lead(flow.record, flow.exchange, key, marker, cell)
            # Its claim, for the other hosts (their index hears of it by the announcement): nobody waits.
            self.commands.send_quiet(_CLAIM_QUIET % (len(name), name, len(marker), marker, len(self.lead_ms),
                                                     self.lead_ms))
            self._announce_later(raw)
            self.led_at_once += 1
            return None
        if cell != HOSTED:
            return _AWAIT
        name = key.key
        flight = self.flights.get(name)
        if flight is None:
            flight = self.flights[name] = Flight(remote=True, hosted=raw)
            asyncio.ensure_future(self._poll(name, flight))
        if len(flight.waiters) < self.max_waiters:
            return self._wait(flow, key, flight)
        return self._alone(flow.record)

    def _announce_later(self, raw: bytes) -> None:
        """The key of ``raw`` (its digest) is claimed: announce it with this tick's write (one PUBLISH for
        the tick's claims)."""
        announced = self.announced
        if not announced:
            self.commands.flush_soon()
        announced.append(raw)

    def _announce(self) -> None:
        names = self.announced
        if names:
            self.announced = []
            payload = announcement(self.known_ms, names)
            self.commands.send_quiet(_PUBLISH % (len(payload), payload))

    def _alone(self, record: RequestRecord) -> None:
        record.cache = MISS  # on its own: not a leader, its answer is not stored
        self.misses += 1
        self.metrics.cache_miss(record.tenant)

    def _key(self, flow: Any, exchange: Exchange) -> CacheKey | None:
        """The request's key, or None when it bypasses the cache."""
        if exchange.method != b"POST":
            return None
        surface = flow.admitted.route.surface.name
        headers = dict(exchange.headers)  # by lowercase name, the last one wins (one C call, not a loop)
        cache_control, cache_header = headers.get(b"cache-control"), headers.get(b"x-gridgate-cache")
        if (cache_control is not None or cache_header is not None) and request_bypasses(cache_control, cache_header):
            return None
        tenant, model, body = flow.admitted.tenant, flow.request.name, exchange.body
        seeds = self.seeds
        seeded = seeds.get((tenant, surface, model))
        if seeded is None:
            if len(seeds) >= _MAX_KNOWN:
                seeds.clear()
            seeded = seeds[(tenant, surface, model)] = key_parts(self.config, surface, tenant, model)
        digest = request_digest(seeded[0], surface, body, headers)
        known = self.known_keys.get(digest)
        if known is not None:
            return known
        return cache_key(self.config, surface, tenant, model, body, headers, digest, seeded[1])

    def _remember(self, key: CacheKey) -> None:
        """``key`` has an entry: a request of the same bytes finds its key without making it."""
        known = self.known_keys
        if key.digest not in known:
            if len(known) >= _MAX_KNOWN:
                known.clear()
            known[key.digest] = key

    def _bypass_after(self, flow: Any, error: BaseException) -> None:
        """A failed lookup: the request goes on as if there were no cache (never an error)."""
        self._failed(error)
        flow.record.cache = BYPASS
        self.bypasses += 1
        self.metrics.cache_bypass()

    async def _get(self, flow: Any, key: CacheKey) -> ErrorReply | None:
        try:
            data = await self.commands.call(b"GET", key.key, encoded=_GET % (len(key.key), key.key))
        except BACKEND_ERRORS as error:
            return self._bypass_after(flow, error)
        entry = None if data is None else decode_entry(data)
        if entry is not None:
            self._remember(key)
            if self.local is not None:
                self.local.put(key.key, entry, len(data), _monotonic())
            verdict = self._serve(flow, entry)
            return verdict if verdict is None or isinstance(verdict, ErrorReply) else await verdict
        self._lead(flow.record, flow.exchange, key)  # coalescing off: nobody waits for it
        if self.index is not None and key.raw:
            self._announce_later(key.raw)
        return None

    async def _claim(self, flow: Any, key: CacheKey) -> ErrorReply | None:
        """Coalescing across workers and hosts: one command reads the entry and, when there is none,
        claims the key for this request (it leads) or finds another's claim (this worker waits for it)."""
        name = key.key
        self.claims += 1
        marker = self.marker_base + b"%d" % self.claims
        try:
            data = await self.commands.call(b"SET", name, marker, b"NX", b"PX", self.lead_ms, b"GET", encoded=_CLAIM % (
                len(name), name, len(marker), marker, len(self.lead_ms), self.lead_ms))
        except BACKEND_ERRORS as error:
            return self._bypass_after(flow, error)
        if data is None:  # claimed: this request leads
            self._lead(flow.record, flow.exchange, key, marker)
            if self.index is not None and key.raw:
                self._announce_later(key.raw)
            return None
        flight = self.flights.get(name)
        if data[:1] == b"\x00":  # another's claim: wait with this worker's poll of it (or its own leader)
            if flight is None:
                flight = self.flights[name] = Flight(remote=True)
                asyncio.ensure_future(self._poll(name, flight))
            if len(flight.waiters) < self.max_waiters:
                return await self._wait(flow, key, flight)
            return self._alone(flow.record)
        entry = decode_entry(data)
        if entry is None:  # a value this version cannot read: go on alone, leave it be
            return self._alone(flow.record)
        self._remember(key)
        if self.local is not None:
            self.local.put(name, entry, len(data), _monotonic())
        verdict = self._serve(flow, entry)
        return verdict if verdict is None or isinstance(verdict, ErrorReply) else await verdict

    async def _poll(self, name: bytes, flight: Flight) -> None:
        """Read another worker's or host's leader's entry until it is there (release the waiters with it),
        its claim is gone (it failed or expired: release them to go on their own) or the wait is over."""
        entry = None
        pause = _POLL_FIRST_S
        deadline = _monotonic() + self.wait_s
        hosted = flight.hosted  # a host leader's key: nothing stored yet is not the end while it still leads
        grace = hosted is not None
        try:
            while _monotonic() < deadline and flight.waiters:
                await asyncio.sleep(pause)
                pause = min(pause * 2, _POLL_MAX_S)
                data = await self.commands.call(b"GET", name, encoded=_GET % (len(name), name))
                if data is None:
                    if hosted is not None and self.index is not None and self.index.hosted(hosted, self.worker):
                        continue
                    if grace:  # it just stopped leading: its SET may be in its tick's write still
                        grace = False
                        continue
                    break
                if data[:1] != b"\x00":
                    entry = decode_entry(data)
                    if entry is not None and self.local is not None:
                        self.local.put(name, entry, len(data), _monotonic())
                    break
        except BACKEND_ERRORS as error:
            self._failed(error)
        finally:
            if self.flights.get(name) is flight:
                del self.flights[name]
            flight.release(entry)

    def _wait(self, flow: Any, key: CacheKey, flight: Flight) -> Awaitable[ErrorReply | None]:
        # The flight's waiter joins now: its poll, which may run before the request's task, sees it.
        waiter: asyncio.Future[CacheEntry | None] = asyncio.get_running_loop().create_future()
        flight.waiters.append(waiter)
        return self._waited(flow, flight, waiter)

    async def _waited(self, flow: Any, flight: Flight, waiter: asyncio.Future[CacheEntry | None]) -> ErrorReply | None:
        """Wait (bounded) for the leader's answer; without it (it failed, or took too long) go on alone."""
        entry = None
        try:
            async with asyncio.timeout(self.wait_s):
                entry = await waiter
        except TimeoutError:
            if waiter in flight.waiters:
                flight.waiters.remove(waiter)
        if entry is not None:
            self.coalesced += 1
            verdict = self._serve(flow, entry)
            return verdict if verdict is None or isinstance(verdict, ErrorReply) else await verdict
        return self._alone(flow.record)

    def _lead(self, record: RequestRecord, exchange: Exchange, key: CacheKey, marker: bytes | None = None,
              cell: int = -1) -> None:
        record.cache = MISS
        self.misses += 1
        self.metrics.cache_miss(record.tenant)
        flight = None
        if self.coalesce:
            flight = self.flights[key.key] = Flight(marker, cell=cell)
        record.cache_fill = CacheFill(self, exchange, key, flight)

    def _serve(self, flow: Any, entry: CacheEntry) -> ErrorReply | Awaitable[ErrorReply | None]:
        """Answer from ``entry`` (read from Valkey, or another request's just now), as ``_serve_ready``."""
        return self._serve_ready(flow, ReadyAnswer(entry))

    def _serve_ready(self, flow: Any, ready: ReadyAnswer) -> ErrorReply | Awaitable[ErrorReply | None]:
        """Answer from ``ready`` once the quota admitted the request (a refusal is the answer then): at once
        when the admission needs no wait (a worker-held block, or no quota), else after it."""
        admit = self.admit_hit
        verdict = None if admit is None else admit(flow)
        if verdict is None:
            return self._answer(flow, ready)
        if isinstance(verdict, ErrorReply):
            return verdict
        return self._answer_after(flow, ready, verdict)

    async def _answer_after(self, flow: Any, ready: ReadyAnswer, pending: Awaitable[ErrorReply | None]) -> ErrorReply:
        return self._answer(flow, ready) if (verdict := await pending) is None else verdict

    def _answer(self, flow: Any, ready: ReadyAnswer) -> ErrorReply:
        """The hit's answer: the entry's bytes, recorded with what they saved; ``ANSWERED``."""
        record = flow.record
        exchange = flow.exchange
        if exchange.client_gone:
            return ANSWERED  # nothing to answer: the record closes as the client's leaving
        self.hits += 1
        saved_nusd = ready.saved_nusd
        self.metrics.hit_answered(record.tenant, saved_nusd)  # its request's count too
        record.ends = self.ends  # closed as a hit: no attempt, nothing to settle (HitEnds)
        record.cache = HIT
        record.status = ready.status
        record.cost_nusd = 0
        record.saved_tokens = ready.saved_tokens
        record.saved_nusd = saved_nusd
        model = ready.model
        if model is not None and model != record.capability:
            record.served_model = model  # a fallback chain's model made the answer
        # An alias or a fallback chain: which model served (docs/models.md).
        served = None if record.model_route is None else served_model_headers(record)
        head = ready.head % (record.request_id, b"".join(map(_FIELD_LINE, served)) if served else b"")
        if not exchange.answer_whole(head, ready.body, ready.size):
            _answer_framed(exchange, record, ready.entry, served)  # a client the ready bytes cannot answer
        return ANSWERED

    # -- storing ----------------------------------------------------------------------------------------
    def store(self, fill: CacheFill, record: RequestRecord) -> None:
        """The leader's request is over: store its answer when it ended well, and release its waiters."""
        key = fill.key
        name = key.key
        flight = fill.flight
        if flight is not None and self.flights.get(name) is flight:
            del self.flights[name]
        entry = fill.entry(record, _time() + self.ttl_s)
        if entry is not None:
            value = encode_entry(entry)
            if len(value) <= self.max_entry:
                self._remember(key)
                self._write(name, value)
                if self.local is not None:
                    self.local.put(name, entry, len(value), _monotonic())
            else:
                entry = None
        if flight is not None:
            if entry is None and flight.marker is not None:  # its claim goes: the others go on their own now
                self.commands.send(b"EVAL", _RELEASE, 1, name, flight.marker, quiet=True)  # rare
            if flight.cell >= 0:  # this worker no longer leads the key of its in-flight cell
                if entry is None:
                    self.index.release(flight.cell)  # type: ignore[union-attr]
                else:
                    self.held_cells.hold(flight.cell)  # type: ignore[union-attr]
            if flight.waiters:
                flight.release(entry)

    def _write(self, key: bytes, value: bytes) -> None:
        # In this tick's write; nobody waits, and mostly no reply comes (``send_quiet``: CLIENT REPLY OFF),
        # so ``stored`` counts the SETs written. Framed here in one %-format (no per-argument encoding loop).
        self.stored += 1
        self.commands.send(b"SET", key, value, b"PX", self.ttl_ms, quiet=True,
                           encoded=_SET % (len(key), key, len(value), value, len(self.ttl_text), self.ttl_text))

    def _written(self, error: BaseException | None) -> None:
        if error is not None:
            self._failed(error)

    async def synced(self) -> None:
        """Every command written so far was served (a PING behind them answered, on each connection)."""
        await self.commands.call(b"PING", encoded=_PING)
        if self.quiet is not None:
            await self.quiet.synced()

    def _failed(self, error: BaseException) -> None:
        self.backend_errors += 1
        self.metrics.cache_backend_error()
        if _monotonic() >= self.down_until:
            log.warning("the cache's Valkey failed (%s): bypassed for %.0f s", type(error).__name__, _BACKOFF_S)
        self.down_until = _monotonic() + _BACKOFF_S

    async def close(self) -> None:
        with contextlib.suppress(TimeoutError, *BACKEND_ERRORS):  # the SETs written are served first (1 s at most)
            await asyncio.wait_for(self.synced(), 1.0)
        await self.client.aclose()
        if self.quiet is not None:
            await self.quiet.aclose()


def _answer_framed(exchange: Exchange, record: RequestRecord, entry: CacheEntry,
                   served: list[tuple[bytes, bytes]] | None) -> None:
    """A hit's answer framed the general way (an HTTP/1.0 client, a browser's CORS fields): the same fields."""
    headers = [(b"x-request-id", record.request_id), CACHE_HEADERS[HIT], *(served or ())]
    if entry.content_type is not None:
        headers.insert(0, (_CONTENT_TYPE, entry.content_type))
    exchange.start(entry.status, headers, None if entry.stream else len(entry.body))
    exchange.write(entry.body)
    exchange.end()  # closes the record (workers/outcomes.py), then the bytes leave
