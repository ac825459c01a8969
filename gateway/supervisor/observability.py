"""What the supervisor shows: its admin sources and its own metric families (the workers' summed counters
are ``worker_counters.py``)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gateway.admin.quota import QuotaReporter
from gateway.cluster.report import endpoints_report
from gateway.cluster.spec import cluster_specs_from_config
from gateway.config import Config
from gateway.identity.auth import KeyIdentity
from gateway.supervisor.quota_backend import EmbeddedQuotaBackend, quota_url_for
from gateway.supervisor.readiness import Readiness
from gateway.supervisor.reload import GenerationSwap
from gateway.supervisor.worker_set import WorkerSet
from shm.segment import Segment

MAX_MANAGED_REPORTED = 200  # managed keys per tenant whose own limits /admin/quota reads (one ledger call)


class SupervisorAdminSources:
    """What the admin pages read from the supervisor (gateway.admin.pages ``AdminSources``)."""

    def __init__(
        self,
        readiness: Readiness,
        running_config: Callable[[], Config],
        segment: Segment,
        quota_backend: EmbeddedQuotaBackend,
        quota_reporter: QuotaReporter,
        managed_keys: Callable[[], Awaitable[list[KeyIdentity]]] | None = None,
    ) -> None:
        self._readiness = readiness
        self._running_config = running_config
        self._segment = segment
        self._quota_backend = quota_backend
        self._quota_reporter = quota_reporter
        self._managed_keys = managed_keys  # KeyService.managed_keys: their own limits are in the report

    def readiness(self) -> tuple[bool, str]:
        return self._readiness.readiness()

    def overlay_report(self) -> dict[str, Any]:
        return self._readiness.overlay_report()

    def endpoints_report(self) -> dict[str, Any]:
        return endpoints_report(self._segment, cluster_specs_from_config(self._running_config()))

    def quota_enabled(self) -> bool:
        return self._running_config().quota is not None

    async def quota_report(self, tenant: str) -> dict[str, Any]:
        config = self._running_config()
        url = quota_url_for(config, self._quota_backend)
        assert url is not None and config.quota is not None  # the page checks quota_enabled first
        return await self._quota_reporter.report(url, config.quota, tenant, config.auth,
                                                 await self._managed_scopes(tenant))

    async def _managed_scopes(self, tenant: str) -> tuple[Any, ...]:
        """The quota scopes of the tenant's managed keys with limits of their own (at most
        ``MAX_MANAGED_REPORTED``, in table order): each key's row of ``/admin/quota`` names its kid."""
        if self._managed_keys is None:
            return ()
        from gateway.quota.ledger import scopes_of  # here: the ledger loads the valkey client

        keys = [key for key in await self._managed_keys() if key.tenant == tenant and key.limits is not None]
        return tuple(scope for key in keys[:MAX_MANAGED_REPORTED] for scope in scopes_of(None, key))


class SupervisorCollector:
    """The supervisor's own metric families, computed at scrape time."""

    def __init__(self, workers: WorkerSet, swap: GenerationSwap) -> None:
        self._workers = workers
        self._swap = swap

    def collect(self) -> Iterator[Any]:
        workers, swap = self._workers, self._swap
        now = time.monotonic()
        serving = workers.serving()
        yield GaugeMetricFamily("gridgate_workers_live", "Worker processes alive (all generations)",
                                len(workers.workers()))
        yield GaugeMetricFamily("gridgate_workers_ready", "Serving workers that reported ready",
                                sum(1 for c in serving if c.ready))
        yield GaugeMetricFamily("gridgate_workers_target", "Workers the supervisor keeps running", workers.target)
        yield GaugeMetricFamily("gridgate_config_generation", "Config generation being served", workers.generation)
        yield CounterMetricFamily("gridgate_worker_restarts", "Workers replaced after dying", workers.restarts_total)
        yield CounterMetricFamily("gridgate_reloads", "Reloads requested (SIGHUP)", swap.reloads_total)
        yield CounterMetricFamily("gridgate_reload_failures", "Reloads that kept the running config",
                                  swap.reload_failures_total)
        ages = [c.heartbeat_age(now) for c in serving if c.ready]
        yield GaugeMetricFamily("gridgate_worker_heartbeat_age_max_seconds",
                                "Oldest heartbeat among serving workers", max(ages, default=0.0))
        watch = workers.health_watch
        age = watch.age(time.monotonic_ns())
        if age is not None:  # a health process ran (the config has health checks or outlier detection)
            yield GaugeMetricFamily("gridgate_health_verdict_age_seconds",
                                    "Seconds since the health process last beat (its verdicts are that old)", age)
            yield GaugeMetricFamily("gridgate_health_verdicts_stale",
                                    "1 while the health verdicts are too old to trust (read as unknown)",
                                    int(watch.stale()))
        yield CounterMetricFamily("gridgate_health_process_hangs", "Health processes killed for sending no heartbeat",
                                  watch.hangs_total)
