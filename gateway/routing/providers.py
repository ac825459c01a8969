"""What selection knows about each provider (a cluster of this gateway), indexed by provider number.

A worker refreshes this view from shared memory (cooling written by every worker, endpoint health
written by the health process) a few times a second and updates it at once for its own cooling
decisions; selection only reads plain lists. Pure: no clocks of its own, no shared memory.

A provider is *usable* for a new selection when it is configured on this gateway, not cooled and
has at least one routable endpoint (CONTRACT §11).
"""

from __future__ import annotations

from collections.abc import Callable


def _no_load(provider: int) -> int:
    return 0


class ProviderView:
    __slots__ = ("usable", "cooled_until", "cooled_at", "down", "latency", "inflight")

    def __init__(self, count: int, inflight: Callable[[int], int] = _no_load) -> None:
        self.usable = [True] * count  # read per selection
        self.cooled_until = [0.0] * count  # monotonic seconds
        self.cooled_at = [0.0] * count  # when the latest cooling began (orders the all-cooled fallback)
        self.down = [False] * count  # no routable endpoint
        self.latency = [0.0] * count  # recent first-byte latency in seconds (0: not measured yet)
        self.inflight = inflight  # provider -> requests in flight on all workers of the host (live)

    def cost(self, provider: int) -> float:
        """least_loaded: (in flight + 1) x first-byte latency; an unmeasured provider costs 0 (tried)."""
        return (self.inflight(provider) + 1) * self.latency[provider]

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
