"""``routing.conformance``: the supervisor rechecks the providers and keeps a failed one out of selection.

The checks are those of ``gridgate providers verify`` (gateway/conformance), run on the supervisor's
loop, never on a request path: at start, after every reload and every ``recheck``. A provider that
failed a required check has its word in shared memory set (shm/conformance.py); every worker reads
those words when it refreshes its provider view (a few times a second) and leaves the provider out of
selection with reason ``nonconformant`` until a later run finds it conformant again. A provider not
checked yet is in selection: a start or a reload never empties a pool while its first run is under way.

The supervisor, not the control plane, because it is the one place that sends exactly what the
workers send (the host's config: endpoints, TLS, SNI and the upstream credentials, whose secrets are
in the gateway's environment), it runs on every gateway host, also without a control plane, and its
verdict reaches the workers through shared memory within a refresh. The cost: each host checks for
itself (docs/provider-conformance.md#in-the-pool).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gateway.check import load_overlay_snapshot
from gateway.config import Config, ConfigError
from gateway.conformance.runner import verify
from gateway.conformance.targets import TargetError, select_targets
from gateway.conformance.verdicts import ProviderVerdict, provider_verdicts
from gateway.host_segment import CONFORMANCE_REGION, MAX_PROVIDERS
from gateway.metrics.labels import LabelRegistry
from shm.conformance import ConformanceFlags
from shm.segment import Segment

log = logging.getLogger("gridgate.conformance")


class ConformanceWatch:
    """Schedules the runs (``tick`` on the supervisor's loop), applies their verdicts, reports them."""

    def __init__(self, segment: Segment, clusters: LabelRegistry, *,
                 monotonic: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self._flags = ConformanceFlags(segment.region(CONFORMANCE_REGION), MAX_PROVIDERS)
        self._clusters = clusters  # the stable provider indexes the workers use
        self._monotonic = monotonic
        self._wall = wall
        self._config: Config | None = None
        self._task: asyncio.Task[None] | None = None
        self._due = 0.0
        self.verdicts: dict[str, ProviderVerdict] = {}
        self.runs = {"completed": 0, "failed": 0}
        self.tokens = 0

    def tick(self, config: Config, now: float) -> None:
        if config is not self._config:  # start or reload: check again now, with the new config
            self._config = config
            self._cancel()
            self._due = now
            if config.routing.conformance is None:
                self._flags.clear()
                self.verdicts.clear()
        if config.routing.conformance is not None and self._task is None and now >= self._due:
            self._task = asyncio.get_running_loop().create_task(self._run(config))

    async def _run(self, config: Config) -> None:
        settings = config.routing.conformance
        assert settings is not None
        try:
            targets = select_targets(config, load_overlay_snapshot(config), surfaces=settings.surfaces,
                                     environ=os.environ)
            reports = await verify(targets, max_tokens=settings.max_tokens, timeout_s=float(settings.timeout))
        except (TargetError, ConfigError) as exc:
            self.runs["failed"] += 1
            log.warning("conformance: cannot check the providers: %s", exc)
        else:
            self.runs["completed"] += 1
            self._apply(config, provider_verdicts(reports, self._wall()))
        finally:
            if self._config is config:
                self._task = None
                self._due = self._monotonic() + float(settings.recheck)

    def _apply(self, config: Config, verdicts: dict[str, ProviderVerdict]) -> None:
        required = config.routing.conformance is not None and config.routing.conformance.required
        for name, verdict in verdicts.items():
            self.tokens += verdict.tokens
            before = self.verdicts.get(name)
            if before is None or before.conformant != verdict.conformant:
                self._log_change(verdict, required)
            index = self._clusters.index_of(name)
            if index is None:
                log.warning("conformance: cluster %s has no provider index (past %d clusters): not acted on",
                            name, MAX_PROVIDERS)
            else:
                self._flags.mark(index, required and not verdict.conformant)
        self.verdicts = verdicts

    @staticmethod
    def _log_change(verdict: ProviderVerdict, required: bool) -> None:
        if verdict.conformant:
            log.info("conformance: provider %s passed every required check", verdict.cluster)
            return
        action = "left out of selection (nonconformant)" if required else "kept in selection (required: false)"
        log.warning("conformance: provider %s failed %s; %s", verdict.cluster, "; ".join(verdict.failures[:5]), action)

    def _cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def excluded(self, cluster: str) -> bool:
        index = self._clusters.index_of(cluster)
        return index is not None and self._flags.nonconformant(index)

    def report(self, config: Config) -> dict[str, Any]:
        """The ``/admin/providers`` document."""
        settings = config.routing.conformance
        providers = []
        for cluster in config.clusters:
            verdict = self.verdicts.get(cluster.name)
            entry: dict[str, Any] = {"cluster": cluster.name, "status": "unchecked", "excluded": False}
            if verdict is not None:
                entry.update(verdict.as_dict(), excluded=self.excluded(cluster.name),
                             checked_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(verdict.checked_at)))
            providers.append(entry)
        return {"conformance": None if settings is None else {
            "required": settings.required, "recheck_s": float(settings.recheck), "surfaces": settings.surfaces,
            "running": self._task is not None, "runs": dict(self.runs), "tokens": self.tokens},
            "providers": providers}

    def collect(self) -> Iterator[Any]:
        if self._config is None or self._config.routing.conformance is None:
            return
        excluded = GaugeMetricFamily("gridgate_provider_nonconformant",
                                     "1 while the provider is left out of selection by its conformance checks",
                                     labels=["cluster"])
        for cluster in self._config.clusters:
            excluded.add_metric([cluster.name], 1.0 if self.excluded(cluster.name) else 0.0)
        yield excluded
        runs = CounterMetricFamily("gridgate_conformance_runs", "Conformance runs over every provider, by outcome",
                                   labels=["outcome"])
        for outcome, count in self.runs.items():
            runs.add_metric([outcome], count)
        yield runs
        yield CounterMetricFamily("gridgate_conformance_tokens", "Tokens the conformance checks spent", self.tokens)
