"""The workers' request counters in shared memory, summed by the supervisor when /metrics is scraped."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.host_segment import METRICS_REGION
from gateway.metrics.catalogue import COUNTERS
from gateway.metrics.render import render_prometheus
from shm.metrics import MetricsTable
from shm.segment import Segment


class WorkerCounters:
    """The workers' request counters in shared memory, summed when /metrics is scraped."""

    def __init__(self, segment: Segment) -> None:
        self.table = MetricsTable(segment.region(METRICS_REGION), segment.max_workers, COUNTERS)
        self.retired = [0] * COUNTERS  # dead workers' counts: totals must never go backwards

    def retire(self, slot: int) -> None:
        self.table.retire(slot, self.retired)

    def render(self, slots: list[int], cluster_names: Sequence[str], tenant_names: Sequence[str],
               fallback_edges: Sequence[str] = ()) -> bytes:
        """``cluster_names``/``tenant_names``/``fallback_edges``: the supervisor's registries, the ones the
        workers index by."""
        live = self.table.sum_rows(slots)
        return render_prometheus([a + b for a, b in zip(live, self.retired, strict=True)], cluster_names,
                                 tenant_names, fallback_edges)
