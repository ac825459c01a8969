"""Per-provider facts every worker of a host shares: cooling and first-byte latency; and the cooling
of single endpoints (:class:`EndpointCooling`, kept in the endpoint slot lines of shm.counters).

One row per worker slot (single writer: that worker), ``max_providers`` records per row, each record
a few int64 words. Readers combine rows: the latest cooling wins (max), latencies are averaged over
the rows that measured, each weighted by how recent its latest sample is. Storage only: the meaning
of each word is documented here, the arithmetic lives with its users.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import itemgetter

from shm.counters import COOLED_UNTIL
from shm.metrics import MetricsTable
from shm.segment import SLOT_LINE_WORDS, Segment

# Words of one provider record in one worker's row.
COOLED_UNTIL_NS = 0  # monotonic ns until which this worker saw the provider cooled
COOLED_AT_NS = 1  # monotonic ns when that cooling began
FIRST_BYTE_US = 2  # this worker's moving average of the provider's first-byte latency (0: unmeasured)
SAMPLED_AT_NS = 3  # monotonic ns of this worker's latest sample in that average (readers age it from there)
RECORD_WORDS = 4


class ProviderCells:
    def __init__(self, buffer: memoryview, max_workers: int, max_providers: int) -> None:
        self.max_providers = max_providers
        self._table = MetricsTable(buffer, max_workers, max_providers * RECORD_WORDS)

    @staticmethod
    def required_bytes(max_workers: int, max_providers: int) -> int:
        return MetricsTable.required_bytes(max_workers, max_providers * RECORD_WORDS)

    def row(self, worker: int) -> memoryview:
        """Worker ``worker``'s writable row; provider ``p``'s word ``w`` is ``row[p * RECORD_WORDS + w]``."""
        return self._table.row(worker)


class EndpointCooling:
    """Endpoint cooling, in the worker rows' slot lines (word ``COOLED_UNTIL`` of shm.counters): each
    worker writes its own row's cells, readers take the latest ``until`` over the rows in use. A dead
    worker's row is zeroed with the rest of it, like its in-flight counts."""

    def __init__(self, segment: Segment, worker: int) -> None:
        self._segment = segment
        self._words = segment.words
        self._layout = segment.layout
        self._own = self._layout.slot_line_word(worker, 0) + COOLED_UNTIL

    def cool(self, slot: int, until_ns: int) -> None:
        """This worker saw ``slot`` cooled until ``until_ns`` (monotonic); a later until only extends."""
        index = self._own + slot * SLOT_LINE_WORDS
        if until_ns > self._words[index]:
            self._words[index] = until_ns

    def cooled_until(self, slot: int) -> int:
        """The latest cooling of ``slot`` any worker saw (monotonic ns; 0: never)."""
        return self.reader([slot])()[0]

    def reader(self, slots: Sequence[int]) -> Callable[[], list[int]]:
        """A cheap callable giving the latest cooling of each of ``slots`` over the rows in use now
        (build another when ``rows_in_use`` changes): one C-level gather per row."""
        words, layout = self._words, self._layout
        slots = list(slots)
        rows = self._segment.rows_in_use()
        if not rows or not slots:
            zeros = [0] * len(slots)
            return lambda: list(zeros)
        getters = [itemgetter(*(layout.slot_line_word(w, s) + COOLED_UNTIL for s in slots)) for w in range(rows)]
        if len(slots) == 1:
            return lambda: [max(get(words) for get in getters)]
        if rows == 1:
            (only,) = getters
            return lambda: list(only(words))
        return lambda: list(map(max, *(get(words) for get in getters)))
