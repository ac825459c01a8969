"""The host index's one writer (docs/cache.md, "The host index"): the supervisor follows the cache's
announcements and scans the store, so the workers can tell a key nobody has from one somebody may have.

The order makes it exact at the start: subscribed first, scanned second (every key stored or claimed
before the subscription is in the scan, every one after it is in a message), and only then authoritative.
Authority lasts ``GRACE_S`` past the last sign of life of the subscription (a message, or the pong of a
ping every ``PING_S``): a connection that stops carrying messages stops being trusted in a second or two,
and a lost one is trusted again only after a new subscription and a new scan. Meanwhile the workers take
the awaited lookup, as without an index.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from gateway.cache.announce import CHANNEL, KEY_PATTERN, key_digest, parse_announcement
from gateway.valkey.client import BACKEND_ERRORS, describe_error
from gateway.valkey.resp import RespClient
from gateway.valkey.resp_wire import encode_command
from gateway.valkey.subscription import Subscription
from shm.cache_index import CacheIndexWriter, place_of

log = logging.getLogger("gridgate.cache")
PING_S = 0.5
GRACE_S = 1.5
TIMEOUT_S = 2.0
SCAN_COUNT = 1000
RETRY_MAX_S = 5.0


class IndexFollower:
    """Subscribes, scans, keeps the index; reconnects with backoff; non-authoritative whenever in doubt."""

    def __init__(self, url: str, writer: CacheIndexWriter, claim_ms: int, ttl_ms: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.url = url
        self.writer = writer
        self.buckets = writer.index.buckets
        self.claim_ms, self.ttl_ms = claim_ms, ttl_ms
        self.clock = clock
        self.live = False  # subscribed and scanned: signs of life extend the authority
        self.announced = self.scanned = self.scans = self.losses = 0
        self.authoritative = asyncio.Event()  # set once the first scan ended (tests and the start wait for it)

    async def run(self) -> None:
        """Follow until cancelled."""
        pause = 0.1
        while True:
            try:
                await self._follow()
            except BACKEND_ERRORS as error:
                self.losses += 1
                log.warning("cache index: %s; the workers use the awaited lookup until it is back",
                            describe_error(error))
            except Exception:  # a bug must not end the follower: it only costs the awaited path meanwhile
                log.exception("cache index: the follower failed")
            await asyncio.sleep(pause)
            pause = min(pause * 2, RETRY_MAX_S)

    async def _follow(self) -> None:
        subscription = await Subscription.open(self.url, CHANNEL, self._on_message, self._on_alive, TIMEOUT_S)
        try:
            await self._scan()
            self.live = True
            self._on_alive()
            self.authoritative.set()
            while True:
                subscription.ping()
                done, _ = await asyncio.wait({subscription.lost}, timeout=PING_S)
                if done:
                    subscription.lost.result()  # raises why
        finally:
            self.live = False
            self.writer.set_valid_until(0.0)
            subscription.close()

    def _on_alive(self) -> None:
        if self.live:
            self.writer.set_valid_until(self.clock() + GRACE_S)

    def _on_message(self, payload: bytes) -> None:
        try:
            known_ms, digests = parse_announcement(payload)
        except ValueError:
            return  # not ours: nothing to learn
        now = self.clock()
        until = now + known_ms / 1000
        note, buckets = self.writer.note, self.buckets
        for digest in digests:
            note(place_of(digest, buckets), until, now)
        self.announced += len(digests)

    async def _scan(self) -> None:
        """Every key of the store with its time to live (a pending marker's leader will store its entry:
        known for the TTL past it)."""
        client = RespClient.from_url(self.url, timeout_s=TIMEOUT_S)
        try:
            cursor = b"0"
            while True:
                cursor, names = await client.execute_command(b"SCAN", cursor, b"MATCH", KEY_PATTERN,
                                                             b"COUNT", SCAN_COUNT)
                if names:
                    ttls = await client.send_encoded(b"".join(encode_command((b"PTTL", name)) for name in names),
                                                     len(names))
                    self._note_scanned(names, ttls)
                if cursor == b"0":
                    break
        finally:
            await client.aclose()
        self.scans += 1

    def _note_scanned(self, names: list[bytes], ttls: list[object]) -> None:
        now = self.clock()
        for name, ttl in zip(names, ttls, strict=True):
            if ttl.__class__ is not int or ttl == -2:  # gone meanwhile (or an error in its place)
                continue
            try:
                digest = key_digest(name)
            except ValueError:
                continue  # not a cache entry's name
            known_ms = float("inf") if ttl == -1 else ttl + (self.ttl_ms if ttl <= self.claim_ms else 0)  # type: ignore[operator]
            self.writer.note(place_of(digest, self.buckets), now + known_ms / 1000, now)
            self.scanned += 1
