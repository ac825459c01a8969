"""The host's index of response-cache keys known to exist, and the host's in-flight leaders: shared memory.

Why (docs/cache.md, "The host index"): a cache miss used to wait for one Valkey round trip (the lookup
and coalescing claim) before it could go upstream. With this index a worker tells a key that nobody in
the fleet stored or claimed ("unknown") from one that somebody may have ("known") by reading memory, and
an unknown key leads at once, awaiting nothing.

Two tables in one anonymous ``MAP_SHARED`` mapping, created by the supervisor before the first fork:

- **index** (one writer: the supervisor's follower of the cache's announcements): buckets of 8 slots; a
  slot is a key's 8-byte fingerprint and the CLOCK_MONOTONIC second it is known until (a float64). A
  bucket that had no free slot for a key keeps, in its ``overflow`` word, the latest expiry of the keys it
  dropped: until then every key of that bucket counts as known (the safe side). The header's ``valid_until``
  says until when the whole index is authoritative (the follower is subscribed, has scanned the entries
  that existed before, and heard from Valkey lately); past it nothing is "unknown".
- **leaders** (one writer per cell): per in-flight slot, one 8-byte cell per worker row: the fingerprint
  of the key that worker leads upstream in that slot (0: none). Slot-major, so a reader compares one
  slot's cells of every worker in one C-level slice compare.

Consistency without locks: a slot is written expiry first, fingerprint second, and an expiry only grows
while its fingerprint stays; every torn or stale read errs to one of two sides, both correct: a false
"known" costs the awaited lookup of before; a false "unknown" costs one duplicate upstream call.

Layout (little-endian)::

    header        64 B                   magic, version, buckets, leader slots, workers | valid_until (f64)
    fingerprints  buckets * 8 * 8 B      per slot: the fingerprint (0: empty)
    expiries      buckets * 8 * 8 B      per slot: known until (f64, CLOCK_MONOTONIC seconds)
    overflow      buckets * 8 B          per bucket: keys dropped for lack of room are known until (f64)
    leaders       leader slots * workers * 8 B
"""

from __future__ import annotations

import mmap
import struct

MAGIC = int.from_bytes(b"GGCACHIX", "little")
LAYOUT_VERSION = 1
SLOTS_PER_BUCKET = 8
HEADER_BYTES = 64
LEADER_SLOTS = 16384  # host in-flight slots: two keys in one slot only cost the awaited path
_SLOT_MASK = LEADER_SLOTS - 1
# What ``CacheIndex.take`` found when it did not take a cell (a cell's offset, >= 0, when it did).
KNOWN, TAKEN, HOSTED = -1, -2, -3
MIN_CAPACITY, MAX_CAPACITY = 1024, 64 * 1024 * 1024
H_MAGIC, H_VERSION, H_BUCKETS, H_LEADER_SLOTS, H_WORKERS, H_VALID_UNTIL, H_DROPPED = 0, 1, 2, 3, 4, 5, 6
_ZERO = bytes(8)
_ONE = b"\x01" + bytes(7)
_high = struct.Struct("<Q").unpack_from


class KeyPlace:
    """Where one cache key lives in both tables (pure arithmetic from its 128-bit digest)."""

    __slots__ = ("fingerprint", "bucket", "slot")

    def __init__(self, fingerprint: bytes, bucket: int, slot: int) -> None:
        self.fingerprint = fingerprint  # 8 bytes, never all zero
        self.bucket = bucket
        self.slot = slot


def place_of(digest: bytes, buckets: int) -> KeyPlace:
    """The place of a key whose 128-bit digest is ``digest`` (16 bytes; ``buckets`` a power of two): the
    first 8 bytes choose the bucket and the in-flight slot, the last 8 are the fingerprint."""
    high = _high(digest, 0)[0]
    fingerprint = digest[8:16]
    return KeyPlace(_ONE if fingerprint == _ZERO else fingerprint, high & (buckets - 1), (high >> 40) & _SLOT_MASK)


