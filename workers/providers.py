"""The worker's side of provider state: it writes its own cooling decisions and latency samples into its
shared-memory row and refreshes the routing view (``ProviderView``) from every worker's row and from
endpoint health.

Refreshing is cheap but not free, so the request path calls ``maybe_refresh`` (one float compare) and
the view is rebuilt at most every ``REFRESH_S``; this worker's own cooling applies at once.

Cooling (gateway.routing.cooling, docs/routing.md): a 429/503 cools the endpoint that answered
(``cool_endpoint``, shared through the endpoint's slot line); its provider cools too when the answer
spoke for the whole provider, or when every endpoint of it is cooled (by any worker: a refresh derives
that from the shared cells as well). While some but not all of a provider's endpoints are cooled,
``cooled_endpoints`` names them for the attempt to leave out.

Latency (``least_loaded``): each worker keeps a moving average of the provider's first-byte latency and
the time of its latest sample. A refresh ages every worker's average by that time (freshness =
2^(-age / half-life), gateway.routing.providers) and combines them, weighting each by its freshness;
no timer ever runs. A sample arriving after a long silence replaces the stale average instead of being
averaged with it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

from gateway.routing.cooling import Scope, cooling_scope
from gateway.routing.providers import ProviderView, freshness
from shm.conformance import ConformanceFlags
from shm.providers import (
    COOLED_AT_NS,
    COOLED_UNTIL_NS,
    FIRST_BYTE_US,
    RECORD_WORDS,
    SAMPLED_AT_NS,
    EndpointCooling,
    ProviderCells,
)

REFRESH_S = 0.1
EWMA_WEIGHT = 0.2  # weight of the newest first-byte sample in the moving average (of a fresh average)
DEFAULT_HALF_LIFE_S = 30.0
_monotonic_ns = time.monotonic_ns


class Endpoint(Protocol):
    """What endpoint cooling needs of the worker's endpoint objects (workers.clusters.UpstreamEndpoint)."""

    @property
    def slot(self) -> int: ...


