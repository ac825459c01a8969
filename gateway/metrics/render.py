"""Summed worker rows -> Prometheus text, with ``prometheus_client``'s exposition code (supervisor side)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import CollectorRegistry

from gateway.http.client_certs import REFUSAL_REASONS
from gateway.metrics.catalogue import (
    ACCESS_LOG_DROPPED,
    AFFINITY,
    AFFINITY_OUTCOMES,
    CACHE_BACKEND_ERRORS,
    CACHE_BYPASSES,
    CACHE_KINDS,
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
    GATEWAY_ERROR_LABELS,
    GATEWAY_ERRORS,
    JWT_COUNTS,
    JWT_EVENTS,
    MAX_CLUSTERS,
    MAX_FALLBACK_EDGES,
    MAX_TENANTS,
    OTHER_CLUSTER,
    OTHER_TENANT,
    OVERHEAD_BUCKETS,
    OVERHEAD_BUCKETS_S,
    OVERHEAD_SUM_US,
    OVERLAY_RELOADS,
    OVERLAY_RESULTS,
    PANIC_ENTRIES,
    PREFIX_AFFINITY,
    PREFIX_EVENTS,
    PROVIDER_COOLED,
    PROVIDER_FAILOVERS,
    QUOTA_BACKEND_ERRORS,
    QUOTA_BREAKER,
    QUOTA_DECISION,
    QUOTA_DECISIONS,
    QUOTA_LEASES,
    QUOTA_RECONCILE_DROPS,
    QUOTA_SHADOW,
    QUOTA_SPEND,
    QUOTA_TOKEN_KINDS,
    QUOTA_TOKENS,
    REQUESTS,
    RETRIES,
    ROUTE_FILTERED,
    STATUS_CLASSES,
    TOKEN_DIRECTIONS,
    TRACE_SPANS_DROPPED,
    cache_cell,
    fallback_cell,
    latency_block,
    tenant_tokens_cell,
)

OTHER = "other"


class _StaticCollector:
    def __init__(self, families: list) -> None:
        self._families = families

    def collect(self) -> Iterable:
        return iter(self._families)


def _buckets(counts: Sequence[int], bounds: Sequence[float]) -> list[tuple[str, int]]:
    """Per-bucket counts (the last one +Inf) -> Prometheus' cumulative ``le`` buckets."""
    cumulative, buckets = 0, []
    for count, bound in zip(counts, (*bounds, float("inf")), strict=True):
        cumulative += count
        buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
    return buckets


def _clusters(cluster_names: Sequence[str]) -> list[tuple[int, str]]:
    """(index, label) of every per-cluster cell that can hold provider counts."""
    return [*enumerate(cluster_names[:MAX_CLUSTERS]), (OTHER_CLUSTER, OTHER)]


def _request_families(totals: list[int], cluster_names: Sequence[str]) -> Iterator:
    requests = CounterMetricFamily(
        "gridgate_requests", "Requests answered, by provider cluster (or 'gateway') and status class.",
        labels=["cluster", "code"],
    )
    for c_index, name in [*_clusters(cluster_names), (GATEWAY_CLUSTER, "gateway")]:
        for k_index, klass in enumerate(STATUS_CLASSES):
            value = totals[REQUESTS + c_index * len(STATUS_CLASSES) + k_index]
            if value:
                requests.add_metric([name, klass], value)
    yield requests
    errors = CounterMetricFamily("gridgate_gateway_errors", "Errors the gateway answered itself.", labels=["status"])
    for index, label in enumerate(GATEWAY_ERROR_LABELS):
        errors.add_metric([label], totals[GATEWAY_ERRORS + index])
    yield errors
    overhead_counts = totals[OVERHEAD_BUCKETS:OVERHEAD_BUCKETS + len(OVERHEAD_BUCKETS_S) + 1]
    yield HistogramMetricFamily(
        "gridgate_overhead_seconds", "Gateway time from request bytes in to the upstream request written.",
        buckets=_buckets(overhead_counts, OVERHEAD_BUCKETS_S), sum_value=totals[OVERHEAD_SUM_US] / 1e6,
    )
    affinity = CounterMetricFamily("gridgate_affinity", "Session-affinity outcomes.", labels=["outcome"])
    for index, outcome in enumerate(AFFINITY_OUTCOMES):
        affinity.add_metric([outcome], totals[AFFINITY + index])
    yield affinity
    prefix = CounterMetricFamily("gridgate_prefix_affinity", "Prefix affinity: requests placed or spilled, "
                                 "answers that hit or missed the provider's prompt cache, prefixes moved on.",
                                 labels=["event"])
    for index, event in enumerate(PREFIX_EVENTS):
        prefix.add_metric([event], totals[PREFIX_AFFINITY + index])
    yield prefix


