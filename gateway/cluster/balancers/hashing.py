"""Key-affine strategies: a consistent-hash ring (ketama) and Maglev, keyed by a request header or path.

The key space is laid out once over *all* endpoints at their configured weights, by address (so every
worker and every host maps a key alike), and health changes never remap keys of healthy endpoints: an
unavailable endpoint's keys rehash onto the others; a slow-starting one accepts only the keys whose
``hash % 1000`` is below its permille (deterministic per key, growing with the ramp).
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left
from collections.abc import Collection, Sequence
from functools import lru_cache

import xxhash

from gateway.cluster.balancers.base import (
    FULL_PERMILLE,
    Balancer,
    E,
    StateView,
    WeightedSampler,
    effective_weights,
)

MAGLEV_TABLE_SIZE = 65537  # prime, as the Maglev paper requires
RING_POINTS_PER_WEIGHT = 160  # ketama's per-server count: ~±10% share spread per endpoint
MAX_RING_POINTS = 40_000
_REHASH_ATTEMPTS = 16

_xxh3 = xxhash.xxh3_64_intdigest


def hash_key(header_value: bytes | None, target: bytes) -> bytes:
    """The hashing key of a request: the configured header's value, else the request path."""
    if header_value:
        return header_value
    query = target.find(b"?")
    return target if query < 0 else target[:query]


class HashBalancer(Balancer[E]):
    """Shared by the ring and Maglev; a pick without a key falls back to weighted random."""

    def __init__(self, endpoints: Sequence[E], view: StateView, *, header: str | None = None,
                 cluster: str = "") -> None:
        self.key_header = header.lower().encode() if header else None
        self._index_of = {endpoint: i for i, endpoint in enumerate(endpoints)}
        self._all = list(endpoints)
        super().__init__(endpoints, view, cluster=cluster)

    def _install(self, candidates: list[tuple[E, int]], changed: bool) -> None:
        if changed:
            accept = [0] * len(self._all)
            for endpoint, permille in candidates:
                accept[self._index_of[endpoint]] = permille
            self._accept = accept
            self._sampler = WeightedSampler([e for e, _ in candidates], effective_weights(candidates))

    def _choose(self, key: bytes | None, excluded: Collection[E] | None) -> E | None:
        if key is None:
            return self._sampler.pick(excluded)
        h = _xxh3(key)
        return self._lookup(key, h, h % FULL_PERMILLE, excluded)

    def _lookup(self, key: bytes, h: int, share: int, excluded: Collection[E] | None) -> E | None:
        raise NotImplementedError

    def _acceptable(self, e: int, share: int, excluded: Collection[E] | None) -> bool:
        permille = self._accept[e]
        if permille >= FULL_PERMILLE or share < permille:
            return not excluded or self._all[e] not in excluded
        return False


class ConsistentHash(HashBalancer[E]):
    """Ketama-style ring: ``RING_POINTS_PER_WEIGHT`` points per unit of (gcd-reduced) weight."""

    strategy = "consistent_hash"

    def __init__(self, endpoints: Sequence[E], view: StateView, *, header: str | None = None,
                 cluster: str = "") -> None:
        self._points, self._owners = _cached_ring(tuple(e.address for e in endpoints), tuple(e.weight for e in endpoints))
        super().__init__(endpoints, view, header=header, cluster=cluster)

    def _lookup(self, key: bytes, h: int, share: int, excluded: Collection[E] | None) -> E | None:
        points, owners = self._points, self._owners
        n = len(points)
        i = bisect_left(points, h)
        for _ in range(n):
            if i >= n:
                i = 0
            e = owners[i]
            if self._acceptable(e, share, excluded):
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


class Maglev(HashBalancer[E]):
    """Maglev lookup table (size 65537, weighted as in Envoy): O(1) pick, minimal disruption."""

    strategy = "maglev"

    def __init__(self, endpoints: Sequence[E], view: StateView, *, header: str | None = None,
                 cluster: str = "") -> None:
        self._table = _cached_maglev(tuple(e.address for e in endpoints), tuple(e.weight for e in endpoints))
        super().__init__(endpoints, view, header=header, cluster=cluster)

    def _lookup(self, key: bytes, h: int, share: int, excluded: Collection[E] | None) -> E | None:
        e = self._table[h % MAGLEV_TABLE_SIZE]
        if self._acceptable(e, share, excluded):
            return self._all[e]
        for seed in range(1, _REHASH_ATTEMPTS + 1):
            e = self._table[_xxh3(key, seed) % MAGLEV_TABLE_SIZE]
            if self._acceptable(e, share, excluded):
                return self._all[e]
        # Nearly everything is unavailable: a deterministic scan so the key still lands somewhere.
        n = len(self._all)
        for step in range(n):
            e = (h + step) % n
            if self._accept[e] and (not excluded or self._all[e] not in excluded):
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
