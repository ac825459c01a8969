"""The supervisor's side of spend (docs/pricing.md): where the rollups live, the spend metric families,
and the ``/admin/spend`` report's reads.

- The rollups' store is the quota backend's Valkey (embedded by default), else the managed keys'
  ``auth.store``; without either there are no rollups (and ``/admin/spend`` answers 404).
- ``SpendMetrics`` sums what the workers report (``spend_counts`` status messages: cumulative per
  worker, folded into retired totals when a worker exits) and the alert sender's counts;
  ``BudgetRemaining`` reads what is left of each tenant's USD budgets from the quota report.
- ``SpendReporter`` reads the rollups with its own client, made lazily on the supervisor's loop.
- ``warn_unmatched_overrides``: at start and on each reload, one warning per ``pricing.overrides`` glob
  that matches no model of the shipped table or the overlay (docs/configuration.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gateway.config import Config, managed_keys_enabled
from gateway.identity.auth import KeyIdentity
from gateway.identity.limits import Scope
from gateway.overlay.snapshot import Snapshot
from gateway.pricing.table import shipped_table
from gateway.process_protocol import SpendCounts
from gateway.quota.counters import configured_tenants
from gateway.spend.price_book import override_warnings
from gateway.spend.report import SpendQuery, parse_query, spend_report
from gateway.spend.rollups import DAY_S
from gateway.spend.series import MAX_KEYS, MAX_TENANTS, SpendSums
from gateway.supervisor.keys import key_store_url_for
from gateway.supervisor.quota_backend import EmbeddedQuotaBackend, quota_url_for
from gateway.supervisor.spend_alerts import OUTCOMES, AlertSender

log = logging.getLogger("gridgate.supervisor")

UNPRICED_OUTCOMES = ("zero", "estimated", "rejected")


def warn_unmatched_overrides(config: Config, overlay: Snapshot | None) -> list[str]:
    """Log (and answer) one warning per ``pricing.overrides`` glob that matches no model of the shipped
    price table or of ``overlay``: accepted, since a private model may be unknown to both, but a typo
    in a glob leaves its model at the table's price."""
    if not config.pricing.overrides:
        return []
    models = [*shipped_table().models, *(() if overlay is None else (name for _, name in overlay.capability_keys))]
    warnings = override_warnings(config.pricing.overrides, models)
    for warning in warnings:
        log.warning("%s", warning)
    return warnings


def spend_store_url_for(config: Config, embedded: EmbeddedQuotaBackend) -> str | None:
    """The rollups' store: the quota backend's Valkey, else ``auth.store``; None: rollups are off."""
    if config.quota is not None:
        return quota_url_for(config, embedded)
    if managed_keys_enabled(config):
        return key_store_url_for(config, embedded)
    return None


def tightest_remaining(report: dict[str, Any]) -> int | None:
    """The nano-USD left in the tightest USD budget of the rules in a ``/admin/quota`` report (their
    ``spend`` entries' ``remaining_nusd``, this period); None when no rule of the tenant has one. Keys'
    own budgets are per key, not the tenant's, and are left out (``keys_remaining``)."""
    return _tightest(report.get("rules", ()))


def keys_remaining(report: dict[str, Any]) -> dict[str, int]:
    """Key name -> the nano-USD left in the tightest of its own USD budgets, for the keys of a
    ``/admin/quota`` report that have any."""
    left = {}
    for entry in report.get("keys", ()):
        tightest = _tightest((entry,))
        if tightest is not None and isinstance(entry.get("key"), str):
            left[entry["key"]] = tightest
    return left


def _tightest(entries: Any) -> int | None:
    left = [item["remaining_nusd"] for entry in entries for item in entry.get("spend", ())
            if isinstance(item.get("remaining_nusd"), int)]
    return min(left) if left else None


def gauge_tenants(config: Config, managed: list[KeyIdentity]) -> list[str]:
    """The tenants of the budget gauge: the config's (its keys', its rules'), then those of the managed
    keys (in table order), once each and at most ``MAX_TENANTS``, the spend counter's own bound."""
    names = dict.fromkeys(configured_tenants(config))
    names.update(dict.fromkeys(key.tenant for key in managed))
    return list(names)[:MAX_TENANTS]