class ProviderStates:
    def __init__(
        self, cells: ProviderCells, worker_row: int, rows_in_use: Callable[[], int], count: int,
        routable: Callable[[int], bool], inflight: Callable[[int], int], *,
        latency_prior: float | None = None, half_life: float = DEFAULT_HALF_LIFE_S,
        endpoint_cooling: EndpointCooling | None = None, conformance: ConformanceFlags | None = None,
    ) -> None:
        self.view = ProviderView(count, inflight, latency_prior)
        self._cells = cells
        self._row = cells.row(worker_row)
        self._row_index = worker_row
        self._rows_in_use = rows_in_use
        self._routable = routable  # provider index -> has at least one routable endpoint
        self._half_life = half_life
        self._own_latency = [0.0] * count
        self._own_fresh = [0.0] * count  # freshness of this worker's own average at the last refresh
        self._endpoint_cooling = endpoint_cooling
        self._conformance = conformance  # None: routing.conformance is off, nothing to read
        self._endpoints: list[tuple[Endpoint, ...]] = [()] * count  # per provider, its endpoint objects
        self._endpoint_until: list[list[float]] = [[] for _ in range(count)]  # aligned, monotonic seconds
        self._avoid: list[tuple[Endpoint, ...] | None] = [None] * count  # cooled while others are not
        self._readers: list[Callable[[], list[int]]] = []  # per provider: its endpoints' shared cooling
        self._readers_rows = -1  # the rows in use the readers were built for
        self._derived_since = [0.0] * count  # when this worker saw every endpoint of a provider cooled
        self.next_refresh = 0.0

    # -- endpoint cooling ----------------------------------------------------------------------------
    def set_endpoints(self, provider: int, endpoints: Sequence[Endpoint]) -> None:
        """The endpoints of ``provider`` (once the clusters are built): the unit 429/503 cool first."""
        self._endpoints[provider] = tuple(endpoints)
        self._endpoint_until[provider] = [0.0] * len(endpoints)
        self._readers_rows = -1

    def cool_endpoint(self, provider: int, endpoint: Endpoint, seconds: float, now: float,
                      provider_wide: bool = False) -> Scope:
        """``endpoint`` of ``provider`` answered 429/503 (wanting ``seconds`` of rest): cool it in every
        worker, and the provider as well when the answer said the whole provider is limited or no other
        endpoint of it is left. Returns what was cooled."""
        endpoints = self._endpoints[provider]
        if endpoint not in endpoints:  # endpoints unknown here: the provider is the only unit there is
            self.cool(provider, seconds, now)
            return Scope.PROVIDER
        index = endpoints.index(endpoint)
        until = now + seconds
        if self._endpoint_cooling is not None:
            self._endpoint_cooling.cool(endpoint.slot, int(until * 1e9))
        untils = self._endpoint_until[provider]
        if until > untils[index]:
            untils[index] = until
        cooled = sum(1 for value in untils if value > now)
        scope = cooling_scope(provider_wide, cooled, len(untils))
        if scope == Scope.PROVIDER:
            # Back when the answer says so; or, all endpoints cooled, when the first of them comes back.
            self.cool(provider, seconds if provider_wide else min(untils) - now, now)
        self._avoid[provider] = self._cooled_subset(provider, now)
        return scope

    def cooled_endpoints(self, provider: int) -> list[Endpoint] | None:
        """The endpoints of ``provider`` new attempts should leave out (a fresh list: callers extend it),
        or None when none is cooled, or all are (then any may be tried)."""
        avoid = self._avoid[provider]
        return None if avoid is None else list(avoid)

    def _cooled_subset(self, provider: int, now: float) -> tuple[Endpoint, ...] | None:
        untils = self._endpoint_until[provider]
        cooled = tuple(e for e, until in zip(self._endpoints[provider], untils, strict=True) if until > now)
        return cooled if 0 < len(cooled) < len(untils) else None

    def _refresh_endpoints(self, now: float, rows: int) -> None:
        """Endpoint cooling from every worker's cells; a provider whose endpoints are all cooled is."""
        cooling = self._endpoint_cooling
        if cooling is None:
            return
        if rows != self._readers_rows:
            self._readers = [cooling.reader([e.slot for e in endpoints]) for endpoints in self._endpoints]
            self._readers_rows = rows
        view = self.view
        for provider, read in enumerate(self._readers):
            if not self._endpoints[provider]:
                continue
            untils = self._endpoint_until[provider] = [value / 1e9 for value in read()]
            self._avoid[provider] = self._cooled_subset(provider, now)
            earliest = min(untils)
            if earliest <= now:
                self._derived_since[provider] = 0.0
                continue
            # Every endpoint is cooled (maybe by different workers at once): so is the provider.
            if not self._derived_since[provider]:
                self._derived_since[provider] = now
            if earliest > view.cooled_until[provider]:
                view.cooled_until[provider] = earliest
                view.cooled_at[provider] = max(view.cooled_at[provider], self._derived_since[provider])

    def cool(self, provider: int, seconds: float, now: float) -> None:
        """Skip ``provider`` for new selections for ``seconds``, in every worker of the host."""
        until, at = now + seconds, now
        if provider < self._cells.max_providers:  # past the shared cells: this worker's view only
            base = provider * RECORD_WORDS
            row = self._row
            until_ns = int(until * 1e9)
            if until_ns > row[base + COOLED_UNTIL_NS]:
                row[base + COOLED_AT_NS] = int(at * 1e9)
                row[base + COOLED_UNTIL_NS] = until_ns
        self.view.cool(provider, until, at)

    def observe_first_byte(self, provider: int, seconds: float) -> None:
        """A response head arrived after ``seconds``: fold it into this worker's moving average.

        The older the average, the less it counts: at full freshness the sample weighs EWMA_WEIGHT,
        after a long silence it replaces the average (a provider is judged by what it does now)."""
        own = self._own_latency
        weight = 1.0 - (1.0 - EWMA_WEIGHT) * self._own_fresh[provider]
        average = own[provider] + weight * (seconds - own[provider])
        own[provider] = average
        self._own_fresh[provider] = 1.0
        if provider < self._cells.max_providers:
            base = provider * RECORD_WORDS
            self._row[base + FIRST_BYTE_US] = max(1, int(average * 1e6))
            self._row[base + SAMPLED_AT_NS] = _monotonic_ns()
        if self.view.fresh[provider] == 0.0:
            self.view.measured(provider, average, 1.0)  # first measurement: use it at once

    def maybe_refresh(self, now: float) -> None:
        if now >= self.next_refresh:
            self.refresh(now)

    def refresh(self, now: float) -> None:
        view = self.view
        count = len(view)
        now_ns = _monotonic_ns()
        half_life = self._half_life
        rows_in_use = self._rows_in_use()
        rows = [self._cells.row(index) for index in range(rows_in_use)]
        for provider in range(min(count, self._cells.max_providers)):
            base = provider * RECORD_WORDS
            until = at = 0
            weighted = fresh = 0.0
            measured = 0
            for index, row in enumerate(rows):
                cell = row[base + COOLED_UNTIL_NS]
                if cell > until:
                    until, at = cell, row[base + COOLED_AT_NS]
                latency_us = row[base + FIRST_BYTE_US]
                if latency_us:
                    f = freshness((now_ns - row[base + SAMPLED_AT_NS]) / 1e9, half_life)
                    weighted += latency_us * f
                    fresh += f
                    measured += 1
                    if index == self._row_index:
                        self._own_fresh[provider] = f
            view.cooled_until[provider] = until / 1e9
            view.cooled_at[provider] = at / 1e9
            if measured and fresh > 0.0:  # averages over the workers that measured, each by its freshness
                view.measured(provider, weighted / fresh / 1e6, fresh / measured)
            elif measured:  # every sample faded out completely: as good as never measured
                view.measured(provider, view.latency[provider], 0.0)
        self._refresh_endpoints(now, rows_in_use)
        for provider in range(count):
            view.down[provider] = not self._routable(provider)
        if self._conformance is not None:
            flags = self._conformance
            view.nonconformant[:] = [flags.nonconformant(provider) for provider in range(count)]
        view.recompute(now)
        view.epoch += 1
        self.next_refresh = now + REFRESH_S

