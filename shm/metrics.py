"""Per-worker metric counters in shared memory: one row per worker, one writer per row.

Rows are padded to cache lines. The supervisor sums rows when it renders ``/metrics`` and folds a
dead worker's row into its own ``retired`` totals before the row is zeroed for the replacement, so
counters never go backwards.
"""

from __future__ import annotations

LINE_BYTES = 64
WORD_BYTES = 8


def row_bytes(counters: int) -> int:
    return -(-counters * WORD_BYTES // LINE_BYTES) * LINE_BYTES


class MetricsTable:
    """A view over the metrics region: ``max_workers`` rows of ``counters`` int64 cells."""

    def __init__(self, buffer: memoryview, max_workers: int, counters: int) -> None:
        self.counters = counters
        self.max_workers = max_workers
        self._row_words = row_bytes(counters) // WORD_BYTES
        self._words = buffer.cast("B").cast("q")
        if len(self._words) < self._row_words * max_workers:
            raise ValueError("metrics region too small for its rows")

    @staticmethod
    def required_bytes(max_workers: int, counters: int) -> int:
        return row_bytes(max(counters, 1)) * max_workers

    def row(self, worker: int) -> memoryview:
        """The writable row of ``worker``; only that worker may write it (``row[i] += n``)."""
        start = worker * self._row_words
        return self._words[start : start + self.counters]

    def sum_rows(self, workers: range | list[int]) -> list[int]:
        totals = [0] * self.counters
        for worker in workers:
            row = self.row(worker)
            for index, value in enumerate(row):
                if value:
                    totals[index] += value
        return totals

    def retire(self, worker: int, into: list[int]) -> None:
        """Supervisor: add a dead worker's counts to ``into`` and zero its row."""
        row = self.row(worker)
        for index, value in enumerate(row):
            into[index] += value
            row[index] = 0
