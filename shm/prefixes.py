"""Prefix affinity's cells shared by the workers of a host (docs/routing.md, "Prefix affinity").

Created by the supervisor before it forks (an extra region of the host segment). One row per worker
slot, ``slots`` cells per row, one writer per row (its worker). A prefix hash picks its slot
(``slot_of``); readers sum the cells of every row in use that hold the same prefix. A slot holds one
prefix per worker: a different prefix hashed to the same slot takes over that worker's cell (the
older one is forgotten there, it starts over at place 0 when it comes back). Storage only: the
meaning of the counts and the arithmetic live in gateway/routing/prefix_shared.py.

Layout: a 64-byte header (magic, layout version, slots, rows), then rows of ``slots`` cells of two
cache lines (16 little-endian int64 words)::

    0 seq          odd while the owner rewrites more than one word of the cell (a seqlock)
    1 key          the prefix hash (int64; 0: empty)
    2 moves        places this worker moved the prefix along its ranking (the host's offset is the sum)
    3 misses       this worker's misses in the current run
    4 run_offset   the host offset that run counts at
    5 run_hits     the host hit count that run counts after
    6 hits         this worker's cache hits of the prefix
    7 hit_offset   the host offset at this worker's latest hit
    8..15          requests in flight from this worker: (provider + 1) << 32 | count, one provider a word

A reader copies a cell's 16 words and keeps the copy only when ``seq`` was even and unchanged around
it; a single-word update (an in-flight count) is one aligned store, needing no seqlock.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable

LINE_WORDS = 8
CELL_WORDS = 16
HEADER_WORDS = LINE_WORDS
KEY, MOVES, MISSES, RUN_OFFSET, RUN_HITS, HITS, HIT_OFFSET = 1, 2, 3, 4, 5, 6, 7
INFLIGHT = 8  # the first of the in-flight words
INFLIGHT_WORDS = CELL_WORDS - INFLIGHT
PROVIDER_SHIFT = 32
COUNT_MASK = (1 << PROVIDER_SHIFT) - 1
_MAGIC = int.from_bytes(b"GGPREFX1", "little")
_LAYOUT_VERSION = 1
_ZERO_INFLIGHT = array("q", [0] * INFLIGHT_WORDS)


def key_word(key: bytes) -> int:
    """The 8-byte prefix hash as the int64 a cell stores (never 0: 0 marks an empty cell)."""
    return int.from_bytes(key, "little", signed=True) or 1


class PrefixCells:
    """A view over the prefix region: ``max_workers`` rows of ``slots`` cells (see the module docstring)."""

    __slots__ = ("slots", "max_workers", "words", "_row_words")

    @staticmethod
    def required_bytes(max_workers: int, slots: int) -> int:
        return (HEADER_WORDS + max_workers * slots * CELL_WORDS) * 8

    def __init__(self, buffer: memoryview, max_workers: int, slots: int) -> None:
        words = buffer.cast("B").cast("q")
        if len(words) < self.required_bytes(max_workers, slots) // 8:
            raise ValueError("prefix region too small for its rows")
        header = (_MAGIC, _LAYOUT_VERSION, slots, max_workers)
        current = tuple(words[0:4])
        if current == (0, 0, 0, 0):  # fresh zeroed mapping: the supervisor (or a private worker) writes it
            words[1], words[2], words[3] = _LAYOUT_VERSION, slots, max_workers
            words[0] = _MAGIC
        elif current != header:
            raise ValueError("shared memory does not hold a prefix table of this size")
        self.slots = slots
        self.max_workers = max_workers
        self.words = words
        self._row_words = slots * CELL_WORDS

    @classmethod
    def attach(cls, buffer: memoryview) -> PrefixCells:
        """The cells the supervisor laid out in ``buffer`` (their sizes read from its header)."""
        words = buffer.cast("B").cast("q")
        if words[0] != _MAGIC or words[1] != _LAYOUT_VERSION:
            raise ValueError("shared memory does not hold a prefix table")
        return cls(buffer, words[3], words[2])

    def slot_of(self, key: bytes) -> int:
        return int.from_bytes(key, "little") % self.slots

    def cell(self, worker: int, slot: int) -> int:
        """The word index of worker ``worker``'s cell for ``slot`` (its ``seq`` word)."""
        return HEADER_WORDS + worker * self._row_words + slot * CELL_WORDS

    def read(self, cell: int) -> list[int] | None:
        """A consistent copy of the cell's 16 words, or None while its owner rewrites it."""
        words = self.words
        seq = words[cell]
        if seq & 1:
            return None
        copy = words[cell : cell + CELL_WORDS].tolist()
        return copy if words[cell] == seq else None

    def write(self, cell: int, updates: dict[int, int]) -> None:
        """The owner's update of several words of its cell (word -> value), under the seqlock."""
        words = self.words
        seq = words[cell] | 1
        words[cell] = seq
        for word, value in updates.items():
            words[cell + word] = value
        words[cell] = seq + 1

    def claim(self, cell: int, key: int) -> None:
        """The owner takes its cell for prefix ``key``: everything it held for another one is forgotten."""
        words = self.words
        seq = words[cell] | 1
        words[cell] = seq
        words[cell + 2 : cell + CELL_WORDS] = array("q", [0] * (CELL_WORDS - 2))
        words[cell + KEY] = key
        words[cell] = seq + 1

    def reset_inflight(self, worker: int) -> None:
        """Supervisor, after worker ``worker`` died (no writer left): its requests in flight are over. What it
        learnt (moves, misses, hits) stays for its replacement."""
        if not 0 <= worker < self.max_workers:
            return
        words = self.words
        for slot in range(self.slots):
            start = self.cell(worker, slot) + INFLIGHT
            words[start : start + INFLIGHT_WORDS] = _ZERO_INFLIGHT

    def rows(self, rows_in_use: Callable[[], int]) -> range:
        return range(min(rows_in_use(), self.max_workers))
