"""What selection knows about each provider (a cluster of this gateway), indexed by provider number.

A worker refreshes this view from shared memory (cooling written by every worker, endpoint health
written by the health process) a few times a second and updates it at once for its own cooling
decisions; selection only reads plain lists. Pure: no clocks of its own, no shared memory.

A provider is *usable* for a new selection when it is configured on this gateway, not cooled, not
kept out by its conformance checks (``nonconformant``, docs/provider-conformance.md#in-the-pool) and
has at least one routable endpoint (docs/routing.md#usable-providers).

``least_loaded`` (docs/routing.md, "Which picker when") costs a provider (in flight + 1) x its
expected first-byte latency. That expectation is honest about what is not known: a provider never
measured is expected to be as fast as the group's median measured provider (or ``latency_prior``),
not infinitely fast; and a measurement fades toward that same prior as it ages (half-life
``latency_half_life``), so a provider that was slow an hour ago and idle since is no longer judged by
it. With each provider's measurement ``m`` and its *freshness* ``f`` = 2^(-age / half-life) (1 just
measured, 0 never), the expectation is ``m·f + prior·(1 - f)``; the view keeps ``m·f`` and ``f``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# The prior when nothing is known (no explicit prior, nothing measured in the group): any positive
# constant gives the same choices, since every member then costs (in flight + 1) x the same number.
NOTHING_MEASURED_PRIOR_S = 1.0


def _no_load(provider: int) -> int:
    return 0


def freshness(age_s: float, half_life_s: float) -> float:
    """How much of a measurement ``age_s`` old still counts: 1 now, 1/2 after one half-life."""
    return 2.0 ** (-max(0.0, age_s) / half_life_s)


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


class LoadCost:
    """``least_loaded``'s cost of a provider, given its group's prior; and that prior.

    A plan's groups hold this object (``ProviderView.cost``) and ask ``prior_of`` again only when
    ``epoch`` moved (the view was refreshed), so a pick costs two multiplications per candidate.
    """

    __slots__ = ("_view",)

    def __init__(self, view: ProviderView) -> None:
        self._view = view

    @property
    def epoch(self) -> int:
        return self._view.epoch

    def __call__(self, provider: int, prior: float) -> float:
        view = self._view
        return (view.inflight(provider) + 1) * (view.weighted[provider] + prior * (1.0 - view.fresh[provider]))

    def prior_of(self, providers: Sequence[int]) -> float:
        """The latency a member of a group with these providers is expected to have when nothing (or
        nothing recent) says otherwise: the explicit prior, else the median measured member."""
        view = self._view
        if view.latency_prior is not None:
            return view.latency_prior
        measured = [view.latency[p] for p in providers if p >= 0 and view.fresh[p] > 0.0]
        return median(measured) if measured else NOTHING_MEASURED_PRIOR_S


class ProviderView:
    __slots__ = ("usable", "cooled_until", "cooled_at", "down", "nonconformant", "latency", "weighted", "fresh", "epoch",
                 "latency_prior", "inflight", "cost")

    def __init__(self, count: int, inflight: Callable[[int], int] = _no_load,
                 latency_prior: float | None = None) -> None:
        self.usable = [True] * count  # read per selection
        self.cooled_until = [0.0] * count  # monotonic seconds
        self.cooled_at = [0.0] * count  # when the latest cooling began (orders the all-cooled fallback)
        self.down = [False] * count  # no routable endpoint
        self.nonconformant = [False] * count  # failed a required conformance check (routing.conformance)
        self.latency = [0.0] * count  # measured first-byte latency in seconds (the samples, not aged)
        self.weighted = [0.0] * count  # latency x freshness
        self.fresh = [0.0] * count  # freshness of the measurement: 1 just measured .. 0 never measured
        self.epoch = 0  # moves whenever the latencies may have changed
        self.latency_prior = latency_prior  # seconds; None: the group's median measured latency
        self.inflight = inflight  # provider -> requests in flight on all workers of the host (live)
        self.cost = LoadCost(self)

    def measured(self, provider: int, latency: float, fresh: float) -> None:
        """The provider's first-byte latency is ``latency`` seconds, measured with freshness ``fresh``."""
        self.latency[provider] = latency
        self.weighted[provider] = latency * fresh
        self.fresh[provider] = fresh
        self.epoch += 1

    def __len__(self) -> int:
        return len(self.usable)

    def cool(self, provider: int, until: float, at: float) -> None:
        if until > self.cooled_until[provider]:
            self.cooled_until[provider] = until
            self.cooled_at[provider] = at
            self.usable[provider] = False

    def recompute(self, now: float) -> None:
        """Derive ``usable`` after the raw facts changed (or time passed)."""
        until, down, failed = self.cooled_until, self.down, self.nonconformant
        # in place: closures hold the list
        self.usable[:] = [until[p] <= now and not down[p] and not failed[p] for p in range(len(until))]

    def fallback_rank(self, provider: int) -> tuple[bool, bool, float]:
        """Order among unusable providers when nothing is usable: a conformant provider before a
        nonconformant one, a cooled provider with routable endpoints before a down one, then the least
        recently cooled first."""
        return (self.nonconformant[provider], self.down[provider], self.cooled_at[provider])