def managed_spend_scopes(managed: list[KeyIdentity]) -> dict[str, tuple[Scope, ...]]:
    """Per tenant, the quota scopes of its managed keys that have a USD budget of their own: the key
    series of the gauge with ``pricing.metrics_per_key``, at most ``MAX_KEYS`` (the spend counter's
    bound on key labels), in table order."""
    from gateway.quota.ledger import scopes_of  # here: the ledger loads the valkey client

    scopes: dict[str, tuple[Scope, ...]] = {}
    taken = 0
    for key in managed:
        if key.limits is None or not key.limits.spend:
            continue
        if taken == MAX_KEYS:
            break
        scopes[key.tenant] = scopes.get(key.tenant, ()) + scopes_of(None, key)
        taken += 1
    return scopes


class BudgetRemaining:
    """``gridgate_budget_remaining_nanousd{tenant}`` (with ``pricing.metrics_per_key``, ``{tenant,key}``:
    the rules' under key ``-``, and each key's own, configured or managed): read from the quota report of
    each tenant of ``gauge_tenants`` (the config's and the managed keys') with ``QuotaReporter``, the
    supervisor's ledger client, refreshed in the background at most every ``REFRESH_S`` while somebody
    scrapes; a scrape returns the last values and never waits on Valkey. Values are keyed (tenant, key
    name: a YAML key's alias, a managed key's kid), None for the tenant's rules."""

    REFRESH_S = 10.0

    def __init__(self, running_config: Callable[[], Config], embedded: EmbeddedQuotaBackend,
                 reporter: Any, managed_keys: Callable[[], Awaitable[list[KeyIdentity]]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._running_config = running_config
        self._embedded = embedded
        self._reporter = reporter  # gateway.admin.quota.QuotaReporter
        self._managed_keys = managed_keys  # KeyService.managed_keys: the host's key table, read in full
        self._clock = clock
        self._values: dict[tuple[str, str | None], int] = {}
        self._refreshed = -self.REFRESH_S
        self._task: asyncio.Task[None] | None = None

    def values(self) -> dict[tuple[str, str | None], int]:
        """The last values; starts a refresh when they are older than ``REFRESH_S``."""
        now = self._clock()
        config = self._running_config()
        if config.quota is None:
            self._values = {}
        elif now - self._refreshed >= self.REFRESH_S and (self._task is None or self._task.done()):
            self._refreshed = now
            self._task = asyncio.get_running_loop().create_task(self._refresh(config))
        return self._values

    async def _refresh(self, config: Config) -> None:
        from gateway.admin.pages import ReportUnavailable

        url = quota_url_for(config, self._embedded)
        assert url is not None and config.quota is not None
        managed = await self._managed_keys()
        scopes = managed_spend_scopes(managed) if config.pricing.metrics_per_key else {}
        values: dict[tuple[str, str | None], int] = {}
        for tenant in gauge_tenants(config, managed):
            try:
                report = await self._reporter.report(url, config.quota, tenant, config.auth, scopes.get(tenant, ()))
            except ReportUnavailable:
                return  # the ledger is down: keep the last values until it answers again
            left = tightest_remaining(report)
            if left is not None:
                values[(tenant, None)] = left
            for key, key_left in keys_remaining(report).items():
                values[(tenant, key)] = key_left
        self._values = values

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()


class SpendMetrics:
    """The spend families of ``/metrics``; a prometheus_client collector."""

    def __init__(self, alerts: AlertSender, running_config: Callable[[], Config],
                 budgets: BudgetRemaining | None = None) -> None:
        self.sums = SpendSums()
        self._budgets = budgets
        self._alerts = alerts
        self._running_config = running_config
        # Per worker pid, cumulative: alerts its outbox dropped, requests not rolled up, failed flushes.
        self._worker_losses: dict[int, tuple[int, int, int]] = {}
        self._retired_losses = (0, 0, 0)

    def on_counts(self, pid: int, message: SpendCounts) -> None:
        self.sums.update(pid, message.series)
        if message.unpriced is not None:
            self.sums.unpriced_live[pid] = message.unpriced
        self._worker_losses[pid] = (message.alerts_dropped, message.rollups_dropped, message.rollup_flushes_failed)

    def worker_exited(self, pid: int) -> None:
        self.sums.worker_exited(pid)
        losses = self._worker_losses.pop(pid, (0, 0, 0))
        self._retired_losses = tuple(a + b for a, b in zip(self._retired_losses, losses, strict=True))  # type: ignore[assignment]

    def collect(self) -> Iterator[Any]:
        per_key = self._running_config().pricing.metrics_per_key
        labels = ["tenant", "model", "key"] if per_key else ["tenant", "model"]
        spend = CounterMetricFamily("gridgate_spend_nanousd", "Spend at the served model's price, in nano-USD "
                                    "(integer), per tenant and model (and key, with pricing.metrics_per_key).",
                                    labels=labels)
        folded: dict[tuple[str, ...], int] = {}
        for (tenant, model, key), value in self.sums.totals():
            name = (tenant, model, key or "-") if per_key else (tenant, model)
            folded[name] = folded.get(name, 0) + value  # a series of the other form (before a reload)
        for name, value in sorted(folded.items()):
            spend.add_metric(list(name), value)
        yield spend
        unpriced = CounterMetricFamily("gridgate_unpriced_requests", "Requests of models without a price of "
                                       "their own: charged nothing, priced as a relative, or rejected.",
                                       labels=["outcome"])
        for outcome, value in zip(UNPRICED_OUTCOMES, self.sums.unpriced(), strict=True):
            unpriced.add_metric([outcome], value)
        yield unpriced
        deliveries = CounterMetricFamily("gridgate_spend_alert_deliveries", "Spend alerts posted to "
                                         "pricing.alerts_webhook: delivered, failed (retries ran out), dropped "
                                         "(queue full, or left at shutdown).", labels=["outcome"])
        counts = self._alerts.counts
        alerts_dropped, rollups_dropped, flushes_failed = self.worker_losses()
        for outcome in OUTCOMES:
            deliveries.add_metric([outcome], counts[outcome] + (alerts_dropped if outcome == "dropped" else 0))
        yield deliveries
        reported = CounterMetricFamily("gridgate_spend_alerts", "USD budget thresholds crossed (each once per "
                                       "period across every gateway), per tenant and threshold (alert_at).",
                                       labels=["tenant", "threshold"])
        for (tenant, threshold), value in sorted(self._alerts.reported.items()):
            reported.add_metric([tenant, threshold], value)
        yield reported
        yield CounterMetricFamily("gridgate_spend_rollups_dropped", "Requests not rolled up: a worker's batch was "
                                  "full while the store was down.", rollups_dropped)
        yield CounterMetricFamily("gridgate_spend_rollup_flush_failures", "Rollup flushes the store did not take "
                                  "(each is tried again a second later).", flushes_failed)
        yield GaugeMetricFamily("gridgate_spend_alerts_queued", "Spend alerts waiting for the webhook.",
                                self._alerts.queued)
        remaining = GaugeMetricFamily("gridgate_budget_remaining_nanousd", "Nano-USD left in the current period "
                                      "of the tightest USD budget of the tenant's rules (and, with "
                                      "pricing.metrics_per_key, of each key's own).",
                                      labels=["tenant", "key"] if per_key else ["tenant"])
        values = {} if self._budgets is None else self._budgets.values()
        for (tenant, key), value in sorted(values.items(), key=lambda item: (item[0][0], item[0][1] or "")):
            if per_key:
                remaining.add_metric([tenant, key or "-"], value)
            elif key is None:
                remaining.add_metric([tenant], value)
        yield remaining

    def worker_losses(self) -> tuple[int, int, int]:
        summed = self._retired_losses
        for losses in self._worker_losses.values():
            summed = tuple(a + b for a, b in zip(summed, losses, strict=True))  # type: ignore[assignment]
        return summed


class SpendReporter:
    """``/admin/spend``'s reads, over its own client of the rollups' store (reconnects when it moves)."""

    def __init__(self, running_config: Callable[[], Config], embedded: EmbeddedQuotaBackend,
                 clock: Callable[[], float] = time.time) -> None:
        self._running_config = running_config
        self._embedded = embedded
        self._clock = clock
        self._url: str | None = None
        self._client: Any = None

    def enabled(self) -> bool:
        config = self._running_config()
        return config.quota is not None or managed_keys_enabled(config)

    def query(self, query: dict[str, list[str]]) -> SpendQuery:
        """Raises ``gateway.spend.report.QueryProblem`` (400) for a bad parameter."""
        return parse_query(query, int(self._clock() // DAY_S))

    async def report(self, query: SpendQuery) -> dict[str, Any]:
        """Raises the backend's errors (``gateway.valkey.client.BACKEND_ERRORS``: 503)."""
        from gateway.spend.store import read_rows
        from gateway.valkey.client import create_client

        url = spend_store_url_for(self._running_config(), self._embedded)
        if url != self._url:
            await self.close()
        if self._client is None:
            self._client = create_client(url, timeout_s=5.0)  # type: ignore[arg-type]
            self._url = url
        return spend_report(query, await read_rows(self._client, query))

    async def close(self) -> None:
        if self._client is not None:
            try:
                await self._client.aclose()
            except Exception:  # a client that failed closes as it can
                pass
        self._client = self._url = None
