"""The worker process: its composition root and its one uvloop event loop.

``worker_main`` runs in the forked child and never returns (it ends in ``os._exit``). ``Worker``
builds everything the request path uses from the ``WorkerContext`` (shared-memory row and views,
overlay follower, router, clusters, auth, quota gate, metrics), serves on the ``SO_REUSEPORT`` socket
the supervisor bound for its position (or binds its own when run alone) until SIGTERM/SIGINT, then
drains (CONTRACT §10). Periodic work (heartbeats, overlay reloads) runs in one background task, off the
request path.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket
import time

import uvloop

from gateway.auth import Authenticator
from gateway.config import Config
from gateway.host_segment import (
    MAX_PROVIDERS,
    PROVIDERS_REGION,
    create_segment,
    endpoint_ids,
)
from gateway.http.errors import ErrorReply
from gateway.http.tls import ReloadableServerTls
from gateway.listener import BACKLOG, bind_listener
from gateway.metrics.catalogue import COUNTERS
from gateway.metrics.writer import WorkerMetrics
from gateway.process_protocol import (
    EXIT_CANNOT_BIND,
    Draining,
    Heartbeat,
    OverlayRejected,
    Ready,
    WorkerContext,
    send_status,
)
from gateway.quota.backend import create_client
from gateway.quota.counters import configured_tenants
from gateway.quota.gate import QuotaGate
from gateway.quota.ledger import QuotaLedger
from gateway.request.headers import HeaderPlan
from gateway.request.routes import RouteTable
from gateway.routing import Router
from gateway.routing.eligibility import FactsTable
from gateway.routing.tenants import TenantPolicies
from shm.affinity import AffinityTable
from shm.counters import WorkerRow, WorkerStatus
from shm.metrics import MetricsTable
from shm.providers import EndpointCooling, ProviderCells
from shm.segment import Segment
from workers.access_log import AccessLog
from workers.clusters import ClusterManager
from workers.head_gate import HeadGate, HeadRefusal
from workers.overlay_follower import OverlayFollower
from workers.providers import ProviderStates
from workers.proxy import Proxy
from workers.proxy_settings import ProxySettings
from workers.server import ServerConnection, ServerSettings, ServerState

log = logging.getLogger("gridgate.worker")

_HEARTBEAT_S = 1.0
_OVERLAY_POLL_S = 0.25
_DRAIN_POLL_S = 0.05


def _private_segment(config: Config) -> Segment:
    """A segment for a worker started without a supervisor (profiling, experiments)."""
    segment = create_segment(config, 1)
    segment.directory.assign(endpoint_ids(config))
    segment.claim_worker_row(0)
    return segment


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


class Worker:
    """One worker process: builds the request path from its context, serves, drains."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.config: Config = ctx.config
        self.reload_requested = False
        self.segment: Segment = ctx.segment if ctx.segment is not None else _private_segment(self.config)
        self.row = WorkerRow(self.segment, max(ctx.slot, 0))
        self.row.mark(WorkerStatus.RUNNING, os.getpid(), time.monotonic_ns())
        self.metrics = self._metrics_writer()
        self.overlay = OverlayFollower(self.config, ctx.overlay_fallback)
        configured = [cluster.name for cluster in self.config.clusters]
        self.provider_index = provider_indexes(self.ctx.metric_clusters or tuple(configured), configured)
        routing = self.config.routing
        least_loaded = routing.least_loaded
        self.providers = ProviderStates(
            ProviderCells(self.segment.region(PROVIDERS_REGION), self.segment.max_workers, MAX_PROVIDERS),
            self.row.index, self.segment.rows_in_use, max(self.provider_index.values(), default=-1) + 1,
            self._routable, self._inflight, half_life=float(least_loaded.latency_half_life),
            latency_prior=None if least_loaded.latency_prior is None else float(least_loaded.latency_prior),
            endpoint_cooling=EndpointCooling(self.segment, self.row.index),
        )
        self.router = Router(
            max(ctx.slot, 0), affinity=self._affinity_table(), affinity_ttl_s=float(routing.session_affinity.ttl),
            provider_index=self.provider_index, providers=self.providers.view, picker=routing.picker,
            facts=FactsTable(routing.models),
        )
        self._report_unconfigured(self.router.prepare(self.overlay.snapshot))
        auth = self.config.auth
        self.auth = Authenticator([(key.tenant, key.key) for key in auth.keys]) if auth is not None else None
        self.quota: QuotaGate | None = None
        self.clusters: ClusterManager | None = None
        self.head_gate: HeadGate | None = None
        self.access_log: AccessLog | None = None
        tls = self.config.server_tls
        self.tls = None if tls is None else ReloadableServerTls(
            self.config.file_path(tls.cert_file), self.config.file_path(tls.key_file))

    def _routable(self, provider: int) -> bool:
        return self.clusters is None or self.clusters.routable(provider)

    def _inflight(self, provider: int) -> int:
        return 0 if self.clusters is None else self.clusters.inflight(provider)

    @staticmethod
    def _report_unconfigured(clusters: list[str]) -> None:
        if clusters:
            log.warning("overlay names clusters this gateway does not have (never selected): %s", ", ".join(clusters))

    def _affinity_table(self) -> AffinityTable | None:
        affinity = self.config.routing.session_affinity
        if not affinity.enabled:
            return None
        region = self.segment.region(self.ctx.affinity_region)
        return AffinityTable(region, self.ctx.affinity_capacity)

    def _metrics_writer(self) -> WorkerMetrics:
        clusters = self.ctx.metric_clusters or [cluster.name for cluster in self.config.clusters]
        tenants = self.ctx.metric_tenants or configured_tenants(self.config)
        table = MetricsTable(self.segment.region(self.ctx.metrics_region),
                             self.segment.max_workers, COUNTERS)
        return WorkerMetrics(table.row(self.row.index), clusters, tenants)

    async def _build_proxy(self) -> Proxy:
        """The parts that need the running loop (pools, the quota client), then the head gate and the request
        handler."""
        config = self.config
        quota = config.quota
        if quota is not None and self.ctx.quota_url:
            ledger = QuotaLedger(create_client(self.ctx.quota_url), reservation_timeout_s=float(quota.reservation_timeout))
            self.quota = QuotaGate.from_config(ledger, config, generation=self.ctx.generation, slot=self.ctx.slot)
            await self.quota.start()
        clusters = self.clusters = ClusterManager(config, self.segment, self.row, self.provider_index)
        for cluster in clusters.by_provider.values():  # 429/503 cool these first (workers.providers)
            self.providers.set_endpoints(cluster.provider, cluster.endpoints)
        self.access_log = AccessLog.from_config(config)
        routing = config.routing
        affinity = routing.session_affinity
        settings = ProxySettings.from_config(config)
        header_plan = HeaderPlan(
            routing.model_header,
            # Scanned for affinity, and for a stable_hash key that names the session (affinity on or not).
            session_header=affinity.header if settings.session_fact else None,
            pin_header=routing.pin_header,
            balance_key_headers=[*clusters.balance_key_headers(), *settings.stable_hash_headers()],
            credential_headers=[c.upstream_auth.header for c in config.clusters if c.upstream_auth is not None],
        )
        routes = RouteTable(routing.mcp_path, [(c.name, c.allowed_routes) for c in config.clusters],
                            self.provider_index)
        self.head_gate = HeadGate(routes, self.auth, header_plan)
        return Proxy(
            settings=settings, tenants=TenantPolicies(config.tenants), overlay=self.overlay, router=self.router,
            clusters=clusters, providers=self.providers, quota=self.quota, metrics=self.metrics,
            access_log=self.access_log,
        )

    async def serve(self) -> int:
        loop = asyncio.get_running_loop()
        stopping = asyncio.Event()
        proxy = await self._build_proxy()
        state = ServerState(ServerSettings(self.config), proxy.handle)
        state.on_reject = self._rejected
        state.head_gate = self.head_gate  # key and route decided on the head, before any body is read
        try:
            sock = self._listener()
        except OSError as error:
            log.error("cannot listen on %s: %s", self.config.listen, error.strerror)
            return EXIT_CANNOT_BIND
        # create_server listens again on the socket: give it the same backlog (its default is 100).
        server = await loop.create_server(
            lambda: ServerConnection(state), sock=sock, backlog=BACKLOG,
            ssl=None if self.tls is None else self.tls.context,
            ssl_handshake_timeout=float(self.config.timeouts.header_read) if self.tls is not None else None,
        )
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stopping.set)
        loop.add_signal_handler(signal.SIGHUP, self._request_reload)
        loop.add_signal_handler(signal.SIGUSR1, proxy.access_log.reopen)  # logrotate
        # What exists now lives as long as the worker: keep it out of the collector's generations, so a
        # full collection walks only what requests allocate (gen-2 pauses grow with the heap otherwise).
        gc.collect()
        gc.freeze()
        self._send_ready()
        background = loop.create_task(self._background())
        await stopping.wait()

        send_status(self.ctx.status_fd, Draining())
        state.draining = True
        # Stop accepting. Under a supervisor this closes only our copy of the socket: the next
        # generation's worker at our position holds it too, and accepts what waits in its queue.
        server.close()
        await self._drain(state)
        background.cancel()
        await self._stop()
        return 0

    def _listener(self) -> socket.socket:
        """The socket the supervisor bound for this worker's position, or our own when run alone."""
        if self.ctx.listen_fd is not None:
            return socket.socket(fileno=self.ctx.listen_fd)
        return bind_listener(self.config.listen)

    async def _drain(self, state: ServerState) -> None:
        """Until every connection ended (after a `Connection: close` answer, or idle) or the deadline."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + float(self.config.timeouts.graceful_shutdown)
        while state.connections and loop.time() < deadline:
            state.close_idle(loop.time())
            await asyncio.sleep(_DRAIN_POLL_S)
        await state.cut_remaining()

    async def _stop(self) -> None:
        if self.clusters is not None:
            self.clusters.close()
        if self.quota is not None:
            await self.quota.close()
        if self.access_log is not None:
            await self.access_log.close()
        self._publish_counters()  # the last settlements and log lines, before the row is retired

    def _rejected(self, reply: ErrorReply) -> None:
        self.metrics.request(None, reply.status)
        if self.access_log is not None:
            if type(reply) is HeadRefusal:  # refused on its head: the line names the request
                self.access_log.rejected(reply.status, reply.code, reply.request_id, reply.method, reply.target,
                                         reply.tenant)
            else:
                self.access_log.rejected(reply.status, reply.code)

    def _request_reload(self) -> None:
        self.reload_requested = True
        if self.tls is not None:  # new handshakes get the re-read certificate; open connections keep theirs
            problem = self.tls.reload()
            if problem is not None:
                log.error("server_tls: cannot reload %s / %s: %s; serving the previous certificate",
                          self.tls.cert_file, self.tls.key_file, problem)

    def _send_ready(self) -> None:
        snapshot = self.overlay.snapshot
        send_status(self.ctx.status_fd, Ready(
            revision=snapshot.revision, mode=snapshot.mode,
            capabilities=[f"{kind}/{name}" for kind, name in snapshot.capability_keys],
        ))

    def _heartbeat(self) -> None:
        """Liveness for the health process, and per-process counters into shared metrics."""
        send_status(self.ctx.status_fd, Heartbeat())
        self.row.heartbeat(time.monotonic_ns())
        self._publish_counters()

    def _publish_counters(self) -> None:
        """Copy the per-process counters (quota, tenant tokens, panic, access-log drops) into the row."""
        if self.quota is not None:
            self.metrics.publish_quota(self.quota.counters)
            self.metrics.publish_tenant_tokens(self.quota.tenant_tokens)
        if self.clusters is not None:
            self.metrics.publish_panic(self.clusters.panic_entries())
        if self.access_log is not None:
            self.metrics.publish_access_log(self.access_log.dropped)

    def _poll_overlay(self, now: float) -> None:
        forced, self.reload_requested = self.reload_requested, False
        result = self.overlay.poll(now, force=forced, on_result=self.metrics.overlay_reload)
        if result.error is not None:
            send_status(self.ctx.status_fd, OverlayRejected(
                reason=result.error, retained_revision=self.overlay.snapshot.revision,
            ))
        if result.changed:
            self._report_unconfigured(self.router.prepare(self.overlay.snapshot))
            self._send_ready()

    async def _background(self) -> None:
        """Heartbeats and the overlay follower: cheap periodic work off the request path."""
        next_heartbeat = 0.0
        while True:
            now = time.monotonic()
            if now >= next_heartbeat:
                self._heartbeat()
                next_heartbeat = now + _HEARTBEAT_S
            try:
                self._poll_overlay(now)
            except Exception:  # never let the follower die: keep serving last-known-good
                log.exception("overlay reload failed")
            await asyncio.sleep(_OVERLAY_POLL_S)


def worker_main(ctx: WorkerContext) -> None:
    """Entry point in the forked child. Never returns."""
    code = 1
    try:
        logging.basicConfig(
            level=logging.INFO, format=f"%(asctime)s worker[{os.getpid()}] %(levelname)s %(name)s: %(message)s"
        )
        code = uvloop.run(Worker(ctx).serve())
    except BaseException:
        log.exception("worker crashed")
        code = 1
    finally:
        logging.shutdown()
        os._exit(code)
