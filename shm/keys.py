"""The host-local key table: SHA-256 digest -> an opaque record blob, in shared memory.

One writer (the supervisor's key follower), many readers (the workers), no locks. Created before
fork as its own anonymous ``MAP_SHARED`` mapping.

Layout (little-endian int64 words unless said otherwise)::

    header    128 B             magic, version, capacity, slots, heap bytes, seq, count, minute
    digests   slots * 32 B      the digest in each slot; an empty slot is 32 zero bytes
    meta      slots * 16 B      per slot: heap offset | length << 32 | chunks held << 48, version
    used      slots * 4 B       per slot: the Unix minute of its last use (int32, written by workers)
    heap      capacity * 512 B  record blobs, in 64-byte chunks (pages never written cost no memory)

Placement is cuckoo hashing with two choices and one digest per slot: a digest lives in the slot its
first 8 bytes name (modulo the slot count) or in the one its next 8 bytes name. A lookup is therefore
at most two 32-byte compares at computed offsets: no search, no loop. The writer keeps the table at
most 40 % full (2.5 slots per key of capacity), where a new digest finds a free slot, moving a few
others to their other choice, essentially always (:class:`KeyTableFull` after a bounded search).

Consistency: one seqlock word for the whole table. The writer makes it odd, changes one record
(a digest placed, moved or removed; a blob rewritten in place), then even again; a reader accepts what
it read only if the word was even and unchanged around it. A blob written to fresh heap space is
written before the seqlock goes odd (nothing points at it yet). Every change of a slot bumps its
version, which never goes back, so a reader may keep the record it decoded for ``(slot, version)``.

Growth: none. The capacity (``auth.key_table_capacity``) is fixed when the supervisor starts; a
digest past it, or a heap with no room for a blob, is a :class:`KeyTableFull` for that key alone
(the writer logs it; the keys already in the table keep working). A restart sizes it anew.

The ``used`` cells are the one exception to "one writer per cell": every worker may store the
current minute (which the supervisor publishes in the header) into a slot's cell, one aligned 4-byte
store. All writers store the same kind of value, no read-modify-write, so a race only decides which
of two current minutes lands; the supervisor reads them once a minute (``used_since``) and resets a
cell only when a digest enters or leaves its slot.
"""

from __future__ import annotations

import bisect
import mmap
import os
import struct
import time
from collections import deque

MAGIC = int.from_bytes(b"GGKEYTBL", "little")
LAYOUT_VERSION = 2
DIGEST_BYTES = 32
HEADER_BYTES = 128
META_WORDS = 2
SLOTS_PER_KEY = 2.5
CHUNK_BYTES = 64
HEAP_BYTES_PER_KEY = 512
MAX_BLOB_BYTES = 16 * 1024
MAX_CAPACITY = 10_000_000
MAX_PLACEMENT_VISITS = 4096  # slots a placement search may look at before the table counts as full
READ_TIMEOUT_S = 0.05

# Header word indexes.
H_MAGIC, H_VERSION, H_CAPACITY, H_SLOTS, H_HEAP, H_SEQ, H_COUNT, H_MINUTE = 0, 1, 2, 3, 4, 5, 6, 7

_EMPTY = bytes(DIGEST_BYTES)
_two_words = struct.Struct("<QQ").unpack_from


class KeyTableFull(Exception):
    """The table cannot take this record (no slot, or no heap room); the message says which."""


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class TableLayout:
    """Byte offsets, pure arithmetic from the capacity (the same in every process)."""

    __slots__ = ("capacity", "slots", "digests", "meta", "used", "heap", "heap_bytes", "total")

    def __init__(self, capacity: int) -> None:
        if not 1 <= capacity <= MAX_CAPACITY:
            raise ValueError(f"key table capacity must be 1..{MAX_CAPACITY}, got {capacity}")
        self.capacity = capacity
        self.slots = max(8, int(capacity * SLOTS_PER_KEY))
        self.digests = HEADER_BYTES
        self.meta = _align(self.digests + self.slots * DIGEST_BYTES, 64)
        self.used = _align(self.meta + self.slots * META_WORDS * 8, 64)
        self.heap = _align(self.used + self.slots * 4, 64)
        self.heap_bytes = _align(capacity * HEAP_BYTES_PER_KEY, CHUNK_BYTES)
        self.total = _align(self.heap + self.heap_bytes, mmap.PAGESIZE)


