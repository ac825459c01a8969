"""The worker's side of provider state: it writes its own cooling decisions into its shared-memory row
and refreshes the routing view (``ProviderView``) from every worker's row and from endpoint health.

Refreshing is cheap but not free, so the request path calls ``maybe_refresh`` (one float compare) and
the view is rebuilt at most every ``REFRESH_S``; this worker's own cooling applies at once.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.routing.providers import ProviderView
from shm.providers import COOLED_AT_NS, COOLED_UNTIL_NS, RECORD_WORDS, ProviderCells

REFRESH_S = 0.1


class ProviderStates:
    def __init__(
        self, cells: ProviderCells, worker_row: int, rows_in_use: Callable[[], int], count: int,
        routable: Callable[[int], bool],
    ) -> None:
        self.view = ProviderView(count)
        self._cells = cells
        self._row = cells.row(worker_row)
        self._rows_in_use = rows_in_use
        self._routable = routable  # provider index -> has at least one routable endpoint
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
        for provider in range(count):
            view.down[provider] = not self._routable(provider)
        view.recompute(now)
        self.next_refresh = now + REFRESH_S

