"""A worker's request path, built once and in one place: ``RequestPath.build`` makes every part a
request goes through (metrics writer, overlay follower, clusters and their pools, provider states,
router, quota gate, access log, head gate, outcomes, proxy) from the worker's context, on the running
event loop (pools, the quota client and the log writer belong to it). Nothing is optional once built,
and nothing calls back into the worker. ``server_state`` wires it under a client-facing server: the
worker serves it on its socket; tests drive it in one process.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass

from gateway.config import Config, PrefixAffinity
from gateway.host_segment import CONFORMANCE_REGION, MAX_PROVIDERS, PREFIXES_REGION, PROVIDERS_REGION
from gateway.identity.auth import Authenticator
from gateway.identity.client_cert import CertificateTenants
from gateway.keys.lookup import KeyLookup
from gateway.metrics.catalogue import COUNTERS
from gateway.metrics.writer import WorkerMetrics
from gateway.models.aliases import fallback_edges
from gateway.pricing.table import shipped_table
from gateway.process_protocol import WorkerContext
from gateway.quota.counters import configured_tenants
from gateway.quota.gate import QuotaGate
from gateway.quota.ledger import QuotaLedger
from gateway.request.cors import CorsPolicy
from gateway.request.headers import HeaderPlan
from gateway.request.routes import RouteTable
from gateway.routing import Router
from gateway.routing.eligibility import FactsTable
from gateway.routing.prefix import PrefixTable
from gateway.routing.prefix_shared import SharedPrefixTable
from gateway.routing.tenants import TenantPolicies
from gateway.spend.price_book import PriceBook
from gateway.valkey.client import create_client
from shm.affinity import AffinityTable
from shm.conformance import ConformanceFlags
from shm.counters import WorkerRow
from shm.keys import KeyTable
from shm.metrics import MetricsTable
from shm.prefixes import PrefixCells
from shm.providers import EndpointCooling, ProviderCells
from shm.segment import Segment
from workers.access_log import AccessLog
from workers.cert_gate import ConnectionCertificates
from workers.clusters import ClusterManager
from workers.cors_gate import CorsGate
from workers.head_gate import HeadGate
from workers.jwt_gate import JwtGate
from workers.key_gate import ManagedKeyGate
from workers.outcomes import Outcomes
from workers.overlay_follower import OverlayFollower
from workers.providers import ProviderStates
from workers.proxy import Proxy
from workers.proxy_settings import ProxySettings
from workers.recent_requests import RequestRing
from workers.response_cache import ResponseCache
from workers.server_state import ServerSettings, ServerState
from workers.spend_tracker import SpendTracker
from workers.tracing import TRACE_HEADERS, Tracer

log = logging.getLogger("gridgate.worker")


def provider_indexes(registry: tuple[str, ...], configured: list[str]) -> dict[str, int]:
    """Each configured cluster's provider index: its stable registry index (shared-memory cells keep their
    meaning across reloads), or, past the registry's capacity, a local index beyond the shared cells."""
    index = {name: position for position, name in enumerate(registry) if name in configured}
    extra = MAX_PROVIDERS
    for name in configured:
        if name not in index:
            index[name] = extra
            extra += 1
    return index



def _provider_states(config: Config, segment: Segment, row: WorkerRow, provider_index: dict[str, int],
                     clusters: ClusterManager) -> ProviderStates:
    """The worker's provider view over shared memory: cooling, latency, and (with routing.conformance) the
    supervisor's nonconformant providers."""
    routing = config.routing
    least_loaded = routing.least_loaded
    providers = ProviderStates(
        ProviderCells(segment.region(PROVIDERS_REGION), segment.max_workers, MAX_PROVIDERS),
        row.index, segment.rows_in_use, max(provider_index.values(), default=-1) + 1,
        clusters.routable, clusters.inflight, half_life=float(least_loaded.latency_half_life),
        latency_prior=None if least_loaded.latency_prior is None else float(least_loaded.latency_prior),
        endpoint_cooling=EndpointCooling(segment, row.index),
        conformance=None if routing.conformance is None else
        ConformanceFlags(segment.region(CONFORMANCE_REGION), MAX_PROVIDERS),
    )
    for cluster in clusters.by_provider.values():  # 429/503 cool these first (workers/providers.py)
        providers.set_endpoints(cluster.provider, cluster.endpoints)
    return providers

def report_unconfigured(clusters: list[str]) -> None:
    if clusters:
        log.warning("overlay names clusters this gateway does not have (never selected): %s", ", ".join(clusters))


