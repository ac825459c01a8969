"""What selection knows about each provider (a cluster of this gateway), indexed by provider number.

A worker refreshes this view from shared memory (cooling written by every worker, endpoint health
written by the health process) a few times a second and updates it at once for its own cooling
decisions; selection only reads plain lists. Pure: no clocks of its own, no shared memory.

A provider is *usable* for a new selection when it is configured on this gateway, not cooled and
has at least one routable endpoint (CONTRACT §11).
"""

from __future__ import annotations


class ProviderView:
    __slots__ = ("usable", "cooled_until", "cooled_at", "down")

    def __init__(self, count: int) -> None:
        self.usable = [True] * count  # read per selection
        self.cooled_until = [0.0] * count  # monotonic seconds
        self.cooled_at = [0.0] * count  # when the latest cooling began (orders the all-cooled fallback)
        self.down = [False] * count  # no routable endpoint

    def __len__(self) -> int:
        return len(self.usable)

    def cool(self, provider: int, until: float, at: float) -> None:
        if until > self.cooled_until[provider]:
            self.cooled_until[provider] = until
            self.cooled_at[provider] = at
            self.usable[provider] = False

    def recompute(self, now: float) -> None:
        """Derive ``usable`` after the raw facts changed (or time passed)."""
        until, down = self.cooled_until, self.down
        self.usable[:] = [until[p] <= now and not down[p] for p in range(len(until))]  # in place: closures hold it

    def fallback_rank(self, provider: int) -> tuple[bool, float]:
        """Order among unusable providers when nothing is usable: a cooled provider with routable
        endpoints before a down one, then the least recently cooled first."""
        return (self.down[provider], self.cooled_at[provider])