def candidate_slots(digest: bytes, slots: int) -> tuple[int, int]:
    """The two slots ``digest`` may live in."""
    first, second = _two_words(digest)
    return first % slots, second % slots


class KeyTable:
    """The mapping and its views; ``create`` it in the supervisor before forking."""

    def __init__(self, mapping: mmap.mmap, layout: TableLayout) -> None:
        self._map = mapping
        self.layout = layout
        # Public for a worker's lookup (gateway/keys/lookup.py), which reads ``words[H_SEQ]`` and
        # ``words[H_MINUTE]`` and stores ``used[slot]`` itself on the request path: a call fewer each.
        self.words = self._words = memoryview(mapping).cast("q")
        self.used = self._used = memoryview(mapping)[layout.used : layout.used + layout.slots * 4].cast("i")
        self._slots = layout.slots
        self._digests = layout.digests
        self._meta_word = layout.meta // 8

    @classmethod
    def create(cls, capacity: int) -> KeyTable:
        layout = TableLayout(capacity)
        mapping = mmap.mmap(-1, layout.total, flags=mmap.MAP_SHARED)
        words = memoryview(mapping).cast("q")
        words[H_MAGIC], words[H_VERSION], words[H_CAPACITY] = MAGIC, LAYOUT_VERSION, capacity
        words[H_SLOTS], words[H_HEAP] = layout.slots, layout.heap_bytes
        words.release()
        return cls(mapping, layout)

    def __len__(self) -> int:
        return self._words[H_COUNT]

    def minute(self) -> int:
        return self._words[H_MINUTE]

    def seq(self) -> int:
        """The seqlock word: odd while the writer changes a record, and never the same twice between
        changes. A reader that saw an even ``seq`` before a lookup may reuse that lookup's answer while
        ``seq`` still reads the same: nothing in the table changed."""
        return self._words[H_SEQ]

    # ------------------------------------------------------------------ readers (workers)

    def find(self, digest: bytes) -> tuple[int, int] | None:
        """``(slot, version)`` of ``digest``, or None when the table does not hold it.

        Straight-line: one unpack, at most two 32-byte compares, three word reads. Only a concurrent
        write (the seqlock moved) takes the retrying path."""
        words = self._words
        seq = words[H_SEQ]
        first, second = _two_words(digest)
        slots, mapping, base = self._slots, self._map, self._digests
        slot = first % slots
        at = base + slot * DIGEST_BYTES
        if mapping[at : at + DIGEST_BYTES] != digest:
            slot = second % slots
            at = base + slot * DIGEST_BYTES
            if mapping[at : at + DIGEST_BYTES] != digest:
                slot = -1
        found = None if slot < 0 else (slot, words[self._meta_word + slot * META_WORDS + 1])
        if seq & 1 or words[H_SEQ] != seq:
            return self._find_retrying(digest)
        return found

    def blob(self, slot: int, version: int) -> bytes | None:
        """A copy of the blob of ``slot`` if its version is still ``version``, else None (it changed:
        call ``find`` again)."""
        words, meta = self._words, self._meta_word + slot * META_WORDS
        deadline = 0.0
        while True:
            seq = words[H_SEQ]
            if not seq & 1:
                packed, current = words[meta], words[meta + 1]
                start = self.layout.heap + (packed & 0xFFFFFFFF)
                data = self._map[start : start + (packed >> 32 & 0xFFFF)]
                if words[H_SEQ] == seq:
                    return data if current == version else None
            deadline = _wait(deadline)

    def mark_used(self, slot: int) -> None:
        """Record that the key in ``slot`` was used this minute (one 4-byte store)."""
        self._used[slot] = self._words[H_MINUTE]

    def _find_retrying(self, digest: bytes) -> tuple[int, int] | None:
        words, meta = self._words, self._meta_word
        deadline = 0.0
        while True:
            seq = words[H_SEQ]
            if not seq & 1:
                found = None
                for slot in candidate_slots(digest, self._slots):
                    at = self._digests + slot * DIGEST_BYTES
                    if self._map[at : at + DIGEST_BYTES] == digest:
                        found = (slot, words[meta + slot * META_WORDS + 1])
                        break
                if words[H_SEQ] == seq:
                    return found
            deadline = _wait(deadline)

    # ------------------------------------------------------------------ supervisor side

    def used_since(self, minute: int) -> list[tuple[int, int]]:
        """``(slot, minute)`` of the slots last used at or after ``minute`` (the supervisor's
        once-a-minute scan: a few milliseconds for 100,000 keys)."""
        return [(slot, used) for slot, used in enumerate(self._used.tolist()) if used >= minute]

    def close(self) -> None:
        self._used.release()
        self._words.release()
        self._map.close()


