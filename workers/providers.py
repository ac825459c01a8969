"""The worker's side of provider state: it writes its own cooling decisions into its shared-memory row
and refreshes the routing view (``ProviderView``) from every worker's row and from endpoint health.

Refreshing is cheap but not free, so the request path calls ``maybe_refresh`` (one float compare) and
the view is rebuilt at most every ``REFRESH_S``; this worker's own cooling applies at once.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.routing.providers import ProviderView
from shm.providers import COOLED_AT_NS, COOLED_UNTIL_NS, FIRST_BYTE_US, RECORD_WORDS, ProviderCells

REFRESH_S = 0.1
EWMA_WEIGHT = 0.2  # weight of the newest first-byte sample in the moving average


class ProviderStates:
    def __init__(
        self, cells: ProviderCells, worker_row: int, rows_in_use: Callable[[], int], count: int,
        routable: Callable[[int], bool], inflight: Callable[[int], int],
    ) -> None:
        self.view = ProviderView(count, inflight)
        self._cells = cells
        self._row = cells.row(worker_row)
        self._rows_in_use = rows_in_use
        self._routable = routable  # provider index -> has at least one routable endpoint
        self._own_latency = [0.0] * count
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
        """A response head arrived after ``seconds``: fold it into this worker's moving average."""
        latency = self.view.latency
        own = self._own_latency
        average = seconds if own[provider] == 0.0 else own[provider] + EWMA_WEIGHT * (seconds - own[provider])
        own[provider] = average
        if provider < self._cells.max_providers:
            self._row[provider * RECORD_WORDS + FIRST_BYTE_US] = max(1, int(average * 1e6))
        if latency[provider] == 0.0:
            latency[provider] = average  # first measurement: use it at once

    def maybe_refresh(self, now: float) -> None:
        if now >= self.next_refresh:
            self.refresh(now)

    def refresh(self, now: float) -> None:
        view = self.view
        count = len(view)
        rows = [self._cells.row(index) for index in range(self._rows_in_use())]
        for provider in range(min(count, self._cells.max_providers)):
            base = provider * RECORD_WORDS
            until = at = 0
            for row in rows:
                cell = row[base + COOLED_UNTIL_NS]
                if cell > until:
                    until, at = cell, row[base + COOLED_AT_NS]
            view.cooled_until[provider] = until / 1e9
            view.cooled_at[provider] = at / 1e9
            samples = [row[base + FIRST_BYTE_US] for row in rows if row[base + FIRST_BYTE_US]]
            if samples:  # the average over the workers that measured
                view.latency[provider] = sum(samples) / len(samples) / 1e6
        for provider in range(count):
            view.down[provider] = not self._routable(provider)
        view.recompute(now)
        self.next_refresh = now + REFRESH_S

