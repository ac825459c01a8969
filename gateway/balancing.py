"""Endpoint load balancing inside one cluster (pure: no sockets, no clocks).

A balancer picks one endpoint per request. It reads endpoint state through a :class:`StateView`
(shared memory in production, :class:`LocalState` in tests) and caches everything it derives from
health: per pick it reads one generation word and only rebuilds when the health writer published a
change. Strategies: smooth weighted round robin, least connections, power of two choices, weighted
random, consistent hashing (ring) and Maglev.

Health: only ROUTABLE endpoints are candidates, weighted by their slow-start share. A PROBE endpoint
(half-open, and this worker holds the probe) is returned once, ahead of the strategy. When no endpoint
is routable the balancer enters *panic*: it routes across all endpoints at their configured weights,
logs once per transition and counts it (``panic_entries``, ``panic_picks``).
"""

from __future__ import annotations

import logging
import math
import random
from array import array
from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate
from operator import add, mul
from typing import Any, ClassVar, Protocol

import xxhash

log = logging.getLogger("gridgate.balancing")

# Slot statuses a StateView reports.
ROUTABLE, DOWN, PROBE = 0, 1, 2
FULL_PERMILLE = 1000

MAGLEV_TABLE_SIZE = 65537  # prime, as the Maglev paper requires
RING_POINTS_PER_WEIGHT = 160  # ketama's per-server count: ~±10% share spread per endpoint
MAX_RING_POINTS = 40_000
RR_CYCLE_WORK = 200_000  # cap on cycle length * endpoints when precomputing a round-robin cycle
_REHASH_ATTEMPTS = 16

NO_EXCLUDE: frozenset[int] = frozenset()

_random = random.random
_xxh3 = xxhash.xxh3_64_intdigest


@dataclass(frozen=True, slots=True)
class EndpointRef:
    """An endpoint as the balancer sees it: its shared-memory slot, address and configured weight."""

    slot: int
    address: str
    weight: int = 1


class StateView(Protocol):
    """What a balancer reads about endpoints. Implemented over shared memory by gateway.endpoints."""

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


class LocalState:
    """An in-process StateView: for tests, benchmarks and a worker running without shared memory."""

    def __init__(self) -> None:
        self._generation = 0
        self._health: dict[int, tuple[int, int]] = {}
        self.inflight: defaultdict[int, int] = defaultdict(int)

    def set_health(self, slot: int, status: int, permille: int = FULL_PERMILLE) -> None:
        self._health[slot] = (status, permille)
        self._generation += 1

    def generation(self) -> int:
        return self._generation

    def slot_health(self, slot: int) -> tuple[int, int]:
        return self._health.get(slot, (ROUTABLE, FULL_PERMILLE))

    def mark_probe_sent(self, slot: int) -> None:
        self._health[slot] = (DOWN, FULL_PERMILLE)

    def inflight_reader(self, slots: Sequence[int]) -> Callable[[], Sequence[int]]:
        counts, order = self.inflight, tuple(slots)
        return lambda: [counts[s] for s in order]

    def inflight_getter(self, slot: int) -> Callable[[], int]:
        counts = self.inflight
        return lambda: counts[slot]


Candidate = tuple[EndpointRef, int]  # (endpoint, weight permille)