class IndexLayout:
    """Byte offsets from the capacity (keys) and the worker rows: the same in every process."""

    __slots__ = ("buckets", "workers", "fingerprints", "expiries", "overflow", "leaders", "total")

    def __init__(self, capacity: int, workers: int) -> None:
        if not MIN_CAPACITY <= capacity <= MAX_CAPACITY:
            raise ValueError(f"capacity {capacity}: must be between {MIN_CAPACITY} and {MAX_CAPACITY}")
        if not 1 <= workers <= 4096:
            raise ValueError(f"workers {workers}: must be between 1 and 4096")
        buckets = 1
        while buckets * SLOTS_PER_BUCKET < capacity * 2:  # at most half full at capacity: few overflows
            buckets *= 2
        self.buckets, self.workers = buckets, workers
        self.fingerprints = HEADER_BYTES
        self.expiries = self.fingerprints + buckets * SLOTS_PER_BUCKET * 8
        self.overflow = self.expiries + buckets * SLOTS_PER_BUCKET * 8
        self.leaders = self.overflow + buckets * 8
        self.total = self.leaders + LEADER_SLOTS * workers * 8


class CacheIndex:
    """Both tables, as every process maps them; the readers' side (workers)."""

    def __init__(self, mapping: mmap.mmap, layout: IndexLayout) -> None:
        self.map = mapping
        self.layout = layout
        self.buckets = layout.buckets
        self.workers = layout.workers
        view = memoryview(mapping)
        self.words = view[:HEADER_BYTES].cast("q")
        self.header = view[:HEADER_BYTES].cast("d")  # H_VALID_UNTIL as a float
        self.expiries = view[layout.expiries:layout.overflow].cast("d")
        self.overflow = view[layout.overflow:layout.leaders].cast("d")
        self._fingerprints = layout.fingerprints
        self._leaders = layout.leaders
        self._row = layout.workers * 8
        self._mask = layout.buckets - 1
        self.no_leaders = bytes(self._row)

    @classmethod
    def create(cls, capacity: int, workers: int) -> CacheIndex:
        layout = IndexLayout(capacity, workers)
        mapping = mmap.mmap(-1, layout.total, flags=mmap.MAP_SHARED)
        index = cls(mapping, layout)
        words = index.words
        words[H_MAGIC], words[H_VERSION], words[H_BUCKETS] = MAGIC, LAYOUT_VERSION, layout.buckets
        words[H_LEADER_SLOTS], words[H_WORKERS] = LEADER_SLOTS, workers
        return index

    # -- a worker's miss, in one call (the request path: every attribute read once)
    def take(self, digest: bytes, worker: int, now: float) -> int:
        """For a key nobody in the fleet is known to have (``digest``: its 16 bytes): take ``worker``'s
        in-flight cell for it and return the cell's offset (release it with ``release``). Else ``KNOWN``
        (stored or claimed somewhere, or its bucket dropped keys; an ambiguous read counts as known),
        ``TAKEN`` (its in-flight slot holds another key, or this worker's own) or ``HOSTED`` (another
        worker of this host leads it). The index's authority is the caller's to check."""
        high = _high(digest, 0)[0]
        fingerprint = digest[8:16]
        if fingerprint == _ZERO:
            fingerprint = _ONE
        bucket = high & self._mask
        base = self._fingerprints + (bucket << 6)
        mapping = self.map
        found = mapping.find(fingerprint, base, base + 64)
        if found >= 0:
            if (found - base) & 7 or self.expiries[(bucket << 3) + ((found - base) >> 3)] > now:
                return KNOWN
        elif self.overflow[bucket] > now:
            return KNOWN
        row = self._row
        start = self._leaders + ((high >> 40) & _SLOT_MASK) * row
        if mapping[start:start + row] != self.no_leaders:
            return HOSTED if self._elsewhere(mapping[start:start + row], fingerprint, worker) else TAKEN
        cell = start + (worker << 3)
        mapping[cell:cell + 8] = fingerprint
        cells = mapping[start:start + row]
        if cells.count(fingerprint) == 1:
            return cell
        # Another worker took it at this very instant: the lowest row leads, the others wait for it.
        rows = [at >> 3 for at in range(0, row, 8) if cells[at:at + 8] == fingerprint]
        if rows[0] == worker:
            return cell
        mapping[cell:cell + 8] = _ZERO
        return HOSTED

    def known(self, digest: bytes, now: float) -> bool:
        """The key of ``digest`` was stored or claimed somewhere (or may have been: ``take``'s KNOWN)."""
        return self.knows(place_of(digest, self.buckets), now)

    def release(self, cell: int) -> None:
        """A cell ``take`` returned is empty again (its worker's: the one writer)."""
        self.map[cell:cell + 8] = _ZERO

    def release_all(self, cells: list[int]) -> None:
        """``release`` of each of ``cells``."""
        mapping = self.map
        for cell in cells:
            mapping[cell:cell + 8] = _ZERO

    def hosted(self, digest: bytes, worker: int) -> bool:
        """Another worker than ``worker`` of this host leads the key of ``digest`` now."""
        place = place_of(digest, self.buckets)
        return self._elsewhere(self.leaders(place.slot), place.fingerprint, worker)

    @staticmethod
    def _elsewhere(cells: bytes, fingerprint: bytes, worker: int) -> bool:
        return any(cells[at:at + 8] == fingerprint for at in range(0, len(cells), 8) if at >> 3 != worker)

    # -- readers
    def place(self, digest: bytes) -> KeyPlace:
        return place_of(digest, self.buckets)

    def authoritative(self, now: float) -> bool:
        """The follower is subscribed, has scanned, and heard from Valkey lately."""
        return self.header[H_VALID_UNTIL] > now

    def knows(self, place: KeyPlace, now: float) -> bool:
        """The key was stored or claimed somewhere (or its bucket dropped keys, or its fingerprint's bytes
        straddle two slots: the safe side): it may exist."""
        base = self._fingerprints + (place.bucket << 6)
        found = self.map.find(place.fingerprint, base, base + 64)
        if found >= 0:
            return bool((found - base) & 7) or self.expiries[(place.bucket << 3) + ((found - base) >> 3)] > now
        return self.overflow[place.bucket] > now

    def leaders(self, slot: int) -> bytes:
        """One in-flight slot's cells, of every worker row (8 bytes each; all zero: nobody leads there)."""
        start = self._leaders + slot * self._row
        return self.map[start:start + self._row]

    def cell_of(self, slot: int, worker: int) -> int:
        return self._leaders + slot * self._row + worker * 8

    # -- one worker's own cells (the single writer of its column)
    def lead(self, slot: int, worker: int, fingerprint: bytes) -> None:
        start = self.cell_of(slot, worker)
        self.map[start:start + 8] = fingerprint

    def unlead(self, slot: int, worker: int) -> None:
        start = self.cell_of(slot, worker)
        self.map[start:start + 8] = _ZERO

    def clear_worker(self, worker: int) -> None:
        """A worker row's cells all empty (a new worker of that row starts clean; a dead one held some)."""
        for slot in range(LEADER_SLOTS):
            start = self.cell_of(slot, worker)
            self.map[start:start + 8] = _ZERO

    def close(self) -> None:
        for view in (self.words, self.header, self.expiries, self.overflow):
            view.release()
        self.map.close()


