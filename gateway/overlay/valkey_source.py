"""Follow an overlay published in Valkey (docs/fleet.md): one subscriber per gateway host.

The supervisor runs one :class:`ValkeyOverlaySource` for ``routing.overlay_source``. It reads
the key at start, subscribes to ``<key>:events`` and re-reads the key when messages arrive, and every
``poll_interval`` as a backstop (a lost message, a writer that only SETs). Every document read is
validated exactly as an overlay file is (size, JSON, contract, digest, expected scope); an accepted
one is written atomically to a local cache file (:class:`OverlayCache`), which the workers follow
like an ``overlay_file``: the way file reloads reach them. A rejected one is logged once with its
reason and last-known-good stays.

Whoever can write the key or publish on its channel must not be able to exhaust the host, so:

- a read asks Valkey for the value's type and size first and fetches it only when it is a string
  within the overlay file's bound (``MAX_OVERLAY_BYTES``), in one script, so the check and the
  fetch see the same value: an oversized value never leaves Valkey;
- notifications are coalesced: one read at a time, every message that arrived meanwhile answered by
  the one next read, and at most one read per ``min_read_interval``, so a flood of publishes costs
  a few reads a second, not one read and one validation per message;
- the cache and the last rejection are remembered by a 128-bit digest of the bytes (xxh3), never the
  rejected bytes themselves: the same bytes read again are neither validated nor logged again.

Valkey down: the cache file, hence every worker, keeps the last-known-good; the outage is logged
once, counted, and the source reconnects with exponential backoff (capped at the poll interval).
Once back it re-reads the key at once, so a publish made meanwhile is caught up.

Startup (:meth:`ValkeyOverlaySource.open`): Valkey's document if it is valid; else the cache file
a previous run left (last-known-good across restarts); else the config's ``overlay_file`` when it
gives one; else :class:`OverlaySourceError` with one line saying why.

Commands go through the quota backend's client (:func:`gateway.valkey.client.create_client`), so
a URL means the same here (``valkeys://`` TLS, ``user:password@`` auth, ``/db``); the subscription
is valkey-py's pub/sub on the same URL (the lean client has no subscribe mode).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import xxhash

from gateway.overlay.contract import MAX_OVERLAY_BYTES, TOO_LARGE, UNREADABLE, OverlayRejected
from gateway.overlay.snapshot import Snapshot, snapshot_from_bytes
from gateway.overlay.watch import check_overlay_bytes, read_overlay_bytes, write_atomically

log = logging.getLogger("gridgate.overlay")

POLL_INTERVAL_S = 5.0
MIN_READ_INTERVAL_S = 0.5  # at most two reads a second, however many notifications arrive
COMMAND_TIMEOUT_S = 2.0
RECONNECT_BASE_S = 0.1

APPLIED = "applied"  # a new revision
REFRESHED = "refreshed"  # the serving revision, re-rendered (newer rendered_at)
UNCHANGED = "unchanged"  # byte for byte what is cached
REJECTED = "rejected"

# One read of the key, atomically: its type, its size, and its bytes only when it is a string within
# the bound (ARGV[1]); a missing key is type "none".
READ_SCRIPT = """
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind ~= 'string' then return {kind} end
local size = redis.call('STRLEN', KEYS[1])
if size > tonumber(ARGV[1]) then return {kind, size} end
return {kind, size, redis.call('GET', KEYS[1])}
"""


def events_channel(key: str) -> str:
    """The pub/sub channel a publisher announces a new document of ``key`` on."""
    return f"{key}:events"


def lease_key(key: str) -> str:
    """The key whose holder is the one control-plane instance allowed to publish ``key``."""
    return f"{key}:lease"


def redact_url(url: str) -> str:
    """``url`` fit for a log line: no credentials, no query options."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return f"{parts.scheme}://{'***@' if '@' in parts.netloc else ''}{host}{parts.path}"


