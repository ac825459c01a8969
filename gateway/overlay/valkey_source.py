"""Follow an overlay published in Valkey (CONTRACT §13): one subscriber per gateway host.

The supervisor runs one :class:`ValkeyOverlaySource` for ``routing.overlay_source``. It reads
the key at start, subscribes to ``<key>:events`` and re-reads the key on every message, and every
``poll_interval`` as a backstop (a lost message, a writer that only SETs). Every document read is
validated exactly as an overlay file is (size, JSON, contract, digest, expected scope); an accepted
one is written atomically to a local cache file (:class:`OverlayCache`), which the workers follow
like an ``overlay_file``: the way file reloads reach them. A rejected one is logged once with its
reason and last-known-good stays.

Valkey down: the cache file, hence every worker, keeps the last-known-good; the outage is logged
once, counted, and the source reconnects with exponential backoff (capped at the poll interval).
Once back it re-reads the key at once, so a publish made meanwhile is caught up.

Startup (:meth:`ValkeyOverlaySource.open`): Valkey's document if it is valid; else the cache file
a previous run left (last-known-good across restarts); else the config's ``overlay_file`` when it
gives one; else :class:`OverlaySourceError` with one line saying why.

Commands go through the quota backend's client (:func:`gateway.quota.backend.create_client`), so
a URL means the same here (``valkeys://`` TLS, ``user:password@`` auth, ``/db``); the subscription
is valkey-py's pub/sub on the same URL (the lean client has no subscribe mode).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from typing import Any
from urllib.parse import urlsplit

from gateway.overlay.contract import UNREADABLE, OverlayRejected
from gateway.overlay.snapshot import Snapshot, snapshot_from_bytes
from gateway.overlay.watch import check_overlay_bytes, read_overlay_bytes, write_atomically

log = logging.getLogger("gridgate.overlay")

POLL_INTERVAL_S = 5.0
COMMAND_TIMEOUT_S = 2.0
RECONNECT_BASE_S = 0.1

APPLIED = "applied"  # a new revision
REFRESHED = "refreshed"  # the serving revision, re-rendered (newer rendered_at)
UNCHANGED = "unchanged"  # byte for byte what is cached
REJECTED = "rejected"
_NOTHING_REJECTED = object()


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
    from gateway.config import quota_url_problem  # the one rule for Valkey URLs

    problems = []
    if (problem := quota_url_problem(url)) is not None:
        problems.append(f"{field}.url: {problem}")
    if cache_file is not None and not os.path.isdir(os.path.dirname(os.path.abspath(cache_file))):
        problems.append(f"{field}.cache_file: directory {os.path.dirname(os.path.abspath(cache_file))} does not exist")
    return problems


class OverlaySourceError(Exception):
    """The gateway has no overlay to start with; the message is one line naming the cause."""


class SourceUnavailable(Exception):
    """Valkey could not be reached or did not answer in time."""


class OverlayCache:
    """The last-known-good overlay from the source, and the file the workers follow.

    :meth:`offer` validates (raising :class:`OverlayRejected`) and writes a document that differs
    from the cached bytes; the file only ever holds a document that passed validation.
    """

    def __init__(self, path: str, expected_scope: Any) -> None:
        self.path = path
        self.expected_scope = expected_scope
        self.data: bytes | None = None
        self.snapshot: Snapshot | None = None

    def offer(self, data: bytes, where: str) -> str:
        """APPLIED, REFRESHED or UNCHANGED; raises :class:`OverlayRejected` (the cache keeps its document)."""
        if data == self.data:
            return UNCHANGED
        snapshot = snapshot_from_bytes(check_overlay_bytes(data, where), self.expected_scope)
        write_atomically(self.path, data)
        same_revision = self.snapshot is not None and snapshot.revision == self.snapshot.revision
        self.data, self.snapshot = data, snapshot
        return REFRESHED if same_revision else APPLIED

    def load_existing(self) -> OverlayRejected | None:
        """Adopt the cache file a previous run left, if it is still valid; else why not."""
        try:
            data = read_overlay_bytes(self.path)
            self.snapshot, self.data = snapshot_from_bytes(data, self.expected_scope), data
        except OverlayRejected as exc:
            return exc
        return None


def _node_url(url: str) -> str:
    """A URL for one node: pub/sub messages reach every node of a Valkey Cluster, so the seed will do."""
    from gateway.config import single_node_url

    return single_node_url(url)


class ValkeyOverlaySource:
    """Reads, validates and caches the overlay at one Valkey key; see the module docstring."""

    def __init__(self, url: str, key: str, cache: OverlayCache, *, poll_interval: float = POLL_INTERVAL_S,
                 timeout: float = COMMAND_TIMEOUT_S) -> None:
        self.url = url
        self.key = key
        self.cache = cache
        self.poll_interval = poll_interval
        self.timeout = min(timeout, poll_interval)
        self.where = f"{redact_url(url)} key {key}"
        self._client: Any = None  # made on the loop that uses it (open() and run() may run on two loops)
        self.up = False
        self.outages = 0
        self.outcomes: Counter[str] = Counter()
        self._down_since: float | None = None
        self._rejected: object = _NOTHING_REJECTED  # the last rejected read, so a poll does not log it again
        self._reconnect_delay = RECONNECT_BASE_S

    # ------------------------------------------------------------------ start

    async def open(self, fallback_file: str | None = None) -> str:
        """Find the overlay to start with (see the module docstring); returns where it came from.

        Raises :class:`OverlaySourceError`.
        """
        try:
            data = await self._read_key()
        except SourceUnavailable as exc:
            self._went_down(exc)
            problem = f"Valkey unreachable ({exc})"
        else:
            self._came_up()
            rejection = self._take(data)
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
            self._take(await self._read_key())
            self._came_up()
            while True:
                try:
                    # A message or the poll interval: either way, re-read the key (the message only names
                    # the revision; the key holds the document).
                    await pubsub.get_message(timeout=self.poll_interval)
                except (ValkeyError, OSError) as exc:
                    raise SourceUnavailable(_describe(exc)) from None
                self._take(await self._read_key())
        finally:
            await pubsub.aclose()
            await subscriber.aclose()

    def _commands(self) -> Any:
        """The command client; raises ValueError for a URL the quota backend would refuse too."""
        if self._client is None:
            from gateway.quota.backend import create_client  # valkey-py loads only where a source is used

            self._client = create_client(self.url, timeout_s=self.timeout)
        return self._client

    async def _read_key(self) -> bytes | None:
        from valkey.exceptions import ValkeyError

        client = self._commands()
        try:
            return await client.execute_command("GET", self.key)  # the client's own timeout bounds it
        except (ValkeyError, OSError) as exc:
            raise SourceUnavailable(_describe(exc)) from None

    def _take(self, data: bytes | None) -> str | None:
        """Validate and cache one read of the key; None if the cache now holds it, else the problem."""
        try:
            if data is None:
                raise OverlayRejected(UNREADABLE, f"{self.where}: no such key")
            outcome = self.cache.offer(data, self.where)
        except OverlayRejected as exc:
            if data != self._rejected:  # each bad document is logged and counted once, not once per poll
                self._rejected = data
                self.outcomes[REJECTED] += 1
                log.warning("overlay source rejected the document (%s); keeping revision %s", exc, self._serving())
            return f"rejected: {exc}"
        except OSError as exc:  # the workers would not see the update: a local problem, logged every time
            log.error("overlay source: cannot write the cache file %s: %s", self.cache.path, exc)
            return f"cannot write the cache file {self.cache.path}: {exc.strerror or exc}"
        self._rejected = _NOTHING_REJECTED
        if outcome != UNCHANGED:
            self.outcomes[outcome] += 1
            assert self.cache.snapshot is not None
            log.info("overlay source %s: %s revision %s", self.where,
                     "new" if outcome == APPLIED else "refreshed", self.cache.snapshot.revision)
        return None

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
