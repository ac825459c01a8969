"""Prefix affinity's placement: which provider of a group a prompt prefix goes to, and what moves it
(docs/routing.md, "Prefix affinity").

A group ranks its usable providers for a prefix by rendezvous hashing (the consistent hash the
``stable_hash`` picker uses: a prefix's ranking only changes where a provider joins or leaves, so
when its provider goes down it moves to the next one, and comes back when that one is usable again).
Its *place* is a position in that ranking, 0 at first. This table, one per worker, remembers per prefix:

- its place offset: a prefix that keeps missing the provider's prompt cache (``misses`` answers in a
  row reporting zero cached tokens), or whose first token came slower than ``slow_first_token``,
  moves one place along the ranking. After a whole round of moves without a hit it stays where it is
  (a prompt too short for any provider's cache must not wander forever);
- its requests in flight per provider in this worker: past ``spill_at`` x ``capacity`` (the host's
  share; workers split it) the next request spills to the next provider of the ranking, and only it:
  no herd moves with it.

Pure: no clocks, no I/O; bounded (``table_size`` prefixes, the least recently placed forgotten first).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# What ``ended`` says of an answer (gateway.metrics.catalogue.PREFIX_EVENTS, by index).
PLACED, SPILLED, HIT, MISS, MOVED = range(5)


class Ranked(Protocol):
    provider: int


class PrefixEntry:
    """What one worker knows about one prefix."""

    __slots__ = ("key", "offset", "misses", "moves", "inflight")

    def __init__(self, key: bytes) -> None:
        self.key = key  # the 8-byte prefix hash (gateway.request.prefix)
        self.offset = 0  # places moved along the ranking by misses and slow first tokens
        self.misses = 0  # answers in a row on its place that reported no cached tokens
        self.moves = 0  # moves since its last cache hit
        self.inflight: dict[int, int] = {}  # provider -> its requests in flight from this worker


class Placement:
    """One request's prefix placement: the entry, the provider it went to, and how far it spilled
    (0: the prefix's place; 1: the next provider; ...). The request's record holds it until its end."""

    __slots__ = ("entry", "provider", "spilled", "ring", "counted")

    def __init__(self, entry: PrefixEntry, provider: int, spilled: int, ring: int, counted: int = 0) -> None:
        self.entry = entry
        self.provider = provider
        self.spilled = spilled
        self.ring = ring  # usable providers in the ranking when placed
        self.counted = counted  # where its in-flight count went (the shared table's word; -1: not counted)


class PrefixTable:
    """Per-worker prefix placements (see the module docstring)."""

    __slots__ = ("_entries", "_size", "spill_limit", "miss_limit", "slow_first_token_s", "placed", "moved")

    def __init__(self, size: int, spill_limit: int, miss_limit: int, slow_first_token_s: float | None) -> None:
        self._entries: dict[bytes, PrefixEntry] = {}
        self._size = size
        self.spill_limit = max(1, spill_limit)  # a prefix's requests in flight per provider in this worker
        self.miss_limit = miss_limit
        self.slow_first_token_s = slow_first_token_s
        self.placed: Placement | None = None  # the latest placement (read by the proxy right after routing)
        self.moved = 0  # prefixes moved along their ranking (misses, slow first tokens): a metric

    def __len__(self) -> int:
        return len(self._entries)

    def entry(self, key: bytes) -> PrefixEntry:
        """The prefix's entry (a new one at place 0), now the most recently used."""
        entries = self._entries
        entry = entries.pop(key, None)
        if entry is None:
            entry = PrefixEntry(key)
            if len(entries) >= self._size:
                del entries[next(iter(entries))]  # the least recently placed
        entries[key] = entry
        return entry

    def place(self, entry: PrefixEntry, ranked: Sequence[Ranked]) -> int:
        """The index in ``ranked`` (the group's usable options, best first) the prefix's next request
        goes to: its place, or past it while the prefix's in-flight requests fill a provider's share.
        Counts the request in flight there (``ended`` takes it back)."""
        count = len(ranked)
        start = entry.offset % count
        inflight = entry.inflight
        limit = self.spill_limit
        chosen = start
        fewest = None
        for step in range(count):
            index = start + step
            if index >= count:
                index -= count
            load = inflight.get(ranked[index].provider, 0)
            if load < limit:
                chosen = index
                break
            if fewest is None or load < fewest:
                fewest, chosen = load, index
        provider = ranked[chosen].provider
        counted = self._enter(entry, provider)
        spilled = chosen - start if chosen >= start else chosen + count - start
        self.placed = Placement(entry, provider, spilled, count, counted)
        return chosen

    def _enter(self, entry: PrefixEntry, provider: int) -> int:
        """Count the prefix's new request in flight on ``provider``; says where (``Placement.counted``)."""
        inflight = entry.inflight
        inflight[provider] = inflight.get(provider, 0) + 1
        return 0

    def _leave(self, placement: Placement) -> None:
        """The placed request is over: its in-flight count goes back."""
        inflight = placement.entry.inflight
        provider = placement.provider
        left = inflight.get(provider, 0) - 1
        if left > 0:
            inflight[provider] = left
        else:
            inflight.pop(provider, None)

    def _fresh(self, entry: PrefixEntry) -> None:
        """Bring the entry up to date before feedback (the shared table reads the host's cells)."""

    def _hit(self, entry: PrefixEntry) -> None:
        entry.misses = entry.moves = 0

    def _missed(self, entry: PrefixEntry) -> bool:
        """One more miss in a row; whether the run reached ``misses``."""
        entry.misses += 1
        return entry.misses >= self.miss_limit

    def ended(self, placement: Placement, served_by: int, cached_tokens: int | None,
              first_token_s: float | None) -> tuple[int, bool] | None:
        """The request is over: its in-flight count goes back; an answer from the prefix's own place
        confirms it (cached tokens reported) or counts against it (none, or a slow first token). Says
        what it learnt: (HIT or MISS or MOVED, whether the prefix moved), None when nothing."""
        self._leave(placement)
        if placement.spilled or served_by != placement.provider:
            return None  # served elsewhere than its place: says nothing about the place's cache
        slow = self.slow_first_token_s
        slow = slow is not None and first_token_s is not None and first_token_s > slow
        if not slow and cached_tokens is None:  # the provider reports nothing of its cache
            return None
        entry = placement.entry
        self._fresh(entry)
        if slow:
            return MOVED, self._move(entry, placement.ring)
        if cached_tokens > 0:  # type: ignore[operator]
            self._hit(entry)
            return HIT, False
        return MISS, self._missed(entry) and self._move(entry, placement.ring)

    def _move(self, entry: PrefixEntry, ring: int) -> bool:
        entry.misses = 0
        if entry.moves >= ring:  # a whole round without a hit: it stays
            return False
        entry.offset += 1
        entry.moves += 1
        self.moved += 1
        return True
