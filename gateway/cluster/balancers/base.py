"""What every balancer shares: the endpoint and state-view protocols, health, panic and slow start.

A balancer is generic over the endpoint objects it is given (the worker's own, with their pools) and
hands one of them back per pick, so the caller needs no slot -> object lookup. It reads endpoint state
through a :class:`StateView` and caches everything it derives from health: per pick it reads one
generation word and only rebuilds when the health writer published a change.

Health: only ROUTABLE endpoints are candidates, weighted by their slow-start share. A PROBE endpoint
(half-open, and this worker holds the probe) is returned once, ahead of the strategy. When no endpoint
is routable the balancer enters *panic*: it routes across all endpoints at their configured weights,
logs once per transition and counts it (``panic_entries``, ``panic_picks``).
"""

from __future__ import annotations

import logging
import math
import random
from bisect import bisect_right
from collections.abc import Callable, Collection, Sequence
from itertools import accumulate
from typing import ClassVar, Generic, Protocol, TypeVar

log = logging.getLogger("gridgate.balancing")

# Slot statuses a StateView reports.
ROUTABLE, DOWN, PROBE = 0, 1, 2
FULL_PERMILLE = 1000

_random = random.random


class BalancedEndpoint(Protocol):
    """What a balancer needs of an endpoint object; the worker's endpoint objects qualify as they are.

    Excluded endpoints are found by membership (``endpoint in excluded``), so objects must hash; the
    default identity hash is the cheapest.
    """

    @property
    def slot(self) -> int:
        """Its shared-memory slot: where its health and in-flight counts live."""
        ...

    @property
    def weight(self) -> int:
        """Configured weight, >= 1."""
        ...

    @property
    def address(self) -> str:
        """``host:port``; hashing lays its key space out by address, so every host maps keys alike."""
        ...


E = TypeVar("E", bound=BalancedEndpoint)


class StateView(Protocol):
    """What a balancer reads about endpoint slots (gateway.cluster.shared_view over shared memory)."""

    def generation(self) -> int:
        """Changes whenever anything below may have changed (health, rows in use). Read per pick."""
        ...

    def slot_health(self, slot: int) -> tuple[int, int]:
        """(ROUTABLE | DOWN | PROBE, weight permille 1..1000)."""
        ...

    def mark_probe_sent(self, slot: int) -> None:
        """The single half-open probe this worker held for ``slot`` has been handed out."""
        ...

    def inflight_reader(self, slots: Sequence[int]) -> Callable[[], Sequence[int]]:
        """A cheap callable returning in-flight totals (all workers) for ``slots``, in order."""
        ...

    def inflight_getter(self, slot: int) -> Callable[[], int]:
        """A cheap callable returning the in-flight total (all workers) of one slot."""
        ...


