"""The host's shared-memory segment: fixed layout, versioned header, created before fork.

The supervisor calls :meth:`Segment.create` *before* forking; the anonymous ``MAP_SHARED`` mapping is
inherited by every child (workers, health process), so nothing is ever looked up by name. Layout, all
offsets 64-byte aligned, all cells little-endian int64::

    header      512 B   magic, layout version, sizes, region offsets, rows in use, extra-region table
    directory   64 B + max_endpoints * 256 B    endpoint id -> slot (writer: supervisor, seqlocked)
    rows        max_workers * (1 + max_endpoints) * 64 B   one row per worker (writer: that worker)
    health      64 B + max_endpoints * 128 B    verdict per slot (writer: the health process, seqlocked)
    extras      caller-sized opaque regions (e.g. the session-affinity table)

The per-row and per-record word layouts live with their single writers in :mod:`shm.counters`.
"""

from __future__ import annotations

import mmap
from array import array
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from shm.seqlock import read_record, write_record

MAGIC = int.from_bytes(b"GRIDGSHM", "little")
LAYOUT_VERSION = 2  # 2: a 512-byte header with room for 8 extra regions (1: 256 bytes, 4)
LINE_BYTES = 64
WORD_BYTES = 8
LINE_WORDS = LINE_BYTES // WORD_BYTES

HEADER_BYTES = 512
MAX_WORKERS_LIMIT = 1024
MAX_ENDPOINTS_LIMIT = 65_536
MAX_EXTRA_REGIONS = 8
EXTRA_NAME_BYTES = 16

# Header word indexes.
H_MAGIC, H_VERSION, H_TOTAL, H_MAX_WORKERS, H_MAX_ENDPOINTS = 0, 1, 2, 3, 4
H_DIRECTORY, H_ROWS, H_ROW_STRIDE, H_HEALTH, H_EXTRA_COUNT, H_ROWS_IN_USE = 5, 6, 7, 8, 9, 10
H_EXTRAS = 16  # then MAX_EXTRA_REGIONS entries of 4 words: name (2 words), offset, size
assert H_EXTRAS + 4 * MAX_EXTRA_REGIONS <= HEADER_BYTES // WORD_BYTES, "the extra-region table overflows the header"

# Directory: one header line [seq, epoch, in_use_count, ...] then one 256-byte entry per slot.
DIRECTORY_ENTRY_WORDS = 32
D_GENERATION, D_IN_USE, D_FREED_EPOCH, D_ID_LEN, D_ID = 0, 1, 2, 3, 4
MAX_ENDPOINT_ID_BYTES = (DIRECTORY_ENTRY_WORDS - D_ID) * WORD_BYTES  # 224

ROW_HEADER_WORDS = LINE_WORDS  # heartbeat, status, pid, ... (see shm.counters)
SLOT_LINE_WORDS = LINE_WORDS  # one cache line of counters per (worker, endpoint slot)
HEALTH_RECORD_WORDS = 16  # seq + 15 data words, two cache lines


class ShmCapacityError(ValueError):
    """A fixed capacity of the segment would be exceeded; ``limit`` names it."""

    def __init__(self, limit: str, value: int | str, maximum: int) -> None:
        super().__init__(f"shared memory capacity exceeded: {limit}={maximum}, needed {value}")
        self.limit = limit
        self.value = value
        self.maximum = maximum


