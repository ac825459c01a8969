"""A worker's own copies of recent cache entries (``cache.local``): a hit from here takes no Valkey round
trip. Bounded in bytes (least recently used out first) and in time: a copy lives until its entry's own
expiry in Valkey or ``ttl`` after it was copied, whichever comes first. Entries never change while they
live (the cache is exact and nothing rewrites a key), so a copy is the entry. Pure: the clock is handed in.
"""

from __future__ import annotations

from gateway.cache.entry import CacheEntry


class LocalEntries:
    """Key -> (expires at, entry, size), in least-recently-used order."""

    __slots__ = ("max_bytes", "ttl_s", "size", "_entries")

    def __init__(self, max_bytes: int, ttl_s: float) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.size = 0
        self._entries: dict[bytes, tuple[float, CacheEntry, int]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes, now: float, wall: float) -> CacheEntry | None:
        """The live copy of ``key`` (``now``: monotonic seconds; ``wall``: epoch seconds, the entry's clock)."""
        entries = self._entries
        found = entries.get(key)
        if found is None:
            return None
        expires, entry, size = found
        if now >= expires or (entry.expires_at and wall >= entry.expires_at):
            del entries[key]
            self.size -= size
            return None
        entries[key] = entries.pop(key)  # the most recently used goes last
        return entry

    def put(self, key: bytes, entry: CacheEntry, size: int, now: float) -> None:
        """Keep a copy (one larger than the whole budget is not kept); the least recently used go first."""
        if size > self.max_bytes:
            return
        entries = self._entries
        old = entries.pop(key, None)
        if old is not None:
            self.size -= old[2]
        while entries and self.size + size > self.max_bytes:
            oldest = next(iter(entries))
            self.size -= entries.pop(oldest)[2]
        entries[key] = (now + self.ttl_s, entry, size)
        self.size += size