class KeyTableWriter:
    """The one writer: the supervisor's follower. Holds no per-key state of its own: where a digest is,
    and which heap chunks a slot holds, are read back from the table (a 100,000-key table costs the
    supervisor no Python memory beyond the free-chunk list)."""

    def __init__(self, table: KeyTable) -> None:
        self.table = table
        layout = table.layout
        self._layout = layout
        self._words = table._words
        self._map = table._map
        self._meta_word = table._meta_word
        self._count = 0
        self._heap = _ChunkHeap(layout.heap_bytes // CHUNK_BYTES)
        # Puts and removes so far (a put refused as full counts too): readers of the whole table (the
        # budget gauge's scan) read it again only when this moved.
        self.changes = 0

    def __contains__(self, digest: bytes) -> bool:
        return self.slot_of(digest) is not None

    def __len__(self) -> int:
        return self._count

    def slot_of(self, digest: bytes) -> int | None:
        for slot in candidate_slots(digest, self._layout.slots):
            if self.digest_at(slot) == digest:
                return slot
        return None

    def digest_at(self, slot: int) -> bytes | None:
        at = self._layout.digests + slot * DIGEST_BYTES
        digest = self._map[at : at + DIGEST_BYTES]
        return None if digest == _EMPTY else digest

    def occupied(self, start: int = 0, stop: int | None = None) -> list[tuple[int, bytes]]:
        """``(slot, digest)`` of every digest in slots ``start`` to ``stop`` (default: the whole table; a
        scan, for full reloads and the budget gauge, which reads it a range at a time)."""
        size = DIGEST_BYTES
        stop = self._layout.slots if stop is None else min(stop, self._layout.slots)
        data = self._map[self._layout.digests + start * size : self._layout.digests + stop * size]
        return [(start + index, data[index * size : index * size + size]) for index in range(stop - start)
                if data[index * size : index * size + size] != _EMPTY]

    @property
    def slots(self) -> int:
        return self._layout.slots

    def blob_at(self, slot: int) -> bytes:
        """The blob of ``slot`` (the writer reads its own writes: no seqlock needed)."""
        offset, length, _ = self._block(slot)
        start = self._layout.heap + offset * CHUNK_BYTES
        return self._map[start : start + length]

    def heap_used_bytes(self) -> int:
        return self._layout.heap_bytes - self._heap.free_chunks() * CHUNK_BYTES

    def set_minute(self, minute: int) -> None:
        """Publish the current Unix minute: what workers store when they mark a key used."""
        self._words[H_MINUTE] = minute

    def put(self, digest: bytes, blob: bytes) -> int:
        """Insert or replace the record of ``digest``; returns its slot. Raises KeyTableFull (and
        changes nothing) when there is no slot or no heap room for it."""
        if len(digest) != DIGEST_BYTES or digest == _EMPTY:
            raise ValueError("a key table digest is 32 bytes, not all zero")
        if len(blob) > MAX_BLOB_BYTES:
            raise KeyTableFull(f"record of {len(blob)} bytes exceeds {MAX_BLOB_BYTES}")
        self.changes += 1
        chunks = max(1, -(-len(blob) // CHUNK_BYTES))
        slot = self.slot_of(digest)
        if slot is not None:
            offset, _, held = self._block(slot)
            if chunks <= held:
                self._rewrite_in_place(slot, offset, held, blob)
                return slot
        elif self._count >= self._layout.capacity:
            raise KeyTableFull(f"the table holds its capacity of {self._layout.capacity} keys "
                               "(auth.key_table_capacity)")
        path = None
        if slot is None:
            path = self._placement(digest)
            if path is None:
                raise KeyTableFull("no free slot within the placement search (auth.key_table_capacity)")
        offset = self._heap.allocate(chunks)
        if offset is None:
            raise KeyTableFull(f"no heap room for a record of {len(blob)} bytes ({self._layout.heap_bytes} "
                               "bytes for auth.key_table_capacity keys)")
        start = self._layout.heap + offset * CHUNK_BYTES
        self._map[start : start + len(blob)] = blob  # fresh space: nothing points at it yet
        if slot is not None:  # a bigger blob for a digest in place: point its slot at the new one
            previous, _, held = self._block(slot)
            self._set_meta(slot, offset, len(blob), chunks)
            self._heap.free(previous, held)
            return slot
        assert path is not None
        for source, target in zip(reversed(path[:-1]), reversed(path[1:]), strict=True):
            self._move(source, target)  # each move leaves every digest findable
        slot = path[0]
        self._place(slot, digest, offset, len(blob), chunks)
        return slot

    def remove(self, digest: bytes) -> bool:
        slot = self.slot_of(digest)
        if slot is None:
            return False
        offset, _, held = self._block(slot)
        words = self._words
        self.changes += 1
        self._count -= 1
        seq = _begin(words)
        self._write_digest(slot, _EMPTY)
        words[H_COUNT] = self._count
        self._bump(slot)
        _end(words, seq)
        self.table._used[slot] = 0
        self._heap.free(offset, held)
        return True

    # ------------------------------------------------------------------ placement

    def _placement(self, digest: bytes) -> list[int] | None:
        """Slots ``[s0, s1, .., sk]``: s0 is a choice of ``digest``, each next one the other choice of
        the digest in the one before, sk free. Breadth-first, so the path (the moves) is shortest."""
        slots = self._layout.slots
        parent: dict[int, int | None] = {}
        queue: deque[int] = deque()
        for start in candidate_slots(digest, slots):
            if start not in parent:
                parent[start] = None
                queue.append(start)
        while queue and len(parent) <= MAX_PLACEMENT_VISITS:
            slot = queue.popleft()
            occupant = self.digest_at(slot)
            if occupant is None:
                path = [slot]
                while (previous := parent[path[-1]]) is not None:
                    path.append(previous)
                return path[::-1]
            first, second = candidate_slots(occupant, slots)
            other = second if slot == first else first
            if other not in parent:
                parent[other] = slot
                queue.append(other)
        return None

    def _move(self, source: int, target: int) -> None:
        """Move the digest in ``source`` (with its blob pointer and last use) to the free ``target``."""
        digest = self.digest_at(source)
        assert digest is not None
        words, meta = self._words, self._meta_word
        used = self.table._used
        seq = _begin(words)
        words[meta + target * META_WORDS] = words[meta + source * META_WORDS]
        self._write_digest(target, digest)
        self._write_digest(source, _EMPTY)
        self._bump(target)
        self._bump(source)
        _end(words, seq)
        used[target], used[source] = used[source], 0

    def _place(self, slot: int, digest: bytes, offset: int, length: int, chunks: int) -> None:
        words = self._words
        self.table._used[slot] = 0
        self._count += 1
        seq = _begin(words)
        words[self._meta_word + slot * META_WORDS] = _pack(offset, length, chunks)
        self._write_digest(slot, digest)
        words[H_COUNT] = self._count
        self._bump(slot)
        _end(words, seq)

    def _block(self, slot: int) -> tuple[int, int, int]:
        """(first heap chunk, blob length, chunks held) of ``slot``."""
        packed = self._words[self._meta_word + slot * META_WORDS]
        return (packed & 0xFFFFFFFF) // CHUNK_BYTES, packed >> 32 & 0xFFFF, packed >> 48

    def _set_meta(self, slot: int, offset: int, length: int, chunks: int) -> None:
        words = self._words
        seq = _begin(words)
        words[self._meta_word + slot * META_WORDS] = _pack(offset, length, chunks)
        self._bump(slot)
        _end(words, seq)

    def _rewrite_in_place(self, slot: int, offset: int, chunks: int, blob: bytes) -> None:
        start = self._layout.heap + offset * CHUNK_BYTES
        words = self._words
        seq = _begin(words)
        self._map[start : start + len(blob)] = blob
        words[self._meta_word + slot * META_WORDS] = _pack(offset, len(blob), chunks)
        self._bump(slot)
        _end(words, seq)

    def _write_digest(self, slot: int, digest: bytes) -> None:
        at = self._layout.digests + slot * DIGEST_BYTES
        self._map[at : at + DIGEST_BYTES] = digest

    def _bump(self, slot: int) -> None:
        """A new version for ``slot`` (inside the odd phase); versions never go back, reuse included."""
        self._words[self._meta_word + slot * META_WORDS + 1] += 1


def _pack(offset: int, length: int, chunks: int) -> int:
    """A slot's meta word: heap byte offset (32 bits) | blob length (16) | chunks held (16)."""
    return offset * CHUNK_BYTES | length << 32 | chunks << 48


def _begin(words: memoryview) -> int:
    seq = words[H_SEQ]
    if seq & 1:  # a writer died mid-change: close its odd phase first
        seq += 1
    words[H_SEQ] = seq + 1
    return seq


def _end(words: memoryview, seq: int) -> None:
    words[H_SEQ] = seq + 2


def _wait(deadline: float) -> float:
    """Back off while the writer is mid-change. A reader must not hang its worker on a writer that
    died mid-change: past the budget it raises TimeoutError (the lookup then refuses the key)."""
    now = time.monotonic()
    if not deadline:
        return now + READ_TIMEOUT_S
    if now > deadline:
        raise TimeoutError("key table stayed mid-write past the read budget")
    os.sched_yield()
    return deadline


class _ChunkHeap:
    """The writer's map of free heap chunks: sorted, coalesced runs; first fit. Writer-side only."""

    def __init__(self, chunks: int) -> None:
        self._starts: list[int] = [0] if chunks else []
        self._lengths: dict[int, int] = {0: chunks} if chunks else {}

    def free_chunks(self) -> int:
        return sum(self._lengths.values())

    def allocate(self, chunks: int) -> int | None:
        """The first chunk of ``chunks`` free ones, or None. The last run (the never-used end of the
        heap, while there is one) is tried first, so a bulk load is O(1) per record."""
        starts = self._starts
        if starts and self._lengths[starts[-1]] >= chunks:
            return self._take(len(starts) - 1, chunks)
        for index, start in enumerate(starts):
            if self._lengths[start] >= chunks:
                return self._take(index, chunks)
        return None

    def _take(self, index: int, chunks: int) -> int:
        start = self._starts[index]
        length = self._lengths.pop(start)
        if length == chunks:
            del self._starts[index]
        else:
            self._starts[index] = start + chunks
            self._lengths[start + chunks] = length - chunks
        return start

    def free(self, start: int, chunks: int) -> None:
        index = bisect.bisect_left(self._starts, start)
        if index < len(self._starts) and self._starts[index] == start + chunks:  # merge with the next run
            chunks += self._lengths.pop(self._starts.pop(index))
        if index and (before := self._starts[index - 1]) + self._lengths[before] == start:
            self._lengths[before] += chunks
            return
        self._starts.insert(index, start)
        self._lengths[start] = chunks