def _align(n: int, to: int = LINE_BYTES) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True, slots=True)
class Layout:
    """Byte offsets and sizes; pure arithmetic so it is the same in every process."""

    max_workers: int
    max_endpoints: int
    directory_offset: int
    rows_offset: int
    row_stride: int
    health_offset: int
    extras: tuple[tuple[str, int, int], ...]  # (name, offset, size)
    total_size: int

    @classmethod
    def compute(cls, max_workers: int, max_endpoints: int, extra_regions: Mapping[str, int]) -> Layout:
        if not 1 <= max_workers <= MAX_WORKERS_LIMIT:
            raise ShmCapacityError("max_workers", max_workers, MAX_WORKERS_LIMIT)
        if not 1 <= max_endpoints <= MAX_ENDPOINTS_LIMIT:
            raise ShmCapacityError("max_endpoints", max_endpoints, MAX_ENDPOINTS_LIMIT)
        if len(extra_regions) > MAX_EXTRA_REGIONS:
            raise ShmCapacityError("extra_regions", len(extra_regions), MAX_EXTRA_REGIONS)
        directory = HEADER_BYTES
        rows = _align(directory + LINE_BYTES + max_endpoints * DIRECTORY_ENTRY_WORDS * WORD_BYTES)
        row_stride = (ROW_HEADER_WORDS + max_endpoints * SLOT_LINE_WORDS) * WORD_BYTES
        health = rows + max_workers * row_stride
        cursor = _align(health + LINE_BYTES + max_endpoints * HEALTH_RECORD_WORDS * WORD_BYTES)
        extras = []
        for name, size in extra_regions.items():
            if len(name.encode()) > EXTRA_NAME_BYTES or not name:
                raise ShmCapacityError("extra_region_name_bytes", name, EXTRA_NAME_BYTES)
            if size < 0:
                raise ValueError(f"extra region {name!r} has a negative size")
            extras.append((name, cursor, size))
            cursor = _align(cursor + size)
        total = _align(cursor, mmap.PAGESIZE)
        return cls(max_workers, max_endpoints, directory, rows, row_stride, health, tuple(extras), total)

    def header_words(self) -> list[int]:
        words = [0] * (HEADER_BYTES // WORD_BYTES)
        words[H_MAGIC], words[H_VERSION], words[H_TOTAL] = MAGIC, LAYOUT_VERSION, self.total_size
        words[H_MAX_WORKERS], words[H_MAX_ENDPOINTS] = self.max_workers, self.max_endpoints
        words[H_DIRECTORY], words[H_ROWS], words[H_ROW_STRIDE] = self.directory_offset, self.rows_offset, self.row_stride
        words[H_HEALTH], words[H_EXTRA_COUNT] = self.health_offset, len(self.extras)
        for i, (name, offset, size) in enumerate(self.extras):
            raw = name.encode().ljust(EXTRA_NAME_BYTES, b"\0")
            base = H_EXTRAS + 4 * i
            words[base] = int.from_bytes(raw[:8], "little")
            words[base + 1] = int.from_bytes(raw[8:], "little")
            words[base + 2], words[base + 3] = offset, size
        return words

    # Word indexes into the segment-wide int64 view.
    def row_word(self, worker: int) -> int:
        return (self.rows_offset + worker * self.row_stride) // WORD_BYTES

    def slot_line_word(self, worker: int, slot: int) -> int:
        return self.row_word(worker) + ROW_HEADER_WORDS + slot * SLOT_LINE_WORDS

    def health_header_word(self) -> int:
        return self.health_offset // WORD_BYTES

    def health_record_word(self, slot: int) -> int:
        return self.health_header_word() + LINE_WORDS + slot * HEALTH_RECORD_WORDS


@dataclass(frozen=True, slots=True)
class DirectoryEntry:
    endpoint_id: str
    slot: int
    generation: int  # bumped each time the slot is (re)assigned to an endpoint id


class SlotDirectory:
    """Stable endpoint id -> slot map. Written only by the supervisor; readers take seqlocked copies.

    A reload that keeps an endpoint id keeps its slot (and so its counters and health record).
    Removed ids free their slot; new ids take never-used slots first, then the slot freed longest ago,
    so the in-flight counts of a removed endpoint have the longest time to drain before reuse.
    """

    def __init__(self, words: memoryview, layout: Layout) -> None:
        self._words = words
        self._seq = layout.directory_offset // WORD_BYTES
        self._max = layout.max_endpoints
        self._length = LINE_WORDS - 1 + self._max * DIRECTORY_ENTRY_WORDS

    def _read(self) -> list[int]:
        return read_record(self._words, self._seq, self._length)

    def entries(self) -> list[DirectoryEntry]:
        image = self._read()
        found = []
        for slot in range(self._max):
            base = LINE_WORDS - 1 + slot * DIRECTORY_ENTRY_WORDS
            if image[base + D_IN_USE]:
                length = image[base + D_ID_LEN]
                raw = array("q", image[base + D_ID : base + DIRECTORY_ENTRY_WORDS]).tobytes()[:length]
                found.append(DirectoryEntry(raw.decode(), slot, image[base + D_GENERATION]))
        return found

    def slot_map(self) -> dict[str, int]:
        """endpoint id -> slot, for building balancers after (re)load."""
        return {entry.endpoint_id: entry.slot for entry in self.entries()}

    def assign(self, endpoint_ids: Iterable[str]) -> dict[str, int]:
        """Supervisor only: make the directory hold exactly ``endpoint_ids``; return id -> slot.

        Raises :class:`ShmCapacityError` (and changes nothing) if they do not fit.
        """
        wanted = list(dict.fromkeys(endpoint_ids))
        for endpoint_id in wanted:
            if len(endpoint_id.encode()) > MAX_ENDPOINT_ID_BYTES:
                raise ShmCapacityError("endpoint_id_bytes", endpoint_id, MAX_ENDPOINT_ID_BYTES)
        if len(wanted) > self._max:
            raise ShmCapacityError("max_endpoints", len(wanted), self._max)
        image = self._read()
        epoch = image[0] + 1
        header = LINE_WORDS - 1

        def base(slot: int) -> int:
            return header + slot * DIRECTORY_ENTRY_WORDS

        current = {e.endpoint_id: e.slot for e in self.entries()}
        keep = {i: s for i, s in current.items() if i in wanted}
        for endpoint_id, slot in current.items():
            if endpoint_id not in keep:
                image[base(slot) + D_IN_USE] = 0
                image[base(slot) + D_FREED_EPOCH] = epoch
        free = [s for s in range(self._max) if not image[base(s) + D_IN_USE]]
        # Never-used slots (generation 0) first, then the one freed longest ago.
        free.sort(key=lambda s: (image[base(s) + D_GENERATION] > 0, image[base(s) + D_FREED_EPOCH], s))
        result = dict(keep)
        for endpoint_id in wanted:
            if endpoint_id in result:
                continue
            slot = free.pop(0)
            raw = endpoint_id.encode()
            b = base(slot)
            image[b + D_GENERATION] += 1
            image[b + D_IN_USE] = 1
            image[b + D_ID_LEN] = len(raw)
            padded = raw.ljust(MAX_ENDPOINT_ID_BYTES, b"\0")
            image[b + D_ID : b + DIRECTORY_ENTRY_WORDS] = array("q", padded).tolist()
            result[endpoint_id] = slot
        image[0] = epoch
        image[1] = len(result)
        write_record(self._words, self._seq, image)
        return result


class Segment:
    """One anonymous shared mapping plus typed views over its regions."""

    def __init__(self, buffer: memoryview, layout: Layout, owner: mmap.mmap | None = None) -> None:
        self._mmap = owner
        self.buffer = buffer
        self.words = buffer.cast("q")
        self.layout = layout
        self.directory = SlotDirectory(self.words, layout)
        self._extras = {name: (offset, size) for name, offset, size in layout.extras}

    @classmethod
    def create(cls, max_workers: int, max_endpoints: int, extra_regions: Mapping[str, int] | None = None) -> Segment:
        """Supervisor, before fork: map and initialise the segment (zeroed, header written)."""
        layout = Layout.compute(max_workers, max_endpoints, dict(extra_regions or {}))
        mapping = mmap.mmap(-1, layout.total_size, flags=mmap.MAP_SHARED)
        buffer = memoryview(mapping)
        words = buffer.cast("q")
        words[: HEADER_BYTES // WORD_BYTES] = array("q", layout.header_words())
        words.release()
        return cls(buffer, layout, mapping)

    @property
    def max_workers(self) -> int:
        return self.layout.max_workers

    @property
    def max_endpoints(self) -> int:
        return self.layout.max_endpoints

    def region(self, name: str) -> memoryview:
        """The opaque extra region ``name`` as bytes (``KeyError`` if it was not carved)."""
        offset, size = self._extras[name]
        return self.buffer[offset : offset + size]

    # -- worker rows: lifecycle owned by the supervisor ------------------------------------------
    def rows_in_use(self) -> int:
        """How many leading rows readers must sum (a high-water mark; reset rows read as zero)."""
        return self.words[H_ROWS_IN_USE]

    def claim_worker_row(self, worker: int) -> None:
        """Supervisor, before forking worker ``worker``: make sure readers include its row."""
        self._check_worker(worker)
        if self.words[H_ROWS_IN_USE] <= worker:
            self.words[H_ROWS_IN_USE] = worker + 1

    def reset_worker_row(self, worker: int) -> None:
        """Supervisor, after worker ``worker`` died and before replacing it: zero its whole row.

        The dead process was the row's only writer, so nothing races with this, and its in-flight
        counts stop inflating the totals the other workers balance on.
        """
        self._check_worker(worker)
        start = self.layout.rows_offset + worker * self.layout.row_stride
        self.buffer[start : start + self.layout.row_stride] = bytes(self.layout.row_stride)

    def _check_worker(self, worker: int) -> None:
        if not 0 <= worker < self.layout.max_workers:
            raise ShmCapacityError("max_workers", worker + 1, self.layout.max_workers)

    def close(self) -> None:
        """Release this process's views (the mapping lives until every process dropped it)."""
        self.words.release()
        self.buffer.release()
        if self._mmap is not None:
            self._mmap.close()