class CacheIndexWriter:
    """The index's one writer (the supervisor's follower)."""

    def __init__(self, index: CacheIndex) -> None:
        self.index = index
        self._fingerprints = index.layout.fingerprints
        self.dropped = 0  # keys a full bucket had no slot for (known by its overflow word instead)

    @staticmethod
    def dropped_of(index: CacheIndex) -> int:
        return index.words[H_DROPPED]

    def set_valid_until(self, until: float) -> None:
        """Authoritative until ``until`` (CLOCK_MONOTONIC seconds; 0: not authoritative)."""
        self.index.header[H_VALID_UNTIL] = until

    def note(self, place: KeyPlace, known_until: float, now: float) -> None:
        """The key exists or is claimed until ``known_until``: its slot (the one it has, else a free or
        expired one) says so; a bucket without room extends its overflow word instead."""
        index = self.index
        mapping, expiries = index.map, index.expiries
        base = self._fingerprints + place.bucket * 64
        first = place.bucket * 8
        fingerprint = place.fingerprint
        # Its own slot: a match on a slot's boundary (one found across two slots is no match).
        found = mapping.find(fingerprint, base, base + 64)
        while found >= 0 and (found - base) & 7:
            found = mapping.find(fingerprint, found + 1, base + 64)
        if found >= 0:
            i = first + ((found - base) >> 3)
            if expiries[i] < known_until:
                expiries[i] = known_until
            return
        # Else the first free one: never used (its expiry still 0) or expired (a slot's expiry is written
        # before its fingerprint, and only here, so an empty fingerprint always has an expiry of 0).
        free = -1
        for i, expiry in enumerate(expiries[first:first + SLOTS_PER_BUCKET].tolist()):
            if expiry <= now:
                free = i
                break
        if free < 0:
            self.dropped += 1
            index.words[H_DROPPED] = self.dropped
            if index.overflow[place.bucket] < known_until:
                index.overflow[place.bucket] = known_until
            return
        expiries[first + free] = known_until  # the expiry first: a reader matching the print sees it
        start = base + free * 8
        mapping[start:start + 8] = place.fingerprint
