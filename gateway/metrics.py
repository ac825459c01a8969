"""Metric catalogue (fixed counter offsets shared by every process) and the Prometheus renderer.

Workers increment cells of their own row in ``shm.metrics.MetricsTable`` with precomputed
offsets; the supervisor sums rows and renders text with ``prometheus_client``'s exposition
code. Label sets are bounded: clusters by the supervisor's append-only ``ClusterRegistry`` (at most
``MAX_CLUSTERS`` names, the rest share the ``other`` label), status codes by class, gateway errors
by a fixed list of statuses.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import CollectorRegistry

MAX_CLUSTERS = 64
STATUS_CLASSES = ("1xx", "2xx", "3xx", "4xx", "5xx")
GATEWAY_STATUSES = (400, 401, 404, 405, 408, 413, 414, 429, 431, 500, 501, 502, 503, 504, 505)
OVERHEAD_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)
AFFINITY_OUTCOMES = ("none", "new", "reused", "failover")
QUOTA_DECISIONS = ("admitted", "denied", "backend_error_rejected", "backend_error_allowed")
QUOTA_TOKEN_KINDS = ("estimated", "actual", "refunded", "overage")
OVERLAY_RESULTS = ("applied", "unchanged", "rejected")

# Offsets of each family inside a worker's row. Row i of cluster c, class k: REQUESTS + c*5 + k;
# cluster index MAX_CLUSTERS stands for "answered by the gateway itself", MAX_CLUSTERS + 1 for a
# cluster the registry had no room left for.
REQUESTS = 0
GATEWAY_ERRORS = REQUESTS + (MAX_CLUSTERS + 2) * len(STATUS_CLASSES)
OVERHEAD_BUCKETS = GATEWAY_ERRORS + len(GATEWAY_STATUSES)
OVERHEAD_SUM_US = OVERHEAD_BUCKETS + len(OVERHEAD_BUCKETS_S) + 1  # last bucket is +Inf
OVERHEAD_COUNT = OVERHEAD_SUM_US + 1
AFFINITY = OVERHEAD_COUNT + 1
RETRIES = AFFINITY + len(AFFINITY_OUTCOMES)
QUOTA_DECISION = RETRIES + 1
QUOTA_TOKENS = QUOTA_DECISION + len(QUOTA_DECISIONS)
QUOTA_BACKEND_ERRORS = QUOTA_TOKENS + len(QUOTA_TOKEN_KINDS)
QUOTA_RECONCILE_DROPS = QUOTA_BACKEND_ERRORS + 1
QUOTA_BREAKER = QUOTA_RECONCILE_DROPS + 1  # opened, closed
OVERLAY_RELOADS = QUOTA_BREAKER + 2
PANIC_ENTRIES = OVERLAY_RELOADS + len(OVERLAY_RESULTS)  # per cluster index
COUNTERS = PANIC_ENTRIES + MAX_CLUSTERS

GATEWAY_CLUSTER = MAX_CLUSTERS
OTHER_CLUSTER = MAX_CLUSTERS + 1
_GATEWAY_STATUS_INDEX = {status: i for i, status in enumerate(GATEWAY_STATUSES)}


def request_cell(cluster_index: int, status: int) -> int:
    klass = min(max(status // 100, 1), 5) - 1
    return REQUESTS + cluster_index * len(STATUS_CLASSES) + klass


def gateway_error_cell(status: int) -> int | None:
    index = _GATEWAY_STATUS_INDEX.get(status)
    return None if index is None else GATEWAY_ERRORS + index


def overhead_cell(seconds: float) -> int:
    for index, bound in enumerate(OVERHEAD_BUCKETS_S):
        if seconds <= bound:
            return OVERHEAD_BUCKETS + index
    return OVERHEAD_BUCKETS + len(OVERHEAD_BUCKETS_S)


class ClusterRegistry:
    """Cluster name -> metrics index, append-only for the life of the supervisor.

    Indexes are shared-memory cell offsets that workers of every generation write and the supervisor
    renders, so an index must never change meaning: a reload that reorders, removes or renames
    clusters only appends the new names. Workers get ``names`` at fork time (a prefix of every later
    value). Once ``MAX_CLUSTERS`` names are taken, further clusters are counted under ``other``.
    """

    def __init__(self, capacity: int = MAX_CLUSTERS) -> None:
        self._capacity = capacity
        self._names: list[str] = []
        self._seen: set[str] = set()  # every name registered, labelled or not

    @property
    def names(self) -> tuple[str, ...]:
        """The labelled names; position = metrics index."""
        return tuple(self._names)

    def register(self, names: Iterable[str]) -> list[str]:
        """Give every new name the next index; returns the new names that found no room (once each)."""
        unlabelled = []
        for name in names:
            if name in self._seen:
                continue
            self._seen.add(name)
            if len(self._names) < self._capacity:
                self._names.append(name)
            else:
                unlabelled.append(name)
        return unlabelled


class WorkerMetrics:
    """A worker's writer over its own row: every method is a few integer additions."""

    __slots__ = ("row", "cluster_index")

    def __init__(self, row: memoryview | list[int], cluster_names: Sequence[str]) -> None:
        """``cluster_names``: the registry's names (position = index), e.g. ``WorkerContext.metric_clusters``."""
        self.row = row
        self.cluster_index = {name: i for i, name in enumerate(cluster_names[:MAX_CLUSTERS])}

    def request(self, cluster: str | None, status: int) -> None:
        index = GATEWAY_CLUSTER if cluster is None else self.cluster_index.get(cluster, OTHER_CLUSTER)
        self.row[request_cell(index, status)] += 1
        if cluster is None:
            cell = gateway_error_cell(status)
            if cell is not None:
                self.row[cell] += 1

    def overhead(self, seconds: float) -> None:
        row = self.row
        row[overhead_cell(seconds)] += 1
        row[OVERHEAD_SUM_US] += int(seconds * 1e6)
        row[OVERHEAD_COUNT] += 1

    def affinity(self, outcome: str) -> None:
        self.row[AFFINITY + AFFINITY_OUTCOMES.index(outcome)] += 1

    def retry(self) -> None:
        self.row[RETRIES] += 1

    def publish_quota(self, counters: Any) -> None:
        """Copy the quota gate's monotonic per-worker counters (gateway.quota.gate.QuotaCounters)."""
        row = self.row
        row[QUOTA_DECISION] = counters.admitted
        row[QUOTA_DECISION + 1] = counters.denied + counters.denied_concurrency
        row[QUOTA_DECISION + 2] = counters.backend_error_rejected
        row[QUOTA_DECISION + 3] = counters.backend_error_allowed
        row[QUOTA_TOKENS] = counters.tokens_estimated
        row[QUOTA_TOKENS + 1] = counters.tokens_actual
        row[QUOTA_TOKENS + 2] = counters.tokens_refunded
        row[QUOTA_TOKENS + 3] = counters.tokens_overage
        row[QUOTA_BACKEND_ERRORS] = counters.backend_errors
        row[QUOTA_RECONCILE_DROPS] = counters.reconcile_drops + counters.reconcile_failures
        row[QUOTA_BREAKER] = counters.breaker_opened
        row[QUOTA_BREAKER + 1] = counters.breaker_closed

    def publish_panic(self, entries_by_cluster: dict[str, int]) -> None:
        """Copy each cluster balancer's panic-mode entry count (per process, monotonic)."""
        for name, entries in entries_by_cluster.items():
            index = self.cluster_index.get(name)
            if index is not None:
                self.row[PANIC_ENTRIES + index] = entries

    def overlay_reload(self, result: str) -> None:
        self.row[OVERLAY_RELOADS + OVERLAY_RESULTS.index(result)] += 1


