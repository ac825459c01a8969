"""Prefix affinity's placements shared by the workers of a host (docs/routing.md, "Prefix affinity").

The rules are gateway.routing.prefix's (places, spill, misses, slow first tokens, a round without a
hit); what they count lives in shared memory (shm.prefixes), so that with N workers a prefix's feedback
and its requests in flight are not split N ways: each worker writes only its own row's cells and reads
every row's cells of the same prefix, summed:

- the prefix's place offset is the sum of the moves every worker made (a re-placement learnt on one
  worker is followed by all);
- a run of misses counts every worker's misses since the host's latest hit or move of the prefix
  (each worker's run is tagged with the host offset and hit count it counts at, so a hit or a move
  anywhere ends every run);
- the moves since the latest hit are the offset less the offset at the latest hit (offsets only grow);
- the requests in flight per provider are summed over the host, and spill at ``spill_at x capacity``
  of the host, not a per-worker share.

Two workers deciding at the same instant may both place one request over the share, or both move a
prefix (two places): a preference, not a guarantee, like session affinity's table.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.routing.prefix import Placement, PrefixEntry, PrefixTable
from shm.prefixes import (
    COUNT_MASK,
    HIT_OFFSET,
    HITS,
    INFLIGHT,
    INFLIGHT_WORDS,
    KEY,
    MISSES,
    MOVES,
    PROVIDER_SHIFT,
    RUN_HITS,
    RUN_OFFSET,
    PrefixCells,
    key_word,
)


class SharedEntry(PrefixEntry):
    """One request's view of a prefix over the host's cells (read when the request is placed, and again
    before its answer feeds back)."""

    __slots__ = ("word", "cell", "hits")

    def __init__(self, key: bytes, word: int, cell: int) -> None:
        super().__init__(key)
        self.word = word  # the key as the cells store it
        self.cell = cell  # this worker's cell for the prefix's slot
        self.hits = 0  # cache hits of the prefix over the host


class SharedPrefixTable(PrefixTable):
    """A PrefixTable whose counts are the host's (see the module docstring)."""

    __slots__ = ("cells", "worker", "_rows_in_use")

    def __init__(self, cells: PrefixCells, worker: int, rows_in_use: Callable[[], int], spill_limit: int,
                 miss_limit: int, slow_first_token_s: float | None) -> None:
        super().__init__(cells.slots, spill_limit, miss_limit, slow_first_token_s)
        self.cells = cells
        self.worker = worker
        self._rows_in_use = rows_in_use

    def __len__(self) -> int:
        words, cells = self.cells.words, self.cells
        return sum(1 for slot in range(cells.slots) if words[cells.cell(self.worker, slot) + KEY])

    def entry(self, key: bytes) -> PrefixEntry:
        """The prefix's view over the host's cells now."""
        cells = self.cells
        entry = SharedEntry(key, key_word(key), cells.cell(self.worker, cells.slot_of(key)))
        self._fresh(entry)
        return entry

    def place(self, entry: PrefixEntry, ranked) -> int:  # type: ignore[no-untyped-def]
        """As PrefixTable's, over the host's counts read right now (other workers place meanwhile)."""
        self._fresh(entry)
        return super().place(entry, ranked)

    def _fresh(self, entry: PrefixEntry) -> None:
        """Sum the cells of every row in use that hold the prefix."""
        assert isinstance(entry, SharedEntry)
        cells = self.cells
        word, own = entry.word, entry.cell
        offset = hits = hit_offset = 0
        runs: list[tuple[int, int, int]] = []
        inflight: dict[int, int] = {}
        step = own - cells.cell(self.worker, 0)
        for row in cells.rows(self._rows_in_use):
            copy = cells.read(cells.cell(row, 0) + step)
            if copy is None or copy[KEY] != word:
                continue
            offset += copy[MOVES]
            hits += copy[HITS]
            if copy[HIT_OFFSET] > hit_offset:
                hit_offset = copy[HIT_OFFSET]
            runs.append((copy[MISSES], copy[RUN_OFFSET], copy[RUN_HITS]))
            for packed in copy[INFLIGHT:]:
                if packed & COUNT_MASK:
                    provider = (packed >> PROVIDER_SHIFT) - 1
                    inflight[provider] = inflight.get(provider, 0) + (packed & COUNT_MASK)
        entry.offset, entry.hits, entry.inflight = offset, hits, inflight
        entry.moves = max(0, offset - hit_offset)
        entry.misses = sum(misses for misses, at, after in runs if at == offset and after == hits)

    def _own(self, entry: SharedEntry) -> int:
        """This worker's cell for the prefix, taken over from another prefix if it held one."""
        cell = entry.cell
        if self.cells.words[cell + KEY] != entry.word:
            self.cells.claim(cell, entry.word)
        return cell

    def _enter(self, entry: PrefixEntry, provider: int) -> int:
        assert isinstance(entry, SharedEntry)
        words = self.cells.words
        start = self._own(entry) + INFLIGHT
        tag = (provider + 1) << PROVIDER_SHIFT
        free = -1
        for index in range(start, start + INFLIGHT_WORDS):
            packed = words[index]
            if packed >> PROVIDER_SHIFT == provider + 1:
                words[index] = packed + 1
                return index
            if free < 0 and not packed & COUNT_MASK:
                free = index
        if free >= 0:
            words[free] = tag | 1
        return free  # -1: this worker has the prefix in flight on more providers than its cell holds

    def _leave(self, placement: Placement) -> None:
        index = placement.counted
        entry = placement.entry
        assert isinstance(entry, SharedEntry)
        words = self.cells.words
        if index < 0 or words[entry.cell + KEY] != entry.word:
            return  # not counted, or the cell went to another prefix (its counts with it)
        packed = words[index]
        if packed >> PROVIDER_SHIFT == placement.provider + 1 and packed & COUNT_MASK:
            words[index] = packed - 1

    def _hit(self, entry: PrefixEntry) -> None:
        assert isinstance(entry, SharedEntry)
        cell = self._own(entry)
        words = self.cells.words
        self.cells.write(cell, {HITS: words[cell + HITS] + 1, HIT_OFFSET: entry.offset, MISSES: 0,
                                RUN_OFFSET: entry.offset, RUN_HITS: entry.hits + 1})
        entry.misses = entry.moves = 0
        entry.hits += 1

    def _missed(self, entry: PrefixEntry) -> bool:
        assert isinstance(entry, SharedEntry)
        cell = self._own(entry)
        words = self.cells.words
        counting = words[cell + RUN_OFFSET] == entry.offset and words[cell + RUN_HITS] == entry.hits
        own = (words[cell + MISSES] if counting else 0) + 1
        self.cells.write(cell, {MISSES: own, RUN_OFFSET: entry.offset, RUN_HITS: entry.hits})
        entry.misses += 1  # the host's run: this worker's part was in it only while counting
        return entry.misses >= self.miss_limit

    def _move(self, entry: PrefixEntry, ring: int) -> bool:
        assert isinstance(entry, SharedEntry)
        cell = self._own(entry)
        words = self.cells.words
        entry.misses = 0
        if entry.moves >= ring:  # a whole round without a hit: it stays (this worker's run starts over)
            self.cells.write(cell, {MISSES: 0})
            return False
        entry.offset += 1
        entry.moves += 1
        self.cells.write(cell, {MOVES: words[cell + MOVES] + 1, MISSES: 0, RUN_OFFSET: entry.offset,
                                RUN_HITS: entry.hits})
        self.moved += 1
        return True