@dataclass(frozen=True, slots=True)
class RequestPath:
    """Every part of one worker's request path."""

    config: Config
    metrics: WorkerMetrics
    overlay: OverlayFollower
    clusters: ClusterManager
    providers: ProviderStates
    router: Router
    quota: QuotaGate | None
    access_log: AccessLog
    head_gate: HeadGate
    outcomes: Outcomes
    proxy: Proxy
    tracer: Tracer | None = None  # tracing configured (docs/tracing.md)
    spend: SpendTracker | None = None  # rollups, spend metrics, alerts (docs/pricing.md)
    cache: ResponseCache | None = None  # the response cache (docs/cache.md)
    recent: RequestRing | None = None  # the console's last requests, with admin.tokens (docs/console.md)
    status_fd: int = -1

    @classmethod
    async def build(cls, ctx: WorkerContext, segment: Segment, row: WorkerRow) -> RequestPath:
        """The request path of the worker ``ctx`` describes, over its shared-memory ``row``. Raises
        OSError when the access log cannot be opened."""
        config = ctx.config
        metrics = _metrics_writer(ctx, segment, row)
        overlay = OverlayFollower(config, ctx.overlay_fallback)
        configured = [cluster.name for cluster in config.clusters]
        provider_index = provider_indexes(ctx.metric_clusters or tuple(configured), configured)
        clusters = ClusterManager(config, segment, row, provider_index)
        routing = config.routing
        providers = _provider_states(config, segment, row, provider_index, clusters)
        router = Router(
            max(ctx.slot, 0), affinity=_affinity_table(ctx, segment),
            affinity_ttl_s=float(routing.session_affinity.ttl), provider_index=provider_index,
            providers=providers.view, picker=routing.picker, facts=FactsTable(routing.models),
            prefixes=prefix_table(routing.prefix_affinity, segment, row.index),
        )
        report_unconfigured(router.prepare(overlay.snapshot))
        # One price book per worker (docs/pricing.md): what a request costs when it ends, the worst case a
        # hard USD budget reserves at admission, and whether an unpriced model may be asked for at all.
        prices = PriceBook.from_config(config.pricing, shipped_table())
        quota = await _quota_gate(ctx, prices)
        access_log = AccessLog.from_config(config)
        settings = ProxySettings.from_config(config)
        spend = SpendTracker.from_config(config, ctx.status_fd if ctx.status_fd >= 0 else None, ctx.spend_url,
                                         prices)
        spend.access_log = access_log
        outcomes = Outcomes(quota, metrics, access_log, providers, settings.cooling, settings.route_headers, prices,
                            spend)
        outcomes.prefixes = router.prefixes
        tracer = Tracer.from_config(config)
        cache = config.cache
        response_cache = (ResponseCache.from_config(cache, ctx.quota_url, metrics, ctx.cache_index, ctx.slot)
                          if cache is not None and cache.enabled else None)
        proxy = Proxy(settings=settings, tenants=TenantPolicies(config.tenants), overlay=overlay, router=router,
                      clusters=clusters, providers=providers, quota=quota, metrics=metrics, outcomes=outcomes,
                      tracer=tracer, cache=response_cache)
        recent = outcomes.recent = RequestRing() if config.admin.tokens and ctx.status_fd >= 0 else None
        return cls(config, metrics, overlay, clusters, providers, router, quota, access_log,
                   _head_gate(config, clusters, settings, provider_index, ctx.key_table,
                              ctx.status_fd if ctx.status_fd >= 0 else None), outcomes, proxy, tracer,
                   spend, response_cache, recent, ctx.status_fd)

    def server_state(self) -> ServerState:
        """The per-worker server state that hands this path every request: the head gate decides on each
        head, the proxy answers, and requests refused before it end in ``Outcomes.rejected``."""
        state = ServerState(ServerSettings(self.config), self.proxy.handle)
        state.on_reject = self.outcomes.rejected
        state.head_gate = self.head_gate  # key and route decided on the head, before any body is read
        cors = CorsPolicy.from_config(self.config.cors)
        if cors is not None:  # browser clients: preflights answered before the key is checked
            state.head_gate = CorsGate(cors, self.head_gate, self.head_gate.ids.next)
            state.cors = cors
        return state

    def publish_counters(self) -> None:
        """Copy the per-process counters (quota, tenant tokens, panic, access-log drops) into the row."""
        metrics = self.metrics
        if self.quota is not None:
            metrics.publish_quota(self.quota.counters)
            metrics.publish_tenant_tokens(self.quota.tenant_tokens)
        metrics.publish_panic(self.clusters.panic_entries())
        metrics.publish_access_log(self.access_log.dropped)
        if self.tracer is not None:
            metrics.publish_trace_drops(self.tracer.exporter.dropped)
        if self.spend is not None:  # rollups to the store, spend counters and alerts to the supervisor
            self.spend.tick()
        if self.recent is not None:  # the last requests, to the supervisor for the console
            self.recent.report(self.status_fd)

    async def close(self) -> None:
        """Pools, the quota gate (its queued settlements first) and the access log (its last lines)."""
        self.clusters.close()
        if self.quota is not None:
            await self.quota.close()
        if self.cache is not None:  # its stores in progress (bounded wait)
            await self.cache.close()
        await self.access_log.close()
        if self.spend is not None:  # the last rollups (bounded wait)
            await self.spend.close()
        if self.tracer is not None:  # its queued spans go out first (bounded by the export timeout)
            await asyncio.get_running_loop().run_in_executor(None, self.tracer.exporter.close)
        self.publish_counters()  # the last settlements and log lines, before the row is retired