def source_problems(url: str, cache_file: str | None, field: str = "routing.overlay_source") -> list[str]:
    """What ``gridgate check`` and start-up refuse in a source: a URL the quota backend would refuse
    too, a cache file whose directory does not exist."""
    from gateway.valkey.urls import url_problem  # the one rule for Valkey URLs

    problems = []
    if (problem := url_problem(url)) is not None:
        problems.append(f"{field}.url: {problem}")
    if cache_file is not None and not os.path.isdir(os.path.dirname(os.path.abspath(cache_file))):
        problems.append(f"{field}.cache_file: directory {os.path.dirname(os.path.abspath(cache_file))} does not exist")
    return problems


class OverlaySourceError(Exception):
    """The gateway has no overlay to start with; the message is one line naming the cause."""


class SourceUnavailable(Exception):
    """Valkey could not be reached or did not answer in time."""


def digest_of(data: bytes) -> bytes:
    """What identifies a document's bytes: 128 bits of xxh3 (about 10 GB/s, so a 2 MiB read costs
    a fraction of a millisecond to recognise)."""
    return xxhash.xxh3_128_digest(data)


@dataclass(frozen=True, slots=True)
class KeyRead:
    """What one read of the key found: its Valkey type, its size, and its bytes when they were fetched."""

    kind: str  # "string", "none" (no such key) or another Valkey type
    size: int = 0
    data: bytes | None = None

    @classmethod
    def from_reply(cls, reply: list[Any]) -> KeyRead:
        kind = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
        return cls(kind, int(reply[1]) if len(reply) > 1 else 0, reply[2] if len(reply) > 2 else None)

    def identity(self) -> bytes:
        """The digest of the bytes; for a value that was not fetched, what Valkey said about it."""
        return digest_of(self.data) if self.data is not None else f"{self.kind}:{self.size}".encode()


class OverlayCache:
    """The last-known-good overlay from the source, and the file the workers follow.

    :meth:`offer` validates (raising :class:`OverlayRejected`) and writes a document that differs
    from the cached one; the file only ever holds a document that passed validation. The cache
    keeps the document's digest, not its bytes (the file has them).
    """

    def __init__(self, path: str, expected_scope: Any) -> None:
        self.path = path
        self.expected_scope = expected_scope
        self.digest: bytes | None = None
        self.snapshot: Snapshot | None = None

    def offer(self, data: bytes, where: str, digest: bytes | None = None) -> str:
        """APPLIED, REFRESHED or UNCHANGED; raises :class:`OverlayRejected` (the cache keeps its document).
        ``digest``: ``digest_of(data)`` when the caller has it already."""
        digest = digest_of(data) if digest is None else digest
        if digest == self.digest:
            return UNCHANGED
        snapshot = snapshot_from_bytes(check_overlay_bytes(data, where), self.expected_scope)
        write_atomically(self.path, data)
        same_revision = self.snapshot is not None and snapshot.revision == self.snapshot.revision
        self.digest, self.snapshot = digest, snapshot
        return REFRESHED if same_revision else APPLIED

    def load_existing(self) -> OverlayRejected | None:
        """Adopt the cache file a previous run left, if it is still valid; else why not."""
        try:
            data = read_overlay_bytes(self.path)
            self.snapshot, self.digest = snapshot_from_bytes(data, self.expected_scope), digest_of(data)
        except OverlayRejected as exc:
            return exc
        return None


def _node_url(url: str) -> str:
    """A URL for one node: pub/sub messages reach every node of a Valkey Cluster, so the seed will do."""
    from gateway.valkey.urls import single_node_url

    return single_node_url(url)