class Balancer:
    """Health bookkeeping shared by every strategy; subclasses implement ``_install`` and ``_choose``."""

    strategy: ClassVar[str] = ""
    key_header: bytes | None = None  # hashing strategies: lower-case header whose value is the key

    def __init__(self, endpoints: Sequence[EndpointRef], view: StateView, *, cluster: str = "") -> None:
        if not endpoints:
            raise ValueError("a balancer needs at least one endpoint")
        if len({e.slot for e in endpoints}) != len(endpoints):
            raise ValueError("endpoint slots must be distinct")
        if any(e.weight < 1 for e in endpoints):
            raise ValueError("endpoint weights must be >= 1")
        self.endpoints = tuple(endpoints)
        self.cluster = cluster
        self.panic = False
        self.panic_entries = 0
        self.panic_picks = 0
        self._view = view
        self._read_generation = view.generation
        self._generation = -1
        self._candidates_key: tuple[tuple[int, int], ...] | None = None
        self._probes: list[EndpointRef] = []
        self._refresh()

    def pick(self, key: bytes | None = None, exclude: Collection[int] = NO_EXCLUDE) -> EndpointRef | None:
        """The endpoint for this attempt, never one whose slot is in ``exclude``; None if none is left."""
        if self._read_generation() != self._generation:
            self._refresh()
        if self._probes:
            probe = self._take_probe(exclude)
            if probe is not None:
                return probe
        if self.panic:
            self.panic_picks += 1
        return self._choose(key, exclude)

    # -- health -------------------------------------------------------------------------------
    def _refresh(self) -> None:
        generation = self._read_generation()  # read first: a change during the scan refreshes again
        slot_health = self._view.slot_health
        routable: list[Candidate] = []
        probes: list[EndpointRef] = []
        for ref in self.endpoints:
            status, permille = slot_health(ref.slot)
            if status == ROUTABLE:
                routable.append((ref, permille))
            elif status == PROBE:
                probes.append(ref)
        panic = not routable
        self._note_panic(panic)
        candidates = [(ref, FULL_PERMILLE) for ref in self.endpoints] if panic else routable
        self._probes = [] if panic else probes
        key = tuple((ref.slot, permille) for ref, permille in candidates)
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

    def _take_probe(self, exclude: Collection[int]) -> EndpointRef | None:
        for i, ref in enumerate(self._probes):
            if ref.slot not in exclude:
                del self._probes[i]
                self._view.mark_probe_sent(ref.slot)
                return ref
        return None

    # -- strategy -----------------------------------------------------------------------------
    def _install(self, candidates: list[Candidate], changed: bool) -> None:
        raise NotImplementedError

    def _choose(self, key: bytes | None, exclude: Collection[int]) -> EndpointRef | None:
        raise NotImplementedError