def _upstream_families(totals: list[int], cluster_names: Sequence[str]) -> Iterator:
    first_byte = HistogramMetricFamily(
        "gridgate_upstream_first_byte_seconds",
        "Relayed responses: time from the request written upstream to the response head.", labels=["cluster"],
    )
    duration = HistogramMetricFamily(
        "gridgate_upstream_duration_seconds",
        "Relayed responses: time from the request written upstream to the response end.", labels=["cluster"],
    )
    for c_index, name in _clusters(cluster_names):
        block = latency_block(c_index)
        first_counts = totals[block:block + FIRST_BYTE_SUM_US]
        if not any(first_counts):
            continue  # no response relayed for this cluster yet
        first_byte.add_metric([name], _buckets(first_counts, FIRST_BYTE_BUCKETS_S),
                              totals[block + FIRST_BYTE_SUM_US] / 1e6)
        duration.add_metric([name], _buckets(totals[block + DURATION:block + DURATION_SUM_US], DURATION_BUCKETS_S),
                            totals[block + DURATION_SUM_US] / 1e6)
    yield first_byte
    yield duration
    yield CounterMetricFamily(
        "gridgate_upstream_retries",
        "Endpoint-level retries: another endpoint (or a fresh connection) of the same provider tried after a "
        "connect failure or a failure before the response head.",
        value=totals[RETRIES],
    )
    for name, cell, documentation in (
        ("gridgate_provider_failovers", PROVIDER_FAILOVERS,
         "Requests moved away from this provider to another one before any response byte reached the client."),
        ("gridgate_provider_cooled", PROVIDER_COOLED,
         "Times this provider was cooled: a 429/503 that spoke for the whole provider, or left no endpoint."),
        ("gridgate_endpoint_cooled", ENDPOINT_COOLED, "Times an endpoint of this cluster answered 429/503 and was cooled."),
    ):
        family = CounterMetricFamily(name, documentation, labels=["cluster"])
        for c_index, label in _clusters(cluster_names):
            value = totals[cell + c_index]
            if value or c_index != OTHER_CLUSTER:
                family.add_metric([label], value)
        yield family
    filtered = CounterMetricFamily(
        "gridgate_route_filtered",
        "Requests whose eligibility filters removed candidates, by reason (one request may count under several).",
        labels=["reason"],
    )
    for index, reason in enumerate(FILTER_REASONS):
        filtered.add_metric([reason], totals[ROUTE_FILTERED + index])
    yield filtered
    panic = CounterMetricFamily("gridgate_panic_mode_entries",
                                "Times a cluster had no healthy endpoint and routed across all of them.",
                                labels=["cluster"])
    for c_index, name in enumerate(cluster_names[:MAX_CLUSTERS]):
        panic.add_metric([name], totals[PANIC_ENTRIES + c_index])
    yield panic


def _quota_families(totals: list[int], tenant_names: Sequence[str]) -> Iterator:
    decisions = CounterMetricFamily("gridgate_quota_decisions", "Token-quota admission decisions.", labels=["reason"])
    for index, reason in enumerate(QUOTA_DECISIONS):
        decisions.add_metric([reason], totals[QUOTA_DECISION + index])
    yield decisions
    tokens = CounterMetricFamily("gridgate_quota_tokens", "Tokens by accounting kind.", labels=["kind"])
    for index, kind in enumerate(QUOTA_TOKEN_KINDS):
        tokens.add_metric([kind], totals[QUOTA_TOKENS + index])
    yield tokens
    tenant_tokens = CounterMetricFamily(
        "gridgate_tenant_tokens",
        "Tokens the providers reported for quota-metered responses, per tenant: in (prompt) and out (completion).",
        labels=["tenant", "direction"],
    )
    for slot, tenant in [*enumerate(tenant_names[:MAX_TENANTS]), (OTHER_TENANT, OTHER)]:
        for direction, label in enumerate(TOKEN_DIRECTIONS):
            tenant_tokens.add_metric([tenant, label], totals[tenant_tokens_cell(slot, direction)])
    yield tenant_tokens
    yield CounterMetricFamily(
        "gridgate_quota_backend_errors", "Quota backend (Valkey) errors.", value=totals[QUOTA_BACKEND_ERRORS],
    )
    yield CounterMetricFamily(
        "gridgate_quota_reconcile_dropped", "Reconciliations dropped (queue full or retries exhausted).",
        value=totals[QUOTA_RECONCILE_DROPS],
    )
    breaker = CounterMetricFamily("gridgate_quota_breaker_transitions",
                                  "Quota backend breaker transitions (open: policy applied without Valkey).",
                                  labels=["to"])
    breaker.add_metric(["open"], totals[QUOTA_BREAKER])
    breaker.add_metric(["closed"], totals[QUOTA_BREAKER + 1])
    yield breaker
    leases = CounterMetricFamily("gridgate_quota_leases",
                                 "Worker-held token blocks (quota.lease): granted, and requests admitted from them.",
                                 labels=["event"])
    leases.add_metric(["granted"], totals[QUOTA_LEASES])
    leases.add_metric(["admitted"], totals[QUOTA_LEASES + 1])
    yield leases
    yield CounterMetricFamily(
        "gridgate_quota_shadow_refusals", "Limits marked shadow that would have refused a request (docs/limits.md).",
        value=totals[QUOTA_SHADOW],
    )
    yield CounterMetricFamily(
        "gridgate_quota_budget_refusals", "Requests refused by a hard USD budget (429 budget_exceeded; docs/limits.md).",
        value=totals[QUOTA_SPEND],
    )
    yield CounterMetricFamily(
        "gridgate_spend_usage_clamped", "Reported usages charged the worst case instead: not an integer, negative, "
        "or over 10 times the reservation (docs/pricing.md).", value=totals[QUOTA_SPEND + 1],
    )


