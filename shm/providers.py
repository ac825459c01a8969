"""Per-provider facts every worker of a host shares: cooling and first-byte latency.

One row per worker slot (single writer: that worker), ``max_providers`` records per row, each record
a few int64 words. Readers combine rows: the latest cooling wins (max), latencies are averaged over
the rows that measured, each weighted by how recent its latest sample is. Storage only: the meaning of each word is documented here, the arithmetic
lives with its users.
"""

from __future__ import annotations

from shm.metrics import MetricsTable

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
