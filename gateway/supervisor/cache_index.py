"""The response cache's host index as the supervisor runs it (docs/cache.md, "The host index").

``prepare`` (before the first fork) creates the shared-memory index when the config turns the cache and
its index on, on a single-node Valkey, so every worker inherits it; ``start`` (on the supervisor's loop)
runs its follower, the index's one writer, and waits a little for its first scan. A reload keeps the
index as it was made (shared memory cannot be remade after fork); a cache turned on by a reload runs
without an index until a restart. On a Valkey Cluster there is no index yet: every miss awaits its lookup.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gateway.config import Config
from gateway.supervisor.quota_backend import EmbeddedQuotaBackend, quota_url_for
from gateway.supervisor.startup import StartupError
from gateway.valkey.urls import is_cluster_url
from shm.cache_index import CacheIndex, CacheIndexWriter

if TYPE_CHECKING:
    from gateway.cache.index_follower import IndexFollower

log = logging.getLogger("gridgate.cache")
FIRST_SCAN_WAIT_S = 2.0


def cache_url_for(config: Config, embedded: EmbeddedQuotaBackend) -> str | None:
    """The cache's Valkey when the cache is on: its own backend, else the quota's."""
    cache = config.cache
    if cache is None or not cache.enabled:
        return None
    if cache.backend is not None:
        return cache.backend.url
    return quota_url_for(config, embedded)


class CacheIndexService:
    """One index and its follower."""

    def __init__(self, embedded: EmbeddedQuotaBackend) -> None:
        self._embedded = embedded
        self.index: CacheIndex | None = None
        self._follower: IndexFollower | None = None
        self._task: asyncio.Task[None] | None = None

    def prepare(self, config: Config, rows: int) -> None:
        """Before the first fork: the index, sized by ``cache.index.capacity`` for ``rows`` worker rows."""
        cache = config.cache
        url = cache_url_for(config, self._embedded)
        if cache is None or url is None or cache.index is None or is_cluster_url(url):
            return
        try:
            self.index = CacheIndex.create(cache.index.capacity, rows)
        except (OSError, ValueError) as exc:
            raise StartupError(f"cache.index.capacity: cannot map the cache's host index: {exc}") from None
        claim_ms = max(1, int(float(cache.coalesce.wait) * 1000))
        # Imported here: its Valkey client is loaded only by a supervisor whose cache runs an index (the
        # supervisor's own imports load no data plane and no valkey: tests/integration/test_layers.py).
        from gateway.cache.index_follower import IndexFollower

        self._follower = IndexFollower(url, CacheIndexWriter(self.index), claim_ms, int(cache.ttl * 1000))

    async def start(self) -> None:
        follower = self._follower
        if follower is None:
            return
        self._task = asyncio.get_running_loop().create_task(follower.run())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(FIRST_SCAN_WAIT_S):
                await follower.authoritative.wait()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
            self._task = None

    def collect(self) -> Iterator[Any]:
        follower = self._follower
        if follower is None or self.index is None:
            return
        yield GaugeMetricFamily("gridgate_cache_index_authoritative",
                                "1 while this host's cache index is authoritative (subscribed, scanned, alive)",
                                int(follower.live))
        yield CounterMetricFamily("gridgate_cache_index_announced", "Cache keys this host's index heard announced",
                                  follower.announced)
        yield CounterMetricFamily("gridgate_cache_index_scanned", "Cache keys this host's index found by a scan",
                                  follower.scanned)
        yield CounterMetricFamily("gridgate_cache_index_dropped",
                                  "Cache keys a full bucket of the index had no slot for (known by its bucket)",
                                  CacheIndexWriter.dropped_of(self.index))
        yield CounterMetricFamily("gridgate_cache_index_losses", "Subscriptions of the cache index lost",
                                  follower.losses)
