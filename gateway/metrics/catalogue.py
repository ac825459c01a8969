"""The metric catalogue: where each family lives in a worker's row of int64 cells.

Every process computes the same offsets from these constants, so a worker of any generation and the
supervisor that renders agree on what a cell means. Label sets are bounded: clusters by the
supervisor's cluster registry (``MAX_CLUSTERS`` names, the rest under ``other``), tenants by its
tenant registry (``MAX_TENANTS``), status codes by class, gateway errors and outcomes by fixed lists.
"""

from __future__ import annotations

from bisect import bisect_left

from gateway.config.models import FALLBACK_REASONS
from gateway.http.client_certs import REFUSAL_REASONS
from gateway.routing.eligibility import REASONS

MAX_CLUSTERS = 64
MAX_TENANTS = 128
STATUS_CLASSES = ("1xx", "2xx", "3xx", "4xx", "5xx")
GATEWAY_STATUSES = (400, 401, 403, 404, 405, 408, 413, 414, 422, 429, 431, 500, 501, 502, 503, 504, 505)
# Labels of gridgate_gateway_errors_total: the statuses above, then "other" for any other error status,
# so no error the gateway answers goes uncounted.
GATEWAY_ERROR_LABELS = (*(str(status) for status in GATEWAY_STATUSES), "other")
OVERHEAD_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)
# Upstream latency of relayed responses, at LLM scale: a first token may take a minute, a stream ten.
FIRST_BYTE_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DURATION_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
AFFINITY_OUTCOMES = ("none", "new", "reused", "failover")
# Prefix affinity (docs/routing.md): requests placed at their prefix's place or spilled past it, answers from
# the place that reported cached tokens or none, prefixes moved on (misses, slow first tokens).
PREFIX_EVENTS = ("placed", "spilled", "hit", "miss", "moved")
QUOTA_DECISIONS = ("admitted", "denied", "backend_error_rejected", "backend_error_allowed")
QUOTA_TOKEN_KINDS = ("estimated", "actual", "refunded", "overage")
OVERLAY_RESULTS = ("applied", "unchanged", "rejected")
# Why the eligibility filters removed candidates (the writer maps the router's reason bits to these).
FILTER_REASONS = tuple(name for _bit, name in REASONS)  # gateway.routing.eligibility
TOKEN_DIRECTIONS = ("in", "out")
# Fallback chains (docs/models.md): per (from, to) edge of the supervisor's edge registry, one cell per
# reason a request moved, then one for a model skipped (the tenant or key may not use it).
MAX_FALLBACK_EDGES = 256
FALLBACK_CELLS = (*FALLBACK_REASONS, "skipped")
OTHER_FALLBACK_EDGE = MAX_FALLBACK_EDGES  # every edge past the registry

# Cluster indexes: the registry's positions, then MAX_CLUSTERS for "answered by the gateway itself"
# and MAX_CLUSTERS + 1 for a cluster the registry had no room left for. Per-cluster families have a
# cell for each (the gateway's stays unused where it cannot apply).
GATEWAY_CLUSTER = MAX_CLUSTERS
OTHER_CLUSTER = MAX_CLUSTERS + 1
CLUSTER_SLOTS = MAX_CLUSTERS + 2
OTHER_TENANT = MAX_TENANTS  # tenant slot of every name past the registry (and of "other" itself)
TENANT_SLOTS = MAX_TENANTS + 1

# Inside one cluster's latency block: first-byte buckets (the last is +Inf) and their sum in
# microseconds, then the duration buckets and sum. The count is the +Inf bucket's cumulative value.
FIRST_BYTE_SUM_US = len(FIRST_BYTE_BUCKETS_S) + 1
DURATION = FIRST_BYTE_SUM_US + 1
DURATION_SUM_US = DURATION + len(DURATION_BUCKETS_S) + 1
LATENCY_STRIDE = DURATION_SUM_US + 1