class _StaticCollector:
    def __init__(self, families: list) -> None:
        self._families = families

    def collect(self) -> Iterable:
        return iter(self._families)


def render_prometheus(totals: list[int], cluster_names: Sequence[str]) -> bytes:
    """Prometheus text for the summed counters; ``cluster_names`` is the registry's (position = index)."""
    families: list = []
    requests = CounterMetricFamily(
        "gridgate_requests", "Requests answered, by provider cluster (or 'gateway') and status class.",
        labels=["cluster", "code"],
    )
    labels = [*enumerate(cluster_names[:MAX_CLUSTERS]), (GATEWAY_CLUSTER, "gateway"), (OTHER_CLUSTER, "other")]
    for c_index, name in labels:
        for k_index, klass in enumerate(STATUS_CLASSES):
            value = totals[REQUESTS + c_index * len(STATUS_CLASSES) + k_index]
            if value:
                requests.add_metric([name, klass], value)
    families.append(requests)
    errors = CounterMetricFamily("gridgate_gateway_errors", "Errors the gateway answered itself.", labels=["status"])
    for index, status in enumerate(GATEWAY_STATUSES):
        errors.add_metric([str(status)], totals[GATEWAY_ERRORS + index])
    families.append(errors)
    cumulative, buckets = 0, []
    for index, bound in enumerate((*OVERHEAD_BUCKETS_S, float("inf"))):
        cumulative += totals[OVERHEAD_BUCKETS + index]
        buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
    families.append(HistogramMetricFamily(
        "gridgate_overhead_seconds", "Gateway time from request bytes in to the upstream request written.",
        buckets=buckets, sum_value=totals[OVERHEAD_SUM_US] / 1e6,
    ))
    affinity = CounterMetricFamily("gridgate_affinity", "Session-affinity outcomes.", labels=["outcome"])
    for index, outcome in enumerate(AFFINITY_OUTCOMES):
        affinity.add_metric([outcome], totals[AFFINITY + index])
    families.append(affinity)
    families.append(CounterMetricFamily(
        "gridgate_upstream_retries", "Upstream attempts retried before the response started.",
        value=totals[RETRIES],
    ))
    decisions = CounterMetricFamily("gridgate_quota_decisions", "Token-quota admission decisions.", labels=["reason"])
    for index, reason in enumerate(QUOTA_DECISIONS):
        decisions.add_metric([reason], totals[QUOTA_DECISION + index])
    families.append(decisions)
    tokens = CounterMetricFamily("gridgate_quota_tokens", "Tokens by accounting kind.", labels=["kind"])
    for index, kind in enumerate(QUOTA_TOKEN_KINDS):
        tokens.add_metric([kind], totals[QUOTA_TOKENS + index])
    families.append(tokens)
    families.append(CounterMetricFamily(
        "gridgate_quota_backend_errors", "Quota backend (Valkey) errors.", value=totals[QUOTA_BACKEND_ERRORS],
    ))
    families.append(CounterMetricFamily(
        "gridgate_quota_reconcile_dropped", "Reconciliations dropped (queue full or retries exhausted).",
        value=totals[QUOTA_RECONCILE_DROPS],
    ))
    breaker = CounterMetricFamily("gridgate_quota_breaker_transitions",
                                  "Quota backend breaker transitions (open: policy applied without Valkey).",
                                  labels=["to"])
    breaker.add_metric(["open"], totals[QUOTA_BREAKER])
    breaker.add_metric(["closed"], totals[QUOTA_BREAKER + 1])
    families.append(breaker)
    reloads = CounterMetricFamily("gridgate_overlay_reloads", "Overlay reloads by result, summed over workers.",
                                  labels=["result"])
    for index, result in enumerate(OVERLAY_RESULTS):
        reloads.add_metric([result], totals[OVERLAY_RELOADS + index])
    families.append(reloads)
    panic = CounterMetricFamily("gridgate_panic_mode_entries",
                                "Times a cluster had no healthy endpoint and routed across all of them.",
                                labels=["cluster"])
    for c_index, name in enumerate(cluster_names[:MAX_CLUSTERS]):
        panic.add_metric([name], totals[PANIC_ENTRIES + c_index])
    families.append(panic)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StaticCollector(families))
    return generate_latest(registry)

