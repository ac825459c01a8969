"""Everything a worker's proxy consults per request, built once from the config.

The runtime is the seam between the request path (workers/proxy.py) and the pure rooms:
routing snapshot and pickers, endpoint balancers, auth and quota. Per request it offers cheap
methods; on reload it swaps the snapshot.
"""

from __future__ import annotations

import logging
import os
import ssl
import time
from typing import Any

import msgspec

from gateway.auth import Authenticator
from gateway.balancing import hash_key
from gateway.capability import CapabilityError, CapabilityRequest, lookup_capability, session_key
from gateway.config import Cluster, Config, Tls, parse_host_port
from gateway.endpoints import (
    ClusterSpec,
    SharedEndpointState,
    build_cluster_balancer,
    cluster_refs,
    cluster_specs_from_config,
)
from gateway.host_segment import AFFINITY_REGION, METRICS_REGION, create_segment, endpoint_ids
from gateway.metrics import COUNTERS, WorkerMetrics
from gateway.overlay.contract import OverlayRejected
from gateway.overlay.snapshot import Snapshot, snapshot_from_bytes
from gateway.overlay.watch import OverlayWatcher, SnapshotHolder, load_inline_overlay
from gateway.quota.backend import create_client
from gateway.quota.gate import Admission, QuotaGate
from gateway.quota.ledger import QuotaLedger
from gateway.quota.rules import rules_from_config
from gateway.quota.usage import rewrite_request_for_usage
from gateway.routing import RouteDecision, RouteFailure, Router
from shm.affinity import AffinityTable
from shm.counters import Outcome, WorkerRow, WorkerStatus
from shm.metrics import MetricsTable
from shm.segment import Segment
from workers.context import WorkerContext
from workers.errors import GatewayError
from workers.upstream import UpstreamPool

log = logging.getLogger("gridgate.runtime")
_monotonic = time.monotonic


class EndpointRuntime:
    __slots__ = ("index", "address", "weight", "pool", "host_header")

    def __init__(self, index: int, address: str, weight: int, pool: UpstreamPool) -> None:
        self.index = index  # the endpoint's shared-memory slot
        self.address = address
        self.weight = weight
        self.pool = pool
        self.host_header = address.encode()


def tls_client_context(tls: bool | Tls) -> tuple[ssl.SSLContext | None, str | None]:
    """The upstream TLS context of a cluster: system CAs by default, or the configured CA file."""
    if tls is False:
        return None, None
    options = tls if isinstance(tls, Tls) else Tls()
    context = ssl.create_default_context(cafile=options.ca_file)
    if not options.verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context, options.sni


class ClusterRuntime:
    """One provider cluster in one worker: its endpoints' pools and the shared-memory balancer."""

    def __init__(self, cluster: Cluster, spec: ClusterSpec, provider_hop: bool, slot_map: dict[str, int],
                 view: SharedEndpointState, row: WorkerRow) -> None:
        self.name = cluster.name
        self.provider_hop = provider_hop
        self.row = row
        self.auth_headers: list[tuple[bytes, bytes]] = []
        if cluster.upstream_auth is not None:
            secret = os.environ.get(cluster.upstream_auth.value_env, "")
            self.auth_headers.append(
                (cluster.upstream_auth.header.lower().encode(), b"Bearer " + secret.encode())
            )
        self.balancer = build_cluster_balancer(spec, slot_map, view)
        self.key_header = self.balancer.key_header
        self.hashing = self.balancer.strategy in ("consistent_hash", "maglev")
        ssl_context, sni = tls_client_context(cluster.tls)
        self.by_slot: dict[int, EndpointRuntime] = {}
        for ref in cluster_refs(spec, slot_map):
            host, port = parse_host_port(ref.address)
            pool = UpstreamPool(
                host, port, max_connections=cluster.max_connections,
                connect_timeout=float(cluster.connect_timeout), read_timeout=float(cluster.read_timeout),
                ssl_context=ssl_context, server_hostname=sni or host,
            )
            self.by_slot[ref.slot] = EndpointRuntime(ref.slot, ref.address, ref.weight, pool)

    def balance_key(self, found: dict[bytes, bytes], target: bytes) -> bytes | None:
        if not self.hashing:
            return None
        return hash_key(found.get(self.key_header) if self.key_header else None, target)

    def pick(self, key: bytes | None, excluded: set[int]) -> EndpointRuntime | None:
        ref = self.balancer.pick(key, excluded) if excluded else self.balancer.pick(key)
        return None if ref is None else self.by_slot[ref.slot]

    def begin(self, endpoint: EndpointRuntime) -> None:
        self.row.inc_inflight(endpoint.index)

    def end(self, endpoint: EndpointRuntime) -> None:
        self.row.dec_inflight(endpoint.index)

    def record(self, endpoint: EndpointRuntime, failure: str | None) -> None:
        """Passive health: every outcome lands in this worker's row (the health process reads them)."""
        self.row.record(endpoint.index, Outcome.from_reason(failure))

    def close(self) -> None:
        for endpoint in self.by_slot.values():
            endpoint.pool.close()