def _effective_weights(candidates: list[Candidate]) -> list[int]:
    """Configured weight times slow-start share, reduced by their gcd so cycles stay short."""
    weights = [ref.weight * permille for ref, permille in candidates]
    g = math.gcd(*weights)
    return [w // g for w in weights]


class _WeightedSampler:
    """Weighted random choice by bisecting cumulative weights; O(log n), no allocation."""

    __slots__ = ("refs", "weights", "cumulative", "total", "last")

    def __init__(self, refs: list[EndpointRef], weights: list[int]) -> None:
        self.refs = refs
        self.weights = weights
        self.cumulative = list(accumulate(weights))
        self.total = self.cumulative[-1]
        self.last = len(refs) - 1

    def index(self) -> int:
        i = bisect_right(self.cumulative, _random() * self.total)
        return i if i <= self.last else self.last

    def pick(self, exclude: Collection[int]) -> EndpointRef | None:
        ref = self.refs[self.index()]
        if not exclude or ref.slot not in exclude:
            return ref
        return self.pick_excluding(exclude)

    def pick_excluding(self, exclude: Collection[int]) -> EndpointRef | None:
        allowed = [(r, w) for r, w in zip(self.refs, self.weights, strict=True) if r.slot not in exclude]
        if not allowed:
            return None
        r = _random() * sum(w for _, w in allowed)
        for ref, weight in allowed:
            r -= weight
            if r < 0:
                return ref
        return allowed[-1][0]


class WeightedRandom(Balancer):
    strategy = "random"

    def _install(self, candidates: list[Candidate], changed: bool) -> None:
        if changed:
            self._sampler = _WeightedSampler([ref for ref, _ in candidates], _effective_weights(candidates))

    def _choose(self, key: bytes | None, exclude: Collection[int]) -> EndpointRef | None:
        return self._sampler.pick(exclude)


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


class RoundRobin(Balancer):
    """Smooth weighted round robin, precomputed as a cycle so a pick is O(1)."""

    strategy = "round_robin"

    def _install(self, candidates: list[Candidate], changed: bool) -> None:
        if changed:
            refs = [ref for ref, _ in candidates]
            self._cycle = [refs[i] for i in smooth_weighted_cycle(_effective_weights(candidates))]
            self._length = len(self._cycle)
            self._position = 0

    def _choose(self, key: bytes | None, exclude: Collection[int]) -> EndpointRef | None:
        position = self._position
        ref = self._cycle[position]
        position += 1
        self._position = position if position < self._length else 0
        if exclude and ref.slot in exclude:
            return self._next_allowed(exclude)
        return ref

    def _next_allowed(self, exclude: Collection[int]) -> EndpointRef | None:
        # Walk on along the cycle (retry path only) so the weighted order is kept.
        for _ in range(self._length):
            ref = self._cycle[self._position]
            self._position = (self._position + 1) % self._length
            if ref.slot not in exclude:
                return ref
        return None


class LeastConnections(Balancer):
    """Fewest in-flight requests per unit of weight, over all workers; ties: heavier, then random.

    Candidates are kept sorted by weight (heaviest first), so the first minimum found by the C-level
    ``list.index`` already sits in the heaviest tied weight group.
    """

    strategy = "least_connections"

    def _install(self, candidates: list[Candidate], changed: bool) -> None:
        # Always re-read: the in-flight reader depends on the rows in use, which may have changed.
        weights = _effective_weights(candidates)
        order = sorted(range(len(candidates)), key=lambda i: -weights[i])
        refs = [candidates[i][0] for i in order]
        weights = [weights[i] for i in order]
        self._refs = refs
        self._weights = weights
        self._index = {ref.slot: i for i, ref in enumerate(refs)}
        self._uniform = len(set(weights)) == 1
        self._group_end = [sum(1 for v in weights if v >= w) for w in weights]
        # Score (in_flight + 1) / weight compared exactly as integers: (in_flight + 1) * lcm / weight.
        lcm = math.lcm(*weights)
        self._scale = [lcm // w for w in weights]
        self._ones = [1] * len(refs)
        self._read_inflight = self._view.inflight_reader([ref.slot for ref in refs])

    def _choose(self, key: bytes | None, exclude: Collection[int]) -> EndpointRef | None:
        loads = self._read_inflight()
        if self._uniform:
            scores = list(loads)
        else:
            scores = list(map(mul, map(add, loads, self._ones), self._scale))
        if exclude:
            return self._choose_excluding(scores, exclude)
        best = min(scores)
        first = scores.index(best)
        ties = scores.count(best)
        if ties == 1:
            return self._refs[first]
        if ties == len(scores):  # idle cluster: everything ties; the heaviest group comes first
            return self._refs[int(_random() * self._group_end[0])]
        return self._break_tie(scores, best, first)

    def _choose_excluding(self, scores: list[int], exclude: Collection[int]) -> EndpointRef | None:
        for slot in exclude:
            i = self._index.get(slot)
            if i is not None:
                scores[i] = math.inf  # type: ignore[call-overload]
        best = min(scores)
        if best == math.inf:
            return None
        return self._break_tie(scores, best, scores.index(best))

    def _break_tie(self, scores: list[int], best: int, first: int) -> EndpointRef:
        tied = [i for i in range(first, self._group_end[first]) if scores[i] == best]
        return self._refs[tied[int(_random() * len(tied))]]


class PowerOfTwoChoices(Balancer):
    """Two distinct weighted samples; the one with fewer in-flight per unit of weight wins."""

    strategy = "p2c"

    def _install(self, candidates: list[Candidate], changed: bool) -> None:
        refs = [ref for ref, _ in candidates]
        weights = _effective_weights(candidates)
        self._sampler = _WeightedSampler(refs, weights)
        self._refs = refs
        self._weights = weights
        lcm = math.lcm(*weights)
        self._scale = [lcm // w for w in weights]
        self._getters = [self._view.inflight_getter(ref.slot) for ref in refs]

    def _choose(self, key: bytes | None, exclude: Collection[int]) -> EndpointRef | None:
        sampler = self._sampler
        if sampler.last == 0 or exclude:
            return self._choose_excluding(exclude)
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
        if score_a == score_b:
            if weights[a] == weights[b]:
                return self._refs[a] if _random() < 0.5 else self._refs[b]
            return self._refs[a] if weights[a] > weights[b] else self._refs[b]
        return self._refs[a] if score_a < score_b else self._refs[b]

    def _choose_excluding(self, exclude: Collection[int]) -> EndpointRef | None:
        allowed = [i for i, ref in enumerate(self._refs) if ref.slot not in exclude]
        if len(allowed) <= 1:
            return self._refs[allowed[0]] if allowed else None
        first = self._sampler.pick_excluding(exclude)
        assert first is not None
        second = self._sampler.pick_excluding({*exclude, first.slot})
        assert second is not None
        a, b = self._refs.index(first), self._refs.index(second)
        score_a = (self._getters[a]() + 1) * self._scale[a]
        score_b = (self._getters[b]() + 1) * self._scale[b]
        return first if score_a <= score_b else second


class _HashBalancer(Balancer):
    """Shared by the ring and Maglev: the key space is laid out once over *all* endpoints at their
    configured weights, so health changes never remap keys of healthy endpoints. An unavailable
    endpoint's keys rehash onto the others; a slow-starting one accepts only the keys whose
    ``hash % 1000`` is below its permille (deterministic per key, growing with the ramp)."""

    def __init__(self, endpoints: Sequence[EndpointRef], view: StateView, *, header: str | None = None,
                 cluster: str = "") -> None:
        self.key_header = header.lower().encode() if header else None
        self._slot_index = {ref.slot: i for i, ref in enumerate(endpoints)}
        self._all = list(endpoints)
        super().__init__(endpoints, view, cluster=cluster)

    def _install(self, candidates: list[Candidate], changed: bool) -> None:
        if changed:
            accept = [0] * len(self._all)
            for ref, permille in candidates:
                accept[self._slot_index[ref.slot]] = permille
            self._accept = accept
            self._sampler = _WeightedSampler([ref for ref, _ in candidates], _effective_weights(candidates))

    def _choose(self, key: bytes | None, exclude: Collection[int]) -> EndpointRef | None:
        if key is None:
            return self._sampler.pick(exclude)
        h = _xxh3(key)
        return self._lookup(key, h, h % FULL_PERMILLE, exclude)

    def _lookup(self, key: bytes, h: int, share: int, exclude: Collection[int]) -> EndpointRef | None:
        raise NotImplementedError

    def _acceptable(self, e: int, share: int, exclude: Collection[int]) -> bool:
        permille = self._accept[e]
        if permille >= FULL_PERMILLE or share < permille:
            return not exclude or self._all[e].slot not in exclude
        return False


class ConsistentHash(_HashBalancer):
    """Ketama-style ring: ``RING_POINTS_PER_WEIGHT`` points per unit of (gcd-reduced) weight."""

    strategy = "consistent_hash"

    def __init__(self, endpoints: Sequence[EndpointRef], view: StateView, *, header: str | None = None,
                 cluster: str = "") -> None:
        self._points, self._owners = _cached_ring(tuple(e.address for e in endpoints), tuple(e.weight for e in endpoints))
        super().__init__(endpoints, view, header=header, cluster=cluster)

    def _lookup(self, key: bytes, h: int, share: int, exclude: Collection[int]) -> EndpointRef | None:
        points, owners = self._points, self._owners
        n = len(points)
        i = bisect_left(points, h)
        for _ in range(n):
            if i >= n:
                i = 0
            e = owners[i]
            if self._acceptable(e, share, exclude):
                return self._all[e]
            i += 1
        return None


def hash_ring(addresses: Sequence[str], weights: Sequence[int]) -> tuple[list[int], list[int]]:
    """Sorted ring points (xxh3 of "address#i") and their owning endpoint indexes."""
    g = math.gcd(*weights)
    counts = [RING_POINTS_PER_WEIGHT * w // g for w in weights]
    total = sum(counts)
    if total > MAX_RING_POINTS:
        counts = [max(1, c * MAX_RING_POINTS // total) for c in counts]
    ring = sorted(
        (_xxh3(f"{address}#{i}".encode()), owner)
        for owner, (address, count) in enumerate(zip(addresses, counts, strict=True))
        for i in range(count)
    )
    return [p for p, _ in ring], [o for _, o in ring]


class Maglev(_HashBalancer):
    """Maglev lookup table (size 65537, weighted as in Envoy): O(1) pick, minimal disruption."""

    strategy = "maglev"

    def __init__(self, endpoints: Sequence[EndpointRef], view: StateView, *, header: str | None = None,
                 cluster: str = "") -> None:
        self._table = _cached_maglev(tuple(e.address for e in endpoints), tuple(e.weight for e in endpoints))
        super().__init__(endpoints, view, header=header, cluster=cluster)

    def _lookup(self, key: bytes, h: int, share: int, exclude: Collection[int]) -> EndpointRef | None:
        e = self._table[h % MAGLEV_TABLE_SIZE]
        if self._acceptable(e, share, exclude):
            return self._all[e]
        for seed in range(1, _REHASH_ATTEMPTS + 1):
            e = self._table[_xxh3(key, seed) % MAGLEV_TABLE_SIZE]
            if self._acceptable(e, share, exclude):
                return self._all[e]
        # Nearly everything is unavailable: a deterministic scan so the key still lands somewhere.
        n = len(self._all)
        for step in range(n):
            e = (h + step) % n
            if self._accept[e] and (not exclude or self._all[e].slot not in exclude):
                return self._all[e]
        return None


def maglev_table(addresses: Sequence[str], weights: Sequence[int], size: int = MAGLEV_TABLE_SIZE) -> array:
    """Fill the Maglev lookup table: endpoints take turns claiming their next preferred free entry,
    a lighter endpoint skipping turns in proportion to its weight (Envoy's weighted variant)."""
    n = len(addresses)
    if n > 65535:
        raise ValueError("maglev supports at most 65535 endpoints")
    offsets = [_xxh3(a.encode(), 0x9E37) % size for a in addresses]
    skips = [_xxh3(a.encode(), 0x7F4A) % (size - 1) + 1 for a in addresses]
    table = [-1] * size
    positions = offsets[:]
    heaviest = max(weights)
    targets = [0] * n
    filled = 0
    turn = 0
    while filled < size:
        turn += 1
        for i in range(n):
            if turn * weights[i] < targets[i]:
                continue
            targets[i] += heaviest
            c, skip = positions[i], skips[i]
            while table[c] >= 0:
                c += skip
                if c >= size:
                    c -= size
            table[c] = i
            c += skip
            positions[i] = c - size if c >= size else c
            filled += 1
            if filled == size:
                break
    return array("H", table)


# A reload rebuilds every balancer; unchanged clusters reuse their ring/table (read-only once built).
_cached_ring = lru_cache(maxsize=32)(hash_ring)
_cached_maglev = lru_cache(maxsize=32)(maglev_table)


def build_balancer(strategy_spec: str | Mapping[str, Any], endpoints: Sequence[EndpointRef], state_view: StateView,
                   *, cluster: str = "") -> Balancer:
    """``strategy_spec``: ``round_robin | least_connections | p2c | random``, or
    ``{"consistent_hash": {"header": "X-User-Id"}}`` / ``{"maglev": {"header": ...}}`` (the inner value
    may also be any object with a ``header`` attribute, or None)."""
    if isinstance(strategy_spec, str):
        simple = _SIMPLE.get(strategy_spec)
        if simple is None:
            raise ValueError(f"unknown load balancer strategy {strategy_spec!r}")
        return simple(endpoints, state_view, cluster=cluster)
    if len(strategy_spec) != 1:
        raise ValueError("a hashing strategy spec has exactly one key: consistent_hash or maglev")
    (name, options), = strategy_spec.items()
    hashing = _HASHING.get(name)
    if hashing is None:
        raise ValueError(f"unknown load balancer strategy {name!r}")
    header = options.get("header") if isinstance(options, Mapping) else getattr(options, "header", None)
    return hashing(endpoints, state_view, header=header, cluster=cluster)


_SIMPLE: dict[str, type[Balancer]] = {
    "round_robin": RoundRobin, "least_connections": LeastConnections, "p2c": PowerOfTwoChoices,
    "random": WeightedRandom,
}
_HASHING: dict[str, type[_HashBalancer]] = {"consistent_hash": ConsistentHash, "maglev": Maglev}


def hash_key(header_value: bytes | None, target: bytes) -> bytes:
    """The hashing key of a request: the configured header's value, else the request path."""
    if header_value:
        return header_value
    query = target.find(b"?")
    return target if query < 0 else target[:query]
