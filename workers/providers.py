"""The worker's side of provider state: it writes its own cooling decisions and latency samples into its
shared-memory row and refreshes the routing view (``ProviderView``) from every worker's row and from
endpoint health.

Refreshing is cheap but not free, so the request path calls ``maybe_refresh`` (one float compare) and
the view is rebuilt at most every ``REFRESH_S``; this worker's own cooling applies at once.

Latency (``least_loaded``): each worker keeps a moving average of the provider's first-byte latency and
the time of its latest sample. A refresh ages every worker's average by that time (freshness =
2^(-age / half-life), gateway.routing.providers) and combines them, weighting each by its freshness;
no timer ever runs. A sample arriving after a long silence replaces the stale average instead of being
averaged with it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from gateway.routing.providers import ProviderView, freshness
from shm.providers import (
    COOLED_AT_NS,
    COOLED_UNTIL_NS,
    FIRST_BYTE_US,
    RECORD_WORDS,
    SAMPLED_AT_NS,
    ProviderCells,
)

REFRESH_S = 0.1
EWMA_WEIGHT = 0.2  # weight of the newest first-byte sample in the moving average (of a fresh average)
DEFAULT_HALF_LIFE_S = 30.0
_monotonic_ns = time.monotonic_ns


class ProviderStates:
    def __init__(
        self, cells: ProviderCells, worker_row: int, rows_in_use: Callable[[], int], count: int,
        routable: Callable[[int], bool], inflight: Callable[[int], int], *,
        latency_prior: float | None = None, half_life: float = DEFAULT_HALF_LIFE_S,
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
        self.next_refresh = 0.0

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
        rows = [self._cells.row(index) for index in range(self._rows_in_use())]
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
        for provider in range(count):
            view.down[provider] = not self._routable(provider)
        view.recompute(now)
        view.epoch += 1
        self.next_refresh = now + REFRESH_S