def _private_segment(config: Config) -> Segment:
    """A segment for a worker started without a supervisor (profiling, experiments)."""
    segment = create_segment(config, 1)
    segment.directory.assign(endpoint_ids(config))
    segment.claim_worker_row(0)
    return segment


_FORM_URLENCODED = b"application/x-www-form-urlencoded"
# Quota for requests without authentication is accounted to this tenant.
ANONYMOUS_TENANT = "anonymous"


class Runtime:
    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.config: Config = ctx.config
        self.segment = ctx.segment if ctx.segment is not None else _private_segment(self.config)
        slot = max(ctx.slot, 0)
        self.row = WorkerRow(self.segment, slot)
        self.row.mark(WorkerStatus.RUNNING, os.getpid(), time.monotonic_ns())
        routing = self.config.routing
        self.model_header = routing.model_header.lower().encode()
        affinity = routing.session_affinity
        self.affinity_header = affinity.header.lower().encode() if affinity.enabled and affinity.header else None
        self.affinity_cookie = affinity.cookie.encode() if affinity.enabled and affinity.cookie else None
        self.header_lookups = {self.model_header: 0, b"content-type": 1}
        if self.affinity_header:
            self.header_lookups[self.affinity_header] = 2
        self.route_headers_enabled = routing.route_headers
        overlay_path = self.config.overlay_path()
        scope = routing.expected_overlay_scope if routing.expected_overlay_scope.is_configured() else None
        if overlay_path is None:  # inline candidates: they change with the config, not a file
            self.watcher: OverlayWatcher | None = None
            self.overlay = SnapshotHolder(None, scope, load_inline_overlay(routing.candidates or [], scope))
        else:
            self.watcher = OverlayWatcher(overlay_path, float(routing.reload_debounce))
            self.overlay = self._open_overlay(overlay_path, scope)
        self.router = Router(max(ctx.slot, 0), affinity=self._affinity_table(), affinity_ttl_s=float(affinity.ttl))
        self.router.prepare(self.overlay.snapshot)
        self.metrics = self._metrics_writer()
        self.clusters: dict[str, ClusterRuntime] = {}
        self._models_body = b""
        auth = self.config.auth
        self.auth = Authenticator([(key.tenant, key.key) for key in auth.keys]) if auth is not None else None
        self.quota: QuotaGate | None = None

    def _open_overlay(self, path: str, scope: Any) -> SnapshotHolder:
        """The overlay file; if it is invalid right now, the last good bytes the supervisor kept."""
        try:
            return SnapshotHolder.open(path, scope)
        except OverlayRejected as error:
            fallback = self.ctx.extras.get("overlay_fallback")
            if not fallback:
                raise
            snapshot = snapshot_from_bytes(fallback, scope)
            log.warning("overlay file rejected at start (%s); serving last-known-good revision %s",
                        error, snapshot.revision)
            return SnapshotHolder(path, scope, snapshot)

    def _affinity_table(self) -> AffinityTable | None:
        affinity = self.config.routing.session_affinity
        if not affinity.enabled:
            return None
        region = self.segment.region(self.ctx.extras.get("affinity_region", AFFINITY_REGION))
        return AffinityTable(region, self.ctx.extras.get("affinity_capacity", affinity.capacity))

    def _metrics_writer(self) -> WorkerMetrics:
        names = self.ctx.extras.get("metric_clusters") or [cluster.name for cluster in self.config.clusters]
        table = MetricsTable(self.segment.region(self.ctx.extras.get("metrics_region", METRICS_REGION)),
                             self.segment.max_workers, COUNTERS)
        return WorkerMetrics(table.row(self.row.index), names)

    @property
    def snapshot(self) -> Snapshot:
        return self.overlay.snapshot

    async def start(self) -> None:
        quota = self.config.quota
        if quota is not None and self.ctx.quota_url:
            ledger = QuotaLedger(create_client(self.ctx.quota_url),
                                 reservation_timeout_s=float(quota.reservation_timeout))
            self.quota = QuotaGate(ledger, rules_from_config(quota), on_backend_error=quota.on_backend_error)
            await self.quota.start()
        hop = set(self.config.routing.provider_hop_clusters)
        segment = self.segment
        slot_map = segment.directory.slot_map()
        view = SharedEndpointState(segment, self.row.index)
        for cluster, spec in zip(self.config.clusters, cluster_specs_from_config(self.config), strict=True):
            runtime = ClusterRuntime(cluster, spec, cluster.name in hop, slot_map, view, self.row)
            self.clusters[cluster.name] = runtime
            if runtime.key_header:
                self.header_lookups[runtime.key_header] = 3
        self._models_body = self._render_models()

    async def stop(self) -> None:
        for cluster in self.clusters.values():
            cluster.close()
        if self.quota is not None:
            await self.quota.close()

    def heartbeat(self) -> None:
        """Once a second: liveness for the health process, and per-process counters into shared metrics."""
        self.row.heartbeat(time.monotonic_ns())
        if self.quota is not None:
            self.metrics.publish_quota(self.quota.counters)
        self.metrics.publish_panic({name: c.balancer.panic_entries for name, c in self.clusters.items()})

    def poll_overlay(self, now: float, force: bool = False) -> tuple[bool, str | None]:
        """Re-read the overlay when the file changed (or on SIGHUP); keep last-known-good on error."""
        if self.watcher is None or not (self.watcher.poll(now) or force):
            return False, None
        changed, error = self.overlay.reload()
        if force:
            self.watcher.mark_seen()
        if error is not None:
            self.metrics.overlay_reload("rejected")
            log.warning("overlay rejected (%s); keeping revision %s", error, self.snapshot.revision)
            return False, str(error)
        if not changed:
            self.metrics.overlay_reload("unchanged")
            return False, None
        self.metrics.overlay_reload("applied")
        self.router.prepare(self.snapshot)
        self._models_body = self._render_models()
        unknown = [name for name in self.snapshot.clusters if name not in self.clusters]
        if unknown:
            log.warning("overlay names clusters missing from the config: %s", ", ".join(unknown))
        log.info("serving overlay revision %s", self.snapshot.revision)
        return True, None

    def _render_models(self) -> bytes:
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "gridgate"}
                for name in self.snapshot.model_names]
        return msgspec.json.encode({"object": "list", "data": data})

    # -- per request -------------------------------------------------------------------------
    def authenticate(self, authorization: bytes | None, api_key: bytes | None) -> str:
        """The tenant of the presented key; 401 when auth is on and the key is missing or unknown."""
        if self.auth is None:
            return ANONYMOUS_TENANT
        tenant = self.auth.authenticate(authorization, api_key)
        if tenant is None:
            missing = authorization is None and api_key is None
            raise GatewayError(
                401, "invalid_api_key",
                "missing API key: send Authorization: Bearer <key> or X-Api-Key" if missing else "invalid API key",
                [(b"www-authenticate", b'Bearer realm="gridgate"')],
            )
        return tenant

    def models_body(self) -> bytes:
        return self._models_body

    def capability(self, exchange: Any, found: dict[bytes, bytes]) -> CapabilityRequest:
        content_type = found.get(b"content-type")
        if content_type is not None and content_type.startswith(_FORM_URLENCODED) and exchange.body[:1] == b"{":
            content_type = None  # `curl -d '{...}'` sends JSON under the form type; read it as JSON
        request = lookup_capability(found.get(self.model_header), exchange.body, content_type)
        if type(request) is CapabilityError:
            raise GatewayError(request.status, request.code, request.message)
        return request

    async def admit(self, tenant: str, request: CapabilityRequest, body_len: int) -> Admission | None:
        """Reserve tokens before routing; a denial never reaches a provider (429/503 with headers)."""
        gate = self.quota
        if gate is None:
            return None
        fields = request.body
        admission = await gate.admit(
            tenant, request.name, body_len,
            fields.max_tokens if fields is not None else None,
            fields.max_completion_tokens if fields is not None else None,
        )
        if admission.allowed:
            return admission
        message, error_type, code = admission.error or ("request not admitted", None, "quota_unavailable")
        raise GatewayError(admission.status or 503, code, message, list(admission.headers), error_type=error_type)

    def settle(self, admission: Admission | None, status: int, total_tokens: int | None,
               disconnected: bool = False) -> None:
        """Reconcile a reservation off the response path (never blocks)."""
        if admission is None or self.quota is None:
            return
        self.quota.settle(admission, status, total_tokens, client_disconnected=disconnected)

    def route(self, request: CapabilityRequest, found: dict[bytes, bytes], cookie: bytes | None) -> RouteDecision:
        key = None
        if self.affinity_header is not None or self.affinity_cookie is not None:
            key = session_key(found.get(self.affinity_header), cookie, self.affinity_cookie)
        decision = self.router.route(self.overlay.snapshot, request.kind, request.name, key, _monotonic())
        if type(decision) is RouteFailure:
            raise GatewayError(decision.status, decision.code, decision.message)
        if decision.cluster not in self.clusters:
            raise GatewayError(503, "no_provider_available",
                               f"provider cluster {decision.cluster!r} is not configured on this gateway")
        self.metrics.affinity(decision.affinity)
        return decision

    def route_headers(self, route: RouteDecision, admission: Admission | None) -> list[tuple[bytes, bytes]]:
        headers = list(route.evidence) if self.route_headers_enabled else []
        if admission is not None:
            headers += admission.headers
        return headers

    def provider_hop_headers(self, route: RouteDecision, request_id: bytes) -> list[tuple[bytes, bytes]]:
        headers = [(b"x-ai-routing-candidate", route.evidence[1][1]), (b"x-ai-routing-request-id", request_id)]
        if self.snapshot.is_envelope:
            headers.append((b"x-ai-routing-revision", route.revision.encode()))
        return headers

    def upstream_body(
        self, request: CapabilityRequest, body: bytes, admission: Admission | None,
    ) -> tuple[bytes, bool | None]:
        """The body to send and the metering mode (None: not metered; True: rewritten to ask for usage).

        A metered stream whose client did not ask for a usage chunk is rewritten to ask for one; the
        response filter then removes that chunk so the client sees exactly what it asked for.
        """
        if admission is None or admission.reservation is None:
            return body, None
        fields = request.body
        if fields is not None and fields.stream and not fields.include_usage:
            rewritten = rewrite_request_for_usage(body)
            if rewritten is not None:
                return rewritten, True
        return body, False