def _process_families(totals: list[int]) -> Iterator:
    reloads = CounterMetricFamily("gridgate_overlay_reloads", "Overlay reloads by result, summed over workers.",
                                  labels=["result"])
    for index, result in enumerate(OVERLAY_RESULTS):
        reloads.add_metric([result], totals[OVERLAY_RELOADS + index])
    yield reloads
    yield CounterMetricFamily(
        "gridgate_access_log_dropped", "Access-log lines dropped (buffer full or output failing), never blocking.",
        value=totals[ACCESS_LOG_DROPPED],
    )
    yield CounterMetricFamily(
        "gridgate_trace_spans_dropped", "Trace spans dropped (export queue full or export failed), never blocking.",
        value=totals[TRACE_SPANS_DROPPED],
    )
    refused = CounterMetricFamily("gridgate_client_cert_refusals", "TLS handshakes refused for their client "
                                  "certificate (server_tls.client_auth), by reason.", labels=["reason"])
    for index, reason in enumerate(REFUSAL_REASONS):
        refused.add_metric([reason], totals[CLIENT_CERT_REFUSALS + index])
    yield refused
    jwt = dict(zip(JWT_EVENTS, totals[JWT_COUNTS:JWT_COUNTS + len(JWT_EVENTS)], strict=True))
    yield CounterMetricFamily(
        "gridgate_jwt_limit_claims_ignored", "JWTs whose limits_from_claims values were unusable (not a whole "
        "number within bounds): the configured limits applied.", value=jwt["limit_claims_ignored"])


def _cache_families(totals: list[int], tenant_names: Sequence[str]) -> Iterator:
    """The response cache (docs/cache.md): hits, misses and the nano-USD hits saved, per tenant (only the
    tenants that counted something), then the requests that bypassed it and its Valkey's errors."""
    helps = {"hits": "Requests answered from the response cache (no provider, no tokens, cost 0).",
             "misses": "Cacheable requests the response cache did not hold (sent to a provider).",
             "saved_nanousd": "Nano-USD the response cache's hits saved: the cost of each entry's answer when made."}
    families = {kind: CounterMetricFamily(f"gridgate_cache_{kind}", helps[kind], labels=["tenant"])
                for kind in CACHE_KINDS}
    for slot, tenant in [*enumerate(tenant_names[:MAX_TENANTS]), (OTHER_TENANT, OTHER)]:
        for index, kind in enumerate(CACHE_KINDS):
            value = totals[cache_cell(slot, index)]
            if value:
                families[kind].add_metric([tenant], value)
    yield from families.values()
    yield CounterMetricFamily("gridgate_cache_bypasses", "Requests that did not use the response cache (not "
                              "cacheable, no-store or bypass asked, its Valkey failing).", value=totals[CACHE_BYPASSES])
    yield CounterMetricFamily("gridgate_cache_backend_errors", "Failed calls to the response cache's Valkey "
                              "(the cache is bypassed meanwhile, never an error).", value=totals[CACHE_BACKEND_ERRORS])


def _fallback_families(totals: list[int], edge_names: Sequence[str]) -> Iterator:
    """Fallback chains (docs/models.md): moves per (from, to, reason) and skipped models per (from, to);
    only edges that counted something are shown (a chain of n models has n*(n-1)/2 possible edges)."""
    moved = CounterMetricFamily("gridgate_fallbacks", "Requests moved to the next model of their fallback chain.",
                                labels=["from", "to", "reason"])
    skipped = CounterMetricFamily("gridgate_fallback_skipped", "Chain models skipped: the tenant or the key may "
                                  "not use them.", labels=["from", "to"])
    edges = [*((i, *name.split("\x00", 1)) for i, name in enumerate(edge_names[:MAX_FALLBACK_EDGES])),
             (MAX_FALLBACK_EDGES, OTHER, OTHER)]
    for index, source, target in edges:
        for cell, reason in enumerate(FALLBACK_CELLS):
            value = totals[fallback_cell(index, cell)]
            if not value:
                continue
            if reason == "skipped":
                skipped.add_metric([source, target], value)
            else:
                moved.add_metric([source, target, reason], value)
    yield moved
    yield skipped


def render_prometheus(totals: list[int], cluster_names: Sequence[str], tenant_names: Sequence[str] = (),
                      fallback_edges: Sequence[str] = ()) -> bytes:
    """Prometheus text for the summed counters; ``cluster_names``/``tenant_names``/``fallback_edges`` are
    the supervisor's registries (position = index), the ones the workers index by."""
    families = [
        *_request_families(totals, cluster_names),
        *_upstream_families(totals, cluster_names),
        *_quota_families(totals, tenant_names),
        *_process_families(totals),
        *_fallback_families(totals, fallback_edges),
        *_cache_families(totals, tenant_names),
    ]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StaticCollector(families))
    return generate_latest(registry)