class Balancer(Generic[E]):
    """Health bookkeeping shared by every strategy; subclasses implement ``_install`` and ``_choose``."""

    strategy: ClassVar[str] = ""
    key_header: bytes | None = None  # hashing strategies: lower-case header whose value is the key

    def __init__(self, endpoints: Sequence[E], view: StateView, *, cluster: str = "") -> None:
        if not endpoints:
            raise ValueError("a balancer needs at least one endpoint")
        if len({e.slot for e in endpoints}) != len(endpoints):
            raise ValueError("endpoint slots must be distinct")
        if any(e.weight < 1 for e in endpoints):
            raise ValueError("endpoint weights must be >= 1")
        self.endpoints: tuple[E, ...] = tuple(endpoints)
        self.cluster = cluster
        self.panic = False
        self.panic_entries = 0
        self.panic_picks = 0
        self._view = view
        self._read_generation = view.generation
        self._generation = -1
        self._candidates_key: tuple[tuple[int, int], ...] | None = None
        self._probes: list[E] = []
        self._refresh()

    def pick(self, key: bytes | None = None, excluded: Collection[E] | None = None) -> E | None:
        """The endpoint for this attempt, never one in ``excluded``; None if none is left.

        ``excluded`` is None (the first attempt: nothing to allocate) or the endpoints already tried.
        """
        if self._read_generation() != self._generation:
            self._refresh()
        if self._probes:
            probe = self._take_probe(excluded)
            if probe is not None:
                return probe
        if self.panic:
            self.panic_picks += 1
        return self._choose(key, excluded)

    # -- health -------------------------------------------------------------------------------
    def _refresh(self) -> None:
        generation = self._read_generation()  # read first: a change during the scan refreshes again
        slot_health = self._view.slot_health
        routable: list[tuple[E, int]] = []
        probes: list[E] = []
        for endpoint in self.endpoints:
            status, permille = slot_health(endpoint.slot)
            if status == ROUTABLE:
                routable.append((endpoint, permille))
            elif status == PROBE:
                probes.append(endpoint)
        panic = not routable
        self._note_panic(panic)
        candidates = [(endpoint, FULL_PERMILLE) for endpoint in self.endpoints] if panic else routable
        self._probes = [] if panic else probes
        key = tuple((endpoint.slot, permille) for endpoint, permille in candidates)
        changed = key != self._candidates_key
        self._candidates_key = key
        self._install(candidates, changed)
        self._generation = generation

    def _note_panic(self, panic: bool) -> None:
        if panic == self.panic:
            return
        self.panic = panic
        if panic:
            self.panic_entries += 1
            log.warning("cluster %s: no healthy endpoint, panic mode: routing across all %d endpoints",
                        self.cluster, len(self.endpoints))
        else:
            log.warning("cluster %s: healthy endpoints are back, leaving panic mode", self.cluster)

    def _take_probe(self, excluded: Collection[E] | None) -> E | None:
        for i, endpoint in enumerate(self._probes):
            if not excluded or endpoint not in excluded:
                del self._probes[i]
                self._view.mark_probe_sent(endpoint.slot)
                return endpoint
        return None

    # -- strategy -----------------------------------------------------------------------------
    def _install(self, candidates: list[tuple[E, int]], changed: bool) -> None:
        """Take the current candidates ((endpoint, weight permille), health applied); ``changed`` says
        whether they differ from the last call (a refresh may also just mean more worker rows)."""
        raise NotImplementedError

    def _choose(self, key: bytes | None, excluded: Collection[E] | None) -> E | None:
        raise NotImplementedError


def effective_weights(candidates: Sequence[tuple[BalancedEndpoint, int]]) -> list[int]:
    """Configured weight times slow-start share, reduced by their gcd so cycles stay short."""
    weights = [endpoint.weight * permille for endpoint, permille in candidates]
    g = math.gcd(*weights)
    return [w // g for w in weights]


class WeightedSampler(Generic[E]):
    """Weighted random choice by bisecting cumulative weights; O(log n), no allocation."""

    __slots__ = ("endpoints", "weights", "cumulative", "total", "last")

    def __init__(self, endpoints: list[E], weights: list[int]) -> None:
        self.endpoints = endpoints
        self.weights = weights
        self.cumulative = list(accumulate(weights))
        self.total = self.cumulative[-1]
        self.last = len(endpoints) - 1

    def index(self) -> int:
        i = bisect_right(self.cumulative, _random() * self.total)
        return i if i <= self.last else self.last

    def pick(self, excluded: Collection[E] | None) -> E | None:
        endpoint = self.endpoints[self.index()]
        if not excluded or endpoint not in excluded:
            return endpoint
        return self.pick_excluding(excluded)

    def pick_excluding(self, excluded: Collection[E]) -> E | None:
        allowed = [(e, w) for e, w in zip(self.endpoints, self.weights, strict=True) if e not in excluded]
        if not allowed:
            return None
        r = _random() * sum(w for _, w in allowed)
        for endpoint, weight in allowed:
            r -= weight
            if r < 0:
                return endpoint
        return allowed[-1][0]
