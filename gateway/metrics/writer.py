"""A worker's writer over its own metrics row: every per-request method is a few integer additions
at precomputed offsets (``catalogue``), with no allocation."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

from gateway.http.client_certs import REFUSAL_REASONS
from gateway.metrics.catalogue import (
    ACCESS_LOG_DROPPED,
    AFFINITY,
    AFFINITY_OUTCOMES,
    CACHE_BACKEND_ERRORS,
    CACHE_BYPASSES,
    CACHE_TENANT,
    CLIENT_CERT_REFUSALS,
    DURATION,
    DURATION_BUCKETS_S,
    DURATION_SUM_US,
    ENDPOINT_COOLED,
    FALLBACK_CELLS,
    FILTER_REASONS,
    FIRST_BYTE_BUCKETS_S,
    FIRST_BYTE_SUM_US,
    GATEWAY_CLUSTER,
    JWT_COUNTS,
    JWT_EVENTS,
    MAX_CLUSTERS,
    MAX_FALLBACK_EDGES,
    MAX_TENANTS,
    OTHER_CLUSTER,
    OTHER_FALLBACK_EDGE,
    OTHER_TENANT,
    OVERHEAD_COUNT,
    OVERHEAD_SUM_US,
    OVERLAY_RELOADS,
    OVERLAY_RESULTS,
    PANIC_ENTRIES,
    PREFIX_AFFINITY,
    PROVIDER_COOLED,
    PROVIDER_FAILOVERS,
    QUOTA_BACKEND_ERRORS,
    QUOTA_BREAKER,
    QUOTA_DECISION,
    QUOTA_LEASES,
    QUOTA_RECONCILE_DROPS,
    QUOTA_SHADOW,
    QUOTA_SPEND,
    QUOTA_TOKENS,
    RETRIES,
    ROUTE_FILTERED,
    TENANT_TOKENS,
    TOKEN_DIRECTIONS,
    TRACE_SPANS_DROPPED,
    fallback_cell,
    fallback_edge_name,
    gateway_error_cell,
    latency_block,
    overhead_cell,
    request_cell,
)
from gateway.routing.eligibility import REASONS

# The router's reason bits (gateway.routing.eligibility) and the cell of each one's label.
_FILTER_CELLS = tuple((bit, ROUTE_FILTERED + FILTER_REASONS.index(name)) for bit, name in REASONS)

_AFFINITY_CELLS = {outcome: AFFINITY + i for i, outcome in enumerate(AFFINITY_OUTCOMES)}
_FALLBACK_CELL = {name: i for i, name in enumerate(FALLBACK_CELLS)}
_GATEWAY_OK = request_cell(GATEWAY_CLUSTER, 200)  # a request the gateway answered 200 itself (a cache hit)


class WorkerMetrics:
    """A worker's writer over its own row."""

    __slots__ = ("row", "cluster_index", "tenant_index", "fallback_index")

    def __init__(self, row: memoryview | list[int], cluster_names: Sequence[str],
                 tenant_names: Sequence[str] = (), fallback_edges: Sequence[str] = ()) -> None:
        """``cluster_names``/``tenant_names``/``fallback_edges``: the supervisor's registries (position =
        index), e.g. ``WorkerContext.metric_clusters``, ``metric_tenants`` and ``metric_fallbacks``."""
        self.row = row
        self.cluster_index = {name: i for i, name in enumerate(cluster_names[:MAX_CLUSTERS])}
        self.tenant_index = {name: i for i, name in enumerate(tenant_names[:MAX_TENANTS])}
        self.fallback_index = {name: i for i, name in enumerate(fallback_edges[:MAX_FALLBACK_EDGES])}

    # -- per request ----------------------------------------------------------------------------
    def hit_answered(self, tenant: str | None, saved_nusd: int | None) -> None:
        """A response cache hit answered (a 200 the gateway gave itself: no provider): ``cache_hit`` and
        ``request(None, 200)`` in one step (workers/outcomes.py ``HitEnds`` counts no request then)."""
        at = CACHE_TENANT + self.tenant_index.get(tenant or "", OTHER_TENANT) * 3  # type: ignore[arg-type]
        row = self.row
        row[at] += 1
        row[_GATEWAY_OK] += 1
        if saved_nusd:
            row[at + 2] += saved_nusd

    def cache_miss(self, tenant: str | None) -> None:
        self.row[CACHE_TENANT + self.tenant_index.get(tenant or "", OTHER_TENANT) * 3 + 1] += 1

    def cache_bypass(self) -> None:
        self.row[CACHE_BYPASSES] += 1

    def cache_backend_error(self) -> None:
        self.row[CACHE_BACKEND_ERRORS] += 1

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

    def upstream_latency(self, cluster: str, first_byte_s: float, duration_s: float) -> None:
        """One relayed response: request written -> response head, and -> response end."""
        row = self.row
        block = latency_block(self.cluster_index.get(cluster, OTHER_CLUSTER))
        row[block + bisect_left(FIRST_BYTE_BUCKETS_S, first_byte_s)] += 1
        row[block + FIRST_BYTE_SUM_US] += int(first_byte_s * 1e6)
        row[block + DURATION + bisect_left(DURATION_BUCKETS_S, duration_s)] += 1
        row[block + DURATION_SUM_US] += int(duration_s * 1e6)

    def affinity(self, outcome: str) -> None:
        self.row[_AFFINITY_CELLS[outcome]] += 1

    def prefix_event(self, event: int) -> None:
        """Prefix affinity's ``event`` (an index of ``PREFIX_EVENTS``)."""
        self.row[PREFIX_AFFINITY + event] += 1

    def retry(self) -> None:
        """Another endpoint (or a fresh connection) of the same provider tried after a failure."""
        self.row[RETRIES] += 1

    def failover(self, cluster: str) -> None:
        """A request moved away from this cluster's provider to another one."""
        self.row[PROVIDER_FAILOVERS + self.cluster_index.get(cluster, OTHER_CLUSTER)] += 1

    def cooled(self, cluster: str) -> None:
        """This cluster's provider was cooled (a 429/503 spoke for the whole provider, or left it no endpoint
        that is not cooled) and is skipped for a while."""
        self.row[PROVIDER_COOLED + self.cluster_index.get(cluster, OTHER_CLUSTER)] += 1

    def endpoint_cooled(self, cluster: str) -> None:
        """An endpoint of this cluster answered 429/503 and is left out for a while."""
        self.row[ENDPOINT_COOLED + self.cluster_index.get(cluster, OTHER_CLUSTER)] += 1

    def route_filtered(self, reasons: int) -> None:
        """The eligibility filters removed candidates of one request; ``reasons``: the router's bits."""
        row = self.row
        for bit, cell in _FILTER_CELLS:
            if reasons & bit:
                row[cell] += 1

    def fallback(self, source: str, target: str, reason: str) -> None:
        """A request moved along its fallback chain from model ``source`` to ``target`` for ``reason``."""
        edge = self.fallback_index.get(fallback_edge_name(source, target), OTHER_FALLBACK_EDGE)
        self.row[fallback_cell(edge, _FALLBACK_CELL[reason])] += 1

    def fallback_skipped(self, source: str, target: str) -> None:
        """A chain model was skipped after ``source``: the tenant or key may not use ``target``."""
        edge = self.fallback_index.get(fallback_edge_name(source, target), OTHER_FALLBACK_EDGE)
        self.row[fallback_cell(edge, _FALLBACK_CELL["skipped"])] += 1

    def overlay_reload(self, result: str) -> None:
        self.row[OVERLAY_RELOADS + OVERLAY_RESULTS.index(result)] += 1

    # -- published from the heartbeat (per-process monotonic counters, copied) --------------------
    def publish_quota(self, counters: Any) -> None:
        """Copy the quota gate's monotonic per-worker counters (gateway.quota.counters.QuotaCounters)."""
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
        row[QUOTA_LEASES] = counters.leases_granted
        row[QUOTA_LEASES + 1] = counters.leased
        row[QUOTA_SHADOW] = counters.shadow_refusals
        row[QUOTA_SPEND] = counters.denied_budget
        row[QUOTA_SPEND + 1] = counters.spend_usage_clamped

    def publish_tenant_tokens(self, tokens: Any) -> None:
        """Copy the quota gate's per-tenant tokens (gateway.quota.counters.TenantTokens) into the
        registry's tenant slots. The gate's names are its own config's, and the managed keys' tenants it
        learned with their index; a name the registry has no slot for (and ``other`` itself) adds up
        under ``other``."""
        directions = len(TOKEN_DIRECTIONS)
        # The cells of the gate's names only (slot t, direction d at TENANT_TOKENS + t*2 + d), summed: not
        # a pass over every slot of the registry, once a second.
        per_cell: dict[int, int] = {}
        index, learned = self.tenant_index, tokens.learned
        tokens_in, tokens_out = tokens.tokens_in, tokens.tokens_out
        for position, name in enumerate(tokens.names):
            at = TENANT_TOKENS + index.get(name, learned.get(name, OTHER_TENANT)) * directions
            per_cell[at] = per_cell.get(at, 0) + tokens_in[position]
            per_cell[at + 1] = per_cell.get(at + 1, 0) + tokens_out[position]
        row = self.row
        for cell, value in per_cell.items():
            if value:  # every cell only grows: a zero has nothing to overwrite
                row[cell] = value

    def publish_panic(self, entries_by_cluster: dict[str, int]) -> None:
        """Copy each cluster balancer's panic-mode entry count (per process, monotonic)."""
        for name, entries in entries_by_cluster.items():
            index = self.cluster_index.get(name)
            if index is not None:
                self.row[PANIC_ENTRIES + index] = entries

    def publish_access_log(self, dropped: int) -> None:
        """Access-log lines lost so far (buffer full or output failing)."""
        self.row[ACCESS_LOG_DROPPED] = dropped

    def publish_client_cert_refusals(self, counts: dict[str, int]) -> None:
        """Handshakes refused for their client certificate so far, per reason (mTLS)."""
        for index, reason in enumerate(REFUSAL_REASONS):
            self.row[CLIENT_CERT_REFUSALS + index] = counts[reason]

    def publish_jwt_counts(self, counts: dict[str, int]) -> None:
        """The JWT gate's counts so far (per process, monotonic), per ``JWT_EVENTS`` entry."""
        for index, event in enumerate(JWT_EVENTS):
            self.row[JWT_COUNTS + index] = counts.get(event, 0)

    def publish_trace_drops(self, dropped: int) -> None:
        """Trace spans lost so far (export queue full, or their export failed: docs/tracing.md)."""
        self.row[TRACE_SPANS_DROPPED] = dropped
