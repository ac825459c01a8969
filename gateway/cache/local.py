"""A worker's own copies of recent cache entries (``cache.local``): a hit from here takes no Valkey round
trip. Bounded in bytes (least recently used out first) and in time: a copy lives until its entry's own
expiry in Valkey or ``ttl`` after it was copied, whichever comes first. Entries never change while they
live (the cache is exact and nothing rewrites a key), so a copy is the entry, kept ready to answer with
from its first hit on (``ReadyAnswer``: its head template and framed body made once, not per hit; a copy
no request reads again costs its miss nothing of it). Pure: the clock is handed in.
"""

from __future__ import annotations

from collections import OrderedDict

from gateway.cache.entry import CacheEntry, ReadyAnswer


class LocalEntries:
    """Key -> (expires at: monotonic, and the entry's own in epoch seconds; the entry, made a ready answer
    by its first hit; size), in least-recently-used order."""

    __slots__ = ("max_bytes", "ttl_s", "size", "_entries")

    def __init__(self, max_bytes: int, ttl_s: float) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.size = 0
        # An OrderedDict: the oldest leaves in O(1) (a dict's front fills with deleted slots when popped there).
        self._entries: OrderedDict[bytes, tuple[float, float, CacheEntry | ReadyAnswer, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes, now: float, wall: float) -> ReadyAnswer | None:
        """The live copy of ``key`` (``now``: monotonic seconds; ``wall``: epoch seconds, the entry's clock)."""
        entries = self._entries
        found = entries.get(key)
        if found is None:
            return None
        expires, expires_at, ready, size = found
        if now >= expires or (expires_at and wall >= expires_at):
            del entries[key]
            self.size -= size
            return None
        if ready.__class__ is not ReadyAnswer:  # its first hit (a copy nobody reads again costs no framing)
            ready = ReadyAnswer(ready)  # type: ignore[arg-type]
            entries[key] = (expires, expires_at, ready, size)
        entries.move_to_end(key)  # the most recently used goes last
        return ready  # type: ignore[return-value]

    def put(self, key: bytes, entry: CacheEntry, size: int, now: float) -> None:
        """Keep a copy (one larger than the whole budget is not kept); the least recently used go first."""
        if size > self.max_bytes:
            return
        entries = self._entries
        old = entries.pop(key, None)
        if old is not None:
            self.size -= old[3]
        while entries and self.size + size > self.max_bytes:
            self.size -= entries.popitem(last=False)[1][3]
        entries[key] = (now + self.ttl_s, entry.expires_at, entry, size)
        self.size += size