# Offsets of each family inside a worker's row. Requests of cluster c, class k: REQUESTS + c*5 + k.
REQUESTS = 0
GATEWAY_ERRORS = REQUESTS + CLUSTER_SLOTS * len(STATUS_CLASSES)
OVERHEAD_BUCKETS = GATEWAY_ERRORS + len(GATEWAY_ERROR_LABELS)
OVERHEAD_SUM_US = OVERHEAD_BUCKETS + len(OVERHEAD_BUCKETS_S) + 1  # last bucket is +Inf
OVERHEAD_COUNT = OVERHEAD_SUM_US + 1
AFFINITY = OVERHEAD_COUNT + 1
RETRIES = AFFINITY + len(AFFINITY_OUTCOMES)
QUOTA_DECISION = RETRIES + 1
QUOTA_TOKENS = QUOTA_DECISION + len(QUOTA_DECISIONS)
QUOTA_BACKEND_ERRORS = QUOTA_TOKENS + len(QUOTA_TOKEN_KINDS)
QUOTA_RECONCILE_DROPS = QUOTA_BACKEND_ERRORS + 1
QUOTA_BREAKER = QUOTA_RECONCILE_DROPS + 1  # opened, closed
QUOTA_LEASES = QUOTA_BREAKER + 2  # blocks granted, requests admitted from blocks
QUOTA_SHADOW = QUOTA_LEASES + 2  # limits in shadow mode that would have refused a request
QUOTA_SPEND = QUOTA_SHADOW + 1  # refused by a hard USD budget; usages clamped to the worst case
OVERLAY_RELOADS = QUOTA_SPEND + 2
PANIC_ENTRIES = OVERLAY_RELOADS + len(OVERLAY_RESULTS)  # per registry cluster
PROVIDER_FAILOVERS = PANIC_ENTRIES + MAX_CLUSTERS  # per cluster index
PROVIDER_COOLED = PROVIDER_FAILOVERS + CLUSTER_SLOTS  # per cluster index
ENDPOINT_COOLED = PROVIDER_COOLED + CLUSTER_SLOTS  # per cluster index
ROUTE_FILTERED = ENDPOINT_COOLED + CLUSTER_SLOTS  # per FILTER_REASONS entry
ACCESS_LOG_DROPPED = ROUTE_FILTERED + len(FILTER_REASONS)
TRACE_SPANS_DROPPED = ACCESS_LOG_DROPPED + 1
TENANT_TOKENS = TRACE_SPANS_DROPPED + 1  # tenant slot t, direction d: TENANT_TOKENS + 2*t + d
UPSTREAM_LATENCY = TENANT_TOKENS + TENANT_SLOTS * len(TOKEN_DIRECTIONS)  # cluster c: + c*LATENCY_STRIDE
FALLBACKS = UPSTREAM_LATENCY + CLUSTER_SLOTS * LATENCY_STRIDE  # edge e, cell k: + e*len(FALLBACK_CELLS) + k
# The response cache (docs/cache.md): per tenant slot t, kind k (CACHE_KINDS): CACHE_TENANT + t*3 + k; then
# the requests that bypassed it and its Valkey's errors, process-wide.
CACHE_KINDS = ("hits", "misses", "saved_nanousd")
CACHE_TENANT = FALLBACKS + (MAX_FALLBACK_EDGES + 1) * len(FALLBACK_CELLS)
CACHE_BYPASSES = CACHE_TENANT + TENANT_SLOTS * len(CACHE_KINDS)
CACHE_BACKEND_ERRORS = CACHE_BYPASSES + 1
# Handshakes refused for their client certificate (mTLS, docs/identity.md), per REFUSAL_REASONS entry.
CLIENT_CERT_REFUSALS = CACHE_BACKEND_ERRORS + 1
PREFIX_AFFINITY = CLIENT_CERT_REFUSALS + len(REFUSAL_REASONS)  # per PREFIX_EVENTS entry
# JWT bearer tokens (docs/identity.md), per JWT_EVENTS entry: tokens whose limit claims were unusable (the
# config's limits applied), and the worker's waits on an unknown kid by how they ended.
JWT_EVENTS = ("limit_claims_ignored",)
JWT_COUNTS = PREFIX_AFFINITY + len(PREFIX_EVENTS)
COUNTERS = JWT_COUNTS + len(JWT_EVENTS)

_GATEWAY_STATUS_INDEX = {status: i for i, status in enumerate(GATEWAY_STATUSES)}


def request_cell(cluster_index: int, status: int) -> int:
    klass = min(max(status // 100, 1), 5) - 1
    return REQUESTS + cluster_index * len(STATUS_CLASSES) + klass


def gateway_error_cell(status: int) -> int | None:
    """The cell of an error status (>= 400) the gateway answered itself; None for a success."""
    if status < 400:
        return None
    return GATEWAY_ERRORS + _GATEWAY_STATUS_INDEX.get(status, len(GATEWAY_STATUSES))


def overhead_cell(seconds: float) -> int:
    """The bucket of ``seconds``: the first bound it does not exceed (Prometheus ``le``), else +Inf."""
    return OVERHEAD_BUCKETS + bisect_left(OVERHEAD_BUCKETS_S, seconds)


def latency_block(cluster_index: int) -> int:
    return UPSTREAM_LATENCY + cluster_index * LATENCY_STRIDE


def tenant_tokens_cell(tenant_slot: int, direction: int) -> int:
    return TENANT_TOKENS + tenant_slot * len(TOKEN_DIRECTIONS) + direction


def cache_cell(tenant_slot: int, kind: int) -> int:
    return CACHE_TENANT + tenant_slot * len(CACHE_KINDS) + kind


def fallback_cell(edge_index: int, cell: int) -> int:
    return FALLBACKS + edge_index * len(FALLBACK_CELLS) + cell


def fallback_edge_name(source: str, target: str) -> str:
    """The registry name of a (from, to) edge of the fallback metrics."""
    return f"{source}\x00{target}"
