"""Weight-only strategies: smooth weighted round robin and weighted random (no load, no key)."""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

from gateway.cluster.balancers.base import Balancer, E, WeightedSampler, effective_weights

RR_CYCLE_WORK = 200_000  # cap on cycle length * endpoints when precomputing a round-robin cycle


class WeightedRandom(Balancer[E]):
    strategy = "random"

    def _install(self, candidates: list[tuple[E, int]], changed: bool) -> None:
        if changed:
            self._sampler = WeightedSampler([e for e, _ in candidates], effective_weights(candidates))

    def _choose(self, key: bytes | None, excluded: Collection[E] | None) -> E | None:
        return self._sampler.pick(excluded)


def smooth_weighted_cycle(weights: Sequence[int], max_work: int = RR_CYCLE_WORK) -> list[int]:
    """One full cycle of nginx's smooth weighted round robin, as candidate indexes.

    Over the cycle each index appears exactly ``weight / gcd`` times, interleaved (1:3 -> b a b b).
    Weights whose cycle would cost more than ``max_work`` steps are scaled down first (approximate).
    """
    g = math.gcd(*weights)
    reduced = [w // g for w in weights]
    n = len(reduced)
    total = sum(reduced)
    limit = max(n, max_work // n)
    if total > limit:
        reduced = [max(1, w * limit // total) for w in reduced]
        total = sum(reduced)
    current = [0] * n
    cycle = []
    for _ in range(total):
        best = 0
        for i in range(n):
            current[i] += reduced[i]
            if current[i] > current[best]:
                best = i
        current[best] -= total
        cycle.append(best)
    return cycle


class RoundRobin(Balancer[E]):
    """Smooth weighted round robin, precomputed as a cycle so a pick is O(1)."""

    strategy = "round_robin"

    def _install(self, candidates: list[tuple[E, int]], changed: bool) -> None:
        if changed:
            endpoints = [e for e, _ in candidates]
            self._cycle = [endpoints[i] for i in smooth_weighted_cycle(effective_weights(candidates))]
            self._length = len(self._cycle)
            self._position = 0

    def _choose(self, key: bytes | None, excluded: Collection[E] | None) -> E | None:
        position = self._position
        endpoint = self._cycle[position]
        position += 1
        self._position = position if position < self._length else 0
        if excluded and endpoint in excluded:
            return self._next_allowed(excluded)
        return endpoint

    def _next_allowed(self, excluded: Collection[E]) -> E | None:
        # Walk on along the cycle (retry path only) so the weighted order is kept.
        for _ in range(self._length):
            endpoint = self._cycle[self._position]
            self._position = (self._position + 1) % self._length
            if endpoint not in excluded:
                return endpoint
        return None
