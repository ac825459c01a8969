"""What the supervisor shows: the workers' summed counters, its admin sources and its own metric families."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gateway.endpoints import cluster_specs_from_config, endpoints_report
from gateway.host_segment import METRICS_REGION
from gateway.metrics import COUNTERS, render_prometheus
from shm.metrics import MetricsTable
from shm.segment import Segment
from workers.admin import ReportUnavailable

if TYPE_CHECKING:  # annotations only: the arbiter imports this module
    from gateway.supervisor.arbiter import Supervisor


class WorkerCounters:
    """The workers' request counters in shared memory, summed when /metrics is scraped."""

    def __init__(self, segment: Segment) -> None:
        self.table = MetricsTable(segment.region(METRICS_REGION), segment.max_workers, COUNTERS)
        self.retired = [0] * COUNTERS  # dead workers' counts: totals must never go backwards

    def retire(self, slot: int) -> None:
        self.table.retire(slot, self.retired)

    def render(self, slots: list[int], cluster_names: list[str]) -> bytes:
        live = self.table.sum_rows(slots)
        return render_prometheus([a + b for a, b in zip(live, self.retired, strict=True)], cluster_names)


class SupervisorAdminSources:
    """What the admin pages read from the supervisor (workers/admin.py ``AdminSources``)."""

    def __init__(self, supervisor: Supervisor) -> None:
        self._supervisor = supervisor

    def readiness(self) -> tuple[bool, str]:
        return self._supervisor.readiness()

    def overlay_report(self) -> dict[str, Any]:
        serving = self._supervisor._serving()
        ready = [c for c in serving if c.ready]
        revisions = Counter(c.revision for c in ready)
        revision = revisions.most_common(1)[0][0] if revisions else None
        leader = next((c for c in ready if c.revision == revision), None)
        return {
            "serving_revision": revision,
            "mode": leader.mode if leader else None,
            "capabilities": leader.capabilities if leader else [],
            "converged": len(revisions) <= 1 and len(ready) == len(serving),
            "workers": [{"pid": c.pid, "serving_revision": c.revision} for c in serving],
            "last_rejection": self._supervisor.last_overlay_rejection,
        }

    def endpoints_report(self) -> dict[str, Any]:
        segment = self._supervisor.segment
        if segment is None:
            raise ReportUnavailable("shared memory is not available")
        return endpoints_report(segment, cluster_specs_from_config(self._supervisor.config))

    def quota_enabled(self) -> bool:
        return self._supervisor.config.quota is not None

    async def quota_report(self, tenant: str) -> dict[str, Any]:
        return await self._supervisor.current_quota_reporter().report(tenant)


class SupervisorCollector:
    """The supervisor's own metric families, computed at scrape time."""

    def __init__(self, supervisor: Supervisor) -> None:
        self._supervisor = supervisor

    def collect(self) -> Iterator[Any]:
        sup = self._supervisor
        now = time.monotonic()
        serving = sup._serving()
        yield GaugeMetricFamily("gridgate_workers_live", "Worker processes alive (all generations)", len(sup._workers()))
        yield GaugeMetricFamily("gridgate_workers_ready", "Serving workers that reported ready",
                                sum(1 for c in serving if c.ready))
        yield GaugeMetricFamily("gridgate_workers_target", "Workers the supervisor keeps running", sup.target)
        yield GaugeMetricFamily("gridgate_config_generation", "Config generation being served", sup.generation)
        yield CounterMetricFamily("gridgate_worker_restarts", "Workers replaced after dying", sup.restarts_total)
        yield CounterMetricFamily("gridgate_reloads", "Reloads requested (SIGHUP)", sup.reloads_total)
        yield CounterMetricFamily("gridgate_reload_failures", "Reloads that kept the running config",
                                  sup.reload_failures_total)
        ages = [c.heartbeat_age(now) for c in serving if c.ready]
        yield GaugeMetricFamily("gridgate_worker_heartbeat_age_max_seconds",
                                "Oldest heartbeat among serving workers", max(ages, default=0.0))