class ValkeyOverlaySource:
    """Reads, validates and caches the overlay at one Valkey key; see the module docstring."""

    def __init__(self, url: str, key: str, cache: OverlayCache, *, poll_interval: float = POLL_INTERVAL_S,
                 timeout: float = COMMAND_TIMEOUT_S, min_read_interval: float = MIN_READ_INTERVAL_S,
                 max_bytes: int = MAX_OVERLAY_BYTES) -> None:
        self.url = url
        self.key = key
        self.cache = cache
        self.poll_interval = poll_interval
        self.min_read_interval = min(min_read_interval, poll_interval)
        self.max_bytes = max_bytes
        self.timeout = min(timeout, poll_interval)
        self.where = f"{redact_url(url)} key {key}"
        self._client: Any = None  # made on the loop that uses it (open() and run() may run on two loops)
        self.up = False
        self.outages = 0
        self.outcomes: Counter[str] = Counter()
        self._down_since: float | None = None
        # The last rejected read: its identity (KeyRead.identity, never its bytes) and why, so the same
        # document read again is neither validated nor logged again.
        self.rejected: tuple[bytes, str] | None = None
        self._last_read = float("-inf")  # loop time of the last read's start
        self._reconnect_delay = RECONNECT_BASE_S

    # ------------------------------------------------------------------ start

    async def open(self, fallback_file: str | None = None) -> str:
        """Find the overlay to start with (see the module docstring); returns where it came from.

        Raises :class:`OverlaySourceError`.
        """
        try:
            read = await self._read_key()
        except SourceUnavailable as exc:
            self._went_down(exc)
            problem = f"Valkey unreachable ({exc})"
        else:
            self._came_up()
            rejection = self._take(read)
            if rejection is None:
                return "valkey"
            problem = rejection
        stale = self.cache.load_existing()
        if stale is None:
            assert self.cache.snapshot is not None
            log.warning("overlay source %s: %s; serving the cached revision %s from %s", self.where, problem,
                        self.cache.snapshot.revision, self.cache.path)
            return "cache"
        if fallback_file is not None:
            try:
                self.cache.offer(read_overlay_bytes(fallback_file), fallback_file)
            except OverlayRejected as exc:
                raise OverlaySourceError(f"routing.overlay_file: {exc}") from None
            log.warning("overlay source %s: %s; serving routing.overlay_file %s until it answers", self.where,
                        problem, fallback_file)
            return "overlay_file"
        raise OverlaySourceError(f"routing.overlay_source: no overlay to serve: {self.where}: {problem}, and no "
                                 f"cached overlay ({stale})")

    # ------------------------------------------------------------------ follow

    async def run(self) -> None:
        """Follow the key until cancelled: subscribe, poll, reconnect with backoff."""
        while True:
            try:
                await self._follow()
            except SourceUnavailable as exc:
                self._went_down(exc)
            except Exception as exc:  # a bug must not end the follower: keep serving, log it, try again
                log.exception("overlay source %s failed", self.where)
                self._went_down(exc)
            await asyncio.sleep(self._reconnect_delay)
            self._reconnect_delay = min(self._reconnect_delay * 2, self.poll_interval)

    async def _follow(self) -> None:
        import valkey.asyncio
        from valkey.exceptions import ValkeyError

        subscriber = valkey.asyncio.Valkey.from_url(_node_url(self.url), socket_connect_timeout=self.timeout)
        pubsub = subscriber.pubsub(ignore_subscribe_messages=True)
        try:
            try:
                async with asyncio.timeout(self.timeout):  # not wait_for: on 3.11 it can swallow a cancel
                    await pubsub.subscribe(events_channel(self.key))
            except (ValkeyError, OSError) as exc:
                raise SourceUnavailable(_describe(exc)) from None
            # Subscribed first, read second: nothing published in between goes unseen.
            await self._refresh()
            self._came_up()
            while True:
                await self._wait_for_news(pubsub)
                await self._refresh()
        finally:
            await pubsub.aclose()
            await subscriber.aclose()

    async def _wait_for_news(self, pubsub: Any) -> None:
        """Return when the key should be read again: a notification arrived (the message only names the
        revision; the key holds the document) or the poll interval passed since the last read.

        Never sooner than ``min_read_interval`` after the last read, and every notification received
        by then is consumed here: a burst of any size costs one read (the one in flight when it began
        answers nothing that came after it, so there is at most one more). Consuming them is bounded
        in time too, so a flood that never pauses still gets the key read once per interval or so."""
        loop = asyncio.get_running_loop()
        poll_at = self._last_read + self.poll_interval
        while (left := poll_at - loop.time()) > 0:
            if await self._next_message(pubsub, left):
                break
        pause = self._last_read + self.min_read_interval - loop.time()
        if pause > 0:
            await asyncio.sleep(pause)
        drain_until = loop.time() + self.min_read_interval
        while await self._next_message(pubsub, 0.0) and loop.time() < drain_until:
            pass

    async def _next_message(self, pubsub: Any, timeout: float) -> bool:
        """True when a notification arrived within ``timeout`` seconds (0: only one already received)."""
        from valkey.exceptions import ValkeyError

        try:
            return await pubsub.get_message(timeout=timeout) is not None
        except (ValkeyError, OSError) as exc:
            raise SourceUnavailable(_describe(exc)) from None

    async def _refresh(self) -> None:
        self._last_read = asyncio.get_running_loop().time()
        self._take(await self._read_key())

    def _commands(self) -> Any:
        """The command client; raises ValueError for a URL the quota backend would refuse too."""
        if self._client is None:
            from gateway.valkey.client import create_client  # valkey-py loads only where a source is used

            self._client = create_client(self.url, timeout_s=self.timeout)
        return self._client

    async def _read_key(self) -> KeyRead:
        from valkey.exceptions import ValkeyError

        client = self._commands()
        try:  # the client's own timeout bounds it
            reply = await client.execute_command("EVAL", READ_SCRIPT, 1, self.key, self.max_bytes)
        except (ValkeyError, OSError) as exc:
            raise SourceUnavailable(_describe(exc)) from None
        return KeyRead.from_reply(reply)

    def _take(self, read: KeyRead) -> str | None:
        """Validate and cache one read of the key; None if the cache now holds it, else the problem."""
        identity = read.identity()
        if self.rejected is not None and self.rejected[0] == identity:
            return self.rejected[1]  # the same document again: judged, logged and counted already
        try:
            outcome = self.cache.offer(self._fetched(read), self.where, identity)
        except OverlayRejected as exc:
            problem = f"rejected: {exc}"
            self.rejected = (identity, problem)  # each bad document is logged and counted once, not once per poll
            self.outcomes[REJECTED] += 1
            log.warning("overlay source rejected the document (%s); keeping revision %s", exc, self._serving())
            return problem
        except OSError as exc:  # the workers would not see the update: a local problem, logged every time
            log.error("overlay source: cannot write the cache file %s: %s", self.cache.path, exc)
            return f"cannot write the cache file {self.cache.path}: {exc.strerror or exc}"
        self.rejected = None
        if outcome != UNCHANGED:
            self.outcomes[outcome] += 1
            assert self.cache.snapshot is not None
            log.info("overlay source %s: %s revision %s", self.where,
                     "new" if outcome == APPLIED else "refreshed", self.cache.snapshot.revision)
        return None

    def _fetched(self, read: KeyRead) -> bytes:
        """The document's bytes; raises :class:`OverlayRejected` for a read that fetched none."""
        if read.kind == "none":
            raise OverlayRejected(UNREADABLE, f"{self.where}: no such key")
        if read.kind != "string":
            raise OverlayRejected(UNREADABLE, f"{self.where}: holds a {read.kind}, not a string")
        if read.data is None:
            raise OverlayRejected(TOO_LARGE, f"{self.where}: {read.size} bytes, larger than {self.max_bytes} bytes "
                                             "(not read)")
        return read.data

    # ------------------------------------------------------------------ outages

    def _went_down(self, error: Exception) -> None:
        if self._down_since is not None:
            return
        self.up = False
        self.outages += 1
        self._down_since = time.monotonic()
        log.error("overlay source %s unreachable (%s); serving last-known-good revision %s, reconnecting",
                  self.where, error, self._serving())

    def _came_up(self) -> None:
        self.up = True
        self._reconnect_delay = RECONNECT_BASE_S
        if self._down_since is not None:
            log.info("overlay source %s reachable again after %.1fs", self.where, time.monotonic() - self._down_since)
            self._down_since = None

    def _serving(self) -> str:
        return self.cache.snapshot.revision if self.cache.snapshot is not None else "none yet"

    async def close(self) -> None:
        """Close the connection; the source may be used again (on another loop, too)."""
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()


def _describe(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