def _metrics_writer(ctx: WorkerContext, segment: Segment, row: WorkerRow) -> WorkerMetrics:
    config = ctx.config
    clusters = ctx.metric_clusters or [cluster.name for cluster in config.clusters]
    tenants = ctx.metric_tenants or configured_tenants(config)
    table = MetricsTable(segment.region(ctx.metrics_region), segment.max_workers, COUNTERS)
    fallbacks = ctx.metric_fallbacks or fallback_edges(config.models)
    return WorkerMetrics(table.row(row.index), clusters, tenants, fallbacks)


def _affinity_table(ctx: WorkerContext, segment: Segment) -> AffinityTable | None:
    if not ctx.config.routing.session_affinity.enabled:
        return None
    return AffinityTable(segment.region(ctx.affinity_region), ctx.affinity_capacity)


async def _quota_gate(ctx: WorkerContext, prices: PriceBook) -> QuotaGate | None:
    quota = ctx.config.quota
    if quota is None or not ctx.quota_url:
        return None
    ledger = QuotaLedger(create_client(ctx.quota_url), reservation_timeout_s=float(quota.reservation_timeout))
    gate = QuotaGate.from_config(ledger, ctx.config, generation=ctx.generation, slot=ctx.slot, prices=prices)
    await gate.start()
    return gate


def prefix_table(prefix: PrefixAffinity, segment: Segment | None = None, worker: int = 0) -> PrefixTable | None:
    """Prefix affinity's placements (None: off): over the host's shared cells (gateway/routing/prefix_shared.py),
    a prefix's requests in flight counted across the host against its share of a provider's capacity;
    without a segment (a unit's own table), this worker's alone."""
    if not prefix.enabled:
        return None
    share = math.ceil(prefix.spill_at * prefix.capacity)
    slow = None if prefix.slow_first_token is None else float(prefix.slow_first_token)
    if segment is None:
        return PrefixTable(prefix.table_size, share, prefix.misses, slow)
    cells = PrefixCells.attach(segment.region(PREFIXES_REGION))
    return SharedPrefixTable(cells, worker, segment.rows_in_use, share, prefix.misses, slow)


def _head_gate(config: Config, clusters: ClusterManager, settings: ProxySettings,
               provider_index: dict[str, int], key_table: KeyTable | None = None,
               status_fd: int | None = None) -> HeadGate:
    routing = config.routing
    header_plan = HeaderPlan(
        routing.model_header,
        # Scanned for affinity, and for a stable_hash key that names the session (affinity on or not).
        session_header=routing.session_affinity.header if settings.session_fact else None,
        pin_header=routing.pin_header,
        # With tracing on, the scan also captures the W3C trace headers (read there, forwarded as before).
        balance_key_headers=[*clusters.balance_key_headers(), *settings.stable_hash_headers(),
                             *(TRACE_HEADERS if config.tracing is not None else ())],
        credential_headers=[c.upstream_auth.header for c in config.clusters if c.upstream_auth is not None],
    )
    routes = RouteTable(routing.mcp_path, [(c.name, c.allowed_routes) for c in config.clusters], provider_index)
    auth = config.auth
    authenticator = Authenticator.from_config(auth) if auth is not None else None
    # Managed keys (docs/keys.md): the table the supervisor created before fork; None without a store.
    keys = ManagedKeyGate(KeyLookup(key_table)) if key_table is not None and authenticator is not None else None
    return HeadGate(routes, authenticator, header_plan, keys=keys, certificates=_certificates(config),
                    jwt=JwtGate.from_config(config, status_fd))


def _certificates(config: Config) -> ConnectionCertificates | None:
    """The client-certificate identities (mTLS, docs/identity.md); None when the listener asks for none."""
    client_auth = None if config.server_tls is None else config.server_tls.client_auth
    if client_auth is None:
        return None
    return ConnectionCertificates(CertificateTenants(client_auth.tenant_from, client_auth.map))
