"""Load-aware strategies: least connections and power of two choices, on in-flight counts summed over
every worker of the host (read from shared memory through the state view)."""

from __future__ import annotations

import math
import random
from bisect import bisect_right
from collections.abc import Collection
from operator import add, mul

from gateway.cluster.balancers.base import Balancer, E, WeightedSampler, effective_weights

_random = random.random


class LeastConnections(Balancer[E]):
    """Fewest in-flight requests per unit of weight, over all workers; ties: heavier, then random.

    Candidates are kept sorted by weight (heaviest first), so the first minimum found by the C-level
    ``list.index`` already sits in the heaviest tied weight group.
    """

    strategy = "least_connections"

    def _install(self, candidates: list[tuple[E, int]], changed: bool) -> None:
        # Always re-read: the in-flight reader depends on the rows in use, which may have changed.
        weights = effective_weights(candidates)
        order = sorted(range(len(candidates)), key=lambda i: -weights[i])
        endpoints = [candidates[i][0] for i in order]
        weights = [weights[i] for i in order]
        self._endpoints = endpoints
        self._index = {endpoint: i for i, endpoint in enumerate(endpoints)}
        self._uniform = len(set(weights)) == 1
        self._group_end = [sum(1 for v in weights if v >= w) for w in weights]
        # Score (in_flight + 1) / weight compared exactly as integers: (in_flight + 1) * lcm / weight.
        lcm = math.lcm(*weights)
        self._scale = [lcm // w for w in weights]
        self._ones = [1] * len(endpoints)
        self._read_inflight = self._view.inflight_reader([e.slot for e in endpoints])

    def _choose(self, key: bytes | None, excluded: Collection[E] | None) -> E | None:
        loads = self._read_inflight()
        if self._uniform:
            scores = list(loads)
        else:
            scores = list(map(mul, map(add, loads, self._ones), self._scale))
        if excluded:
            return self._choose_excluding(scores, excluded)
        best = min(scores)
        first = scores.index(best)
        ties = scores.count(best)
        if ties == 1:
            return self._endpoints[first]
        if ties == len(scores):  # idle cluster: everything ties; the heaviest group comes first
            return self._endpoints[int(_random() * self._group_end[0])]
        return self._break_tie(scores, best, first)

    def _choose_excluding(self, scores: list[int], excluded: Collection[E]) -> E | None:
        for endpoint in excluded:
            i = self._index.get(endpoint)
            if i is not None:
                scores[i] = math.inf  # type: ignore[call-overload]
        best = min(scores)
        if best == math.inf:
            return None
        return self._break_tie(scores, best, scores.index(best))

    def _break_tie(self, scores: list[int], best: int, first: int) -> E:
        tied = [i for i in range(first, self._group_end[first]) if scores[i] == best]
        return self._endpoints[tied[int(_random() * len(tied))]]


class PowerOfTwoChoices(Balancer[E]):
    """Two distinct weighted samples; the one with fewer in-flight per unit of weight wins."""

    strategy = "p2c"

    def _install(self, candidates: list[tuple[E, int]], changed: bool) -> None:
        endpoints = [e for e, _ in candidates]
        weights = effective_weights(candidates)
        self._sampler = WeightedSampler(endpoints, weights)
        self._endpoints = endpoints
        self._weights = weights
        lcm = math.lcm(*weights)
        self._scale = [lcm // w for w in weights]
        self._getters = [self._view.inflight_getter(e.slot) for e in endpoints]

    def _choose(self, key: bytes | None, excluded: Collection[E] | None) -> E | None:
        sampler = self._sampler
        if excluded or sampler.last == 0:
            return self._choose_excluding(excluded or ())
        cumulative, weights = sampler.cumulative, self._weights
        a = sampler.index()
        weight_a = weights[a]
        # Second sample from the distribution without ``a``: skip a's interval of the cumulative line.
        r = _random() * (sampler.total - weight_a)
        if r >= cumulative[a] - weight_a:
            r += weight_a
        b = bisect_right(cumulative, r)
        if b > sampler.last or b == a:  # float edge cases only
            b = a - 1 if a else a + 1
        score_a = (self._getters[a]() + 1) * self._scale[a]
        score_b = (self._getters[b]() + 1) * self._scale[b]
        endpoints = self._endpoints
        if score_a == score_b:
            if weights[a] == weights[b]:
                return endpoints[a] if _random() < 0.5 else endpoints[b]
            return endpoints[a] if weights[a] > weights[b] else endpoints[b]
        return endpoints[a] if score_a < score_b else endpoints[b]

    def _choose_excluding(self, excluded: Collection[E]) -> E | None:
        allowed = [i for i, e in enumerate(self._endpoints) if e not in excluded]
        if len(allowed) <= 1:
            return self._endpoints[allowed[0]] if allowed else None
        first = self._sampler.pick_excluding(excluded)
        assert first is not None
        second = self._sampler.pick_excluding({*excluded, first})
        assert second is not None
        a, b = self._endpoints.index(first), self._endpoints.index(second)
        score_a = (self._getters[a]() + 1) * self._scale[a]
        score_b = (self._getters[b]() + 1) * self._scale[b]
        return first if score_a <= score_b else second
