"""The arbiter: start-up, the loop and its signal table, stopping.

Modelled on gunicorn's arbiter. Signal handlers only enqueue an action name (``SIGNAL_ACTIONS``,
policy.py); one asyncio loop takes one action at a time, then runs ``_tick`` (reap, replace, advance
a reload, notify). The state lives in the objects the arbiter composes, each the only writer of its
own: the ``WorkerSet`` (children), the ``GenerationSwap`` (running config, reload in progress),
``Readiness`` (what the workers reported, sd_notify), the admin listener, the embedded Valkey. They
talk through public methods; the arbiter routes exits and status messages between them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from collections.abc import Callable

from gateway.admin.console.app import Console
from gateway.admin.keys_api import KeysApi
from gateway.admin.pages import AdminApp, MetricsExposition
from gateway.admin.quota import QuotaReporter
from gateway.admin.server import AdminServer
from gateway.admin.spend_api import SpendApi
from gateway.check import validate_deployment
from gateway.config import Config, ConfigError
from gateway.host_segment import AFFINITY_REGION, METRICS_REGION, create_segment, endpoint_ids
from gateway.interpreter import interpreter_build, slow_build_warning
from gateway.metrics.catalogue import MAX_CLUSTERS, MAX_FALLBACK_EDGES, MAX_TENANTS
from gateway.metrics.labels import LabelRegistry
from gateway.models.aliases import fallback_edges
from gateway.notify import Notifier
from gateway.process_protocol import (
    Draining,
    Heartbeat,
    JwksWanted,
    OverlayRejected,
    Ready,
    RecentRequests,
    SpendAlertReport,
    SpendCounts,
    StatusMessage,
    WorkerContext,
)
from gateway.quota.counters import configured_tenants
from gateway.supervisor.cache_index import CacheIndexService
from gateway.supervisor.children import (
    _default_health_entry,
    _default_worker_entry,
    describe_exit,
    loop_internal_fds,
)
from gateway.supervisor.conformance import ConformanceWatch
from gateway.supervisor.console_sources import SupervisorConsoleSources
from gateway.supervisor.jwks_feed import JwksFeed
from gateway.supervisor.keys import KeyService, SupervisorKeyHost, admin_tokens_of
from gateway.supervisor.lifecycle import Child, max_workers_for
from gateway.supervisor.observability import SupervisorAdminSources, SupervisorCollector
from gateway.supervisor.overlay_feed import OverlayFeed
from gateway.supervisor.overlay_keeper import LastGoodOverlay
from gateway.supervisor.policy import SIGNAL_ACTIONS, TICK, WAKE
from gateway.supervisor.quota_backend import EmbeddedQuotaBackend, ReservationSweeper, quota_url_for
from gateway.supervisor.readiness import Readiness
from gateway.supervisor.reload import GenerationSwap
from gateway.supervisor.spend import (
    BudgetRemaining,
    SpendMetrics,
    SpendReporter,
    spend_store_url_for,
    warn_unmatched_overrides,
)
from gateway.supervisor.spend_alerts import AlertSender
from gateway.supervisor.startup import (
    RunOverrides,
    StartupError,
    bind_admin_socket,
    bind_error,
    check_listen_address,
)
from gateway.supervisor.worker_counters import WorkerCounters
from gateway.supervisor.worker_set import WorkerSet
from shm.segment import Segment

log = logging.getLogger("gridgate.supervisor")


class Arbiter:
    """Owns one host's worker and health processes until SIGTERM/SIGINT."""

    def __init__(
        self,
        config_path: str,
        config: Config,
        overrides: RunOverrides | None = None,
        *,
        worker_entry: Callable[[WorkerContext], object] = _default_worker_entry,
        health_entry: Callable[[WorkerContext], object] = _default_health_entry,
    ) -> None:
        self._config_path = config_path
        # routing.overlay_source: one subscriber for the host; the workers follow the file it writes.
        self._overlay_feed = OverlayFeed(config)
        # auth.jwt issuers fetched from their IdP: one fetcher for the host; workers follow the files it writes.
        self._jwks_feed = JwksFeed(config)
        config = self._for_workers(config)
        self._start_config = config  # from the first tick on, the generation swap owns the running config
        self._overrides = overrides or RunOverrides()
        self._worker_entry = worker_entry
        self._health_entry = health_entry
        self._max_workers = max_workers_for(config.worker_count())
        self._rows = 2 * self._max_workers  # two generations side by side during a reload
        # The segment's affinity table is sized once: workers of later configs use this size.
        self._affinity_capacity = config.routing.session_affinity.capacity
        self._notifier = Notifier()
        self._quota_backend = EmbeddedQuotaBackend()
        self._reservation_sweeper = ReservationSweeper(self._quota_backend)
        # managed keys: the host table and its follower (which labels each key's tenant for the metrics)
        self._keys = KeyService(self._quota_backend, tenant_index=self._tenant_index)
        self._cache_index = CacheIndexService(self._quota_backend)
        self._keys_config: Config | None = None  # the config the key service follows
        self._last_good_overlay = LastGoodOverlay()
        # Stable metrics label indexes (shared-memory cells), for the life of the supervisor.
        self._clusters = LabelRegistry(MAX_CLUSTERS)
        self._tenants = LabelRegistry(MAX_TENANTS)
        self._fallbacks = LabelRegistry(MAX_FALLBACK_EDGES)
        self._stopping = False
        self._fatal: str | None = None
        # Composed in _serve, once the segment and the loop exist.
        self._segment: Segment
        self._loop: asyncio.AbstractEventLoop
        self._events: asyncio.Queue[str]
        self._workers: WorkerSet
        self._readiness: Readiness
        self._swap: GenerationSwap
        self._admin: AdminServer
        self._quota_reporter: QuotaReporter
        self._alerts: AlertSender
        self._spend_metrics: SpendMetrics
        self._spend_reporter: SpendReporter
        self._budgets: BudgetRemaining
        self._conformance: ConformanceWatch

    # ------------------------------------------------------------------ running

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT; 0 after a clean stop. Raises StartupError for fatal setup problems."""
        config = self._start_config
        admin_sock: socket.socket | None = None
        try:
            self._overlay_feed.open()  # with a source: the overlay to start with, before anything checks it
            self._jwks_feed.open()  # the JWT issuers' key sets, before the first worker needs them
            try:
                overlay = validate_deployment(config)  # an invalid overlay at startup is a startup error
            except ConfigError as exc:
                raise StartupError("; ".join(exc.problems)) from None
            warn_unmatched_overrides(config, overlay)
            self._last_good_overlay.capture(config)
            # Cheap checks first, so a taken port fails before anything was started.
            check_listen_address(config.listen)
            admin_sock = bind_admin_socket(config.admin.listen)
            quota_url_for(config, self._quota_backend)  # the embedded Valkey starts before any fork
            self._keys.prepare(config)  # the key table too: every worker inherits it
            self._cache_index.prepare(config, self._rows)  # and the response cache's host index
            self._keys_config = config
            self._segment = self._create_segment(config)
            return asyncio.run(self._serve(admin_sock))
        except BaseException:
            if admin_sock is not None:
                admin_sock.close()  # a no-op once the admin server closed it
            raise
        finally:
            self._quota_backend.stop()  # after the workers drained: their last settlements landed
            self._overlay_feed.cleanup()
            self._jwks_feed.cleanup()
            self._notifier.close()

    def _create_segment(self, config: Config) -> Segment:
        try:
            segment = create_segment(config, self._rows)
            segment.directory.assign(endpoint_ids(config))
        except ValueError as exc:  # shm.segment.ShmCapacityError
            raise StartupError(f"workers/clusters: {exc}") from None
        return segment

    def _compose(self) -> None:
        """Build the parts, each once, wired through their public methods."""
        counters = WorkerCounters(self._segment)
        self._workers = WorkerSet(
            self._loop, self._segment, counters,
            rows=self._rows, target=self._start_config.worker_count(), max_workers=self._max_workers,
            worker_entry=self._worker_entry, health_entry=self._health_entry,
            make_context=self._context_for, on_status=self._on_status, inherited_fds=self._inherited_fds,
        )
        self._readiness = Readiness(self._workers, self._notifier, wake=lambda: self._events.put_nowait(WAKE))
        metrics = MetricsExposition()
        self._quota_reporter = QuotaReporter()
        running = lambda: self._swap.config  # noqa: E731 - the swap exists once _compose returns
        self._alerts = AlertSender(lambda: running().pricing.webhook)
        self._budgets = BudgetRemaining(running, self._quota_backend, self._quota_reporter, self._keys.managed_keys)
        self._spend_metrics = SpendMetrics(self._alerts, running, self._budgets)
        self._spend_reporter = SpendReporter(running, self._quota_backend)
        self._conformance = ConformanceWatch(self._segment, self._clusters)
        admin_sources = SupervisorAdminSources(self._readiness, lambda: self._swap.config, self._segment,
                                               self._quota_backend, self._quota_reporter, self._keys.managed_keys)
        admin_app = AdminApp(
            admin_sources,
            metrics,
            tokens=admin_tokens_of(lambda: self._swap.config),
            keys=KeysApi(SupervisorKeyHost(self._keys, lambda: self._swap.config)),
            spend=SpendApi(self._spend_reporter).handle,
            providers=lambda: self._conformance.report(self._swap.config),
        )
        self._console_sources = SupervisorConsoleSources(admin_sources, self._overlay_feed, lambda: self._swap.config)
        admin_app.attach_console(Console(admin_app, self._console_sources))
        self._admin = AdminServer(admin_app)
        self._swap = GenerationSwap(
            self._config_path, self._overrides, self._start_config,
            workers=self._workers, readiness=self._readiness, admin=self._admin, segment=self._segment,
            quota_backend=self._quota_backend, request_reload=lambda: self._events.put_nowait("reload"),
            for_workers=self._for_workers,
        )
        metrics.register(SupervisorCollector(self._workers, self._swap))
        metrics.register(self._overlay_feed)
        metrics.register(self._conformance)
        metrics.register(self._jwks_feed)
        metrics.register(self._keys)
        metrics.register(self._cache_index)
        metrics.register(self._spend_metrics)
        metrics.register_text(lambda: counters.render(self._workers.worker_slots(), self._clusters.names,
                                                      self._tenants.names, self._fallbacks.names))

    async def _serve(self, admin_sock: socket.socket) -> int:
        self._loop = asyncio.get_running_loop()
        self._events = asyncio.Queue()
        for sig, action in SIGNAL_ACTIONS.items():
            self._loop.add_signal_handler(sig, self._events.put_nowait, action)
        self._compose()
        config = self._start_config
        try:
            self._workers.prepare_listeners(config.listen, self._workers.target)
        except OSError as exc:
            raise bind_error("listen", config.listen, exc) from None
        actions: dict[str, Callable[[], None]] = {
            "reap": _nothing,  # _tick reaps after every action
            "wake": _nothing,  # _tick runs after every action
            "reload": self._reload,
            "terminate": lambda: self._begin_stop("SIGTERM"),
            "interrupt": self._interrupt,
            "increment": self._increment,
            "decrement": self._decrement,
            # logrotate: every worker, retiring ones too, reopens its access-log file
            "reopen_logs": lambda: self._workers.signal_workers(signal.SIGUSR1),
        }
        await self._admin.start(admin_sock)
        self._overlay_feed.start()
        self._jwks_feed.start()
        # The config's tenants take their metrics indexes before the managed keys' tenants do.
        _register_labels(self._tenants, "tenant", configured_tenants(config))
        await self._keys.start()  # before the first fork: the first workers already know the keys
        await self._cache_index.start()  # its first scan, so the first workers' misses await nothing
        log.info(
            "supervisor pid %d: listen %s, admin %s, %d workers",
            os.getpid(), config.listen, config.admin.listen, self._workers.target,
        )
        if (slow_build := slow_build_warning(interpreter_build())) is not None:
            log.warning("%s", slow_build)
        watchdog = self._notifier.watchdog_interval
        tick = TICK if watchdog is None else min(TICK, watchdog / 2)
        try:
            self._tick()
            while not (self._stopping and not len(self._workers)):
                try:
                    action = await asyncio.wait_for(self._events.get(), tick)
                except TimeoutError:
                    action = None
                if action is not None:
                    actions[action]()
                self._tick()
        finally:
            await self._overlay_feed.stop()
            await self._conformance.stop()
            await self._jwks_feed.stop()
            await self._keys.close()
            await self._cache_index.close()
            await self._admin.close()
            await self._reservation_sweeper.close()
            await self._quota_reporter.close()
            await self._spend_reporter.close()
            await self._budgets.close()
            await self._alerts.close()
        if self._fatal:
            raise StartupError(self._fatal)
        log.info("supervisor stopped")
        return 0

    def _tick(self) -> None:
        """Everything that is due: runs after every action and at least every TICK seconds."""
        now = time.monotonic()
        for child, status in self._workers.reap():
            self._child_exited(child, status, now)
        self._workers.kill_overdue(now)
        if not self._stopping:
            self._swap.advance(now)
            self._workers.maintain(self._swap.config, now)
            self._quota_backend.watch(now)
            self._overlay_feed.tick(self._swap.config)
            self._conformance.tick(self._swap.config, now)  # routing.conformance: its runs, off the request path
            if self._swap.config is not self._keys_config:  # a reload was applied
                self._keys_config = self._swap.config
                self._keys.reconfigure(self._keys_config)
            self._swap.release_old_endpoint_slots()
        self._readiness.notify(now)

    # ------------------------------------------------------------------ routing between the parts

    def _child_exited(self, child: Child, status: int, now: float) -> None:
        if child.role == "worker":  # its open reservations: slots freed now, tokens at the estimate
            self._reservation_sweeper.worker_exited(self._swap.config, child.generation, child.slot, child.pid)
            self._spend_metrics.worker_exited(child.pid)  # its spend counters join the retired totals
        if child.retiring:
            log.info("%s pid %d exited (%s) after retiring", child.role, child.pid, describe_exit(status))
            return
        if self._swap.pending_worker_died(child, status):
            return
        fatal = self._workers.replace_later(child, status, now, ever_ready=self._readiness.ever_ready)
        if fatal is not None:
            self._fail(fatal)

    def _on_status(self, child: Child, message: StatusMessage, now: float) -> None:
        match message:
            case Heartbeat():
                self._readiness.on_heartbeat(child, message, now)
            case Ready():
                self._readiness.on_ready(child, message, now)
                self._last_good_overlay.observe(self._swap.config, message.revision)
            case OverlayRejected():
                self._readiness.on_overlay_rejected(child, message, now)
            case Draining():  # the worker may decide to drain on its own
                self._workers.draining(child, now, self._swap.config.timeouts.graceful_shutdown)
            case SpendCounts():
                self._spend_metrics.on_counts(child.pid, message)
            case SpendAlertReport():  # posted to pricing.alerts_webhook, off every request path
                self._alerts.submit(message.alert)
            case RecentRequests():  # the console's last requests (docs/console.md#requests)
                self._console_sources.on_recent(child.pid, message)
            case JwksWanted():  # a token named an unknown kid (docs/identity.md)
                self._jwks_feed.wanted(message.issuer)

    def _for_workers(self, config: Config) -> Config:
        """A config as the workers see it: the overlay source's cache file, the JWT issuers' key files."""
        return self._jwks_feed.for_workers(self._overlay_feed.for_workers(config))

    def _tenant_index(self, tenant: str) -> int:
        """A managed key's tenant's metrics index, registered on first sight (the key table carries it
        to the workers, which may have forked before the tenant existed); -1 past the registry's room."""
        _register_labels(self._tenants, "tenant", [tenant])
        index = self._tenants.index_of(tenant)
        return -1 if index is None else index

    def _context_for(
        self, config: Config, slot: int, generation: int, status_fd: int, listen_fd: int | None,
    ) -> WorkerContext:
        """The context a child of ``config`` is forked with."""
        _register_labels(self._clusters, "cluster", [cluster.name for cluster in config.clusters])
        _register_labels(self._tenants, "tenant", configured_tenants(config))
        _register_labels(self._fallbacks, "fallback edge", fallback_edges(config.models))
        return WorkerContext(
            config=config, slot=slot, generation=generation, segment=self._segment, status_fd=status_fd,
            listen_fd=listen_fd,
            quota_url=quota_url_for(config, self._quota_backend),
            affinity_region=AFFINITY_REGION, affinity_capacity=self._affinity_capacity,
            metrics_region=METRICS_REGION, metric_clusters=self._clusters.names, metric_tenants=self._tenants.names,
            metric_fallbacks=self._fallbacks.names,
            overlay_fallback=self._last_good_overlay.data,
            key_table=self._keys.table,
            cache_index=self._cache_index.index,
            spend_url=spend_store_url_for(config, self._quota_backend),
        )

    def _inherited_fds(self) -> list[int]:
        """The supervisor's descriptors a forked child must close."""
        fds = [*self._workers.status_fds(), *self._admin.fds(), *self._swap.fds()]
        notify_fd = self._notifier.fileno()
        if notify_fd is not None:
            fds.append(notify_fd)
        return fds + loop_internal_fds(self._loop)

    # ------------------------------------------------------------------ signal actions

    def _reload(self) -> None:
        if not self._stopping:
            self._swap.reload()

    def _increment(self) -> None:
        if not self._stopping:
            self._workers.grow()

    def _decrement(self) -> None:
        if not self._stopping:
            self._workers.shrink()

    def _interrupt(self) -> None:
        if self._stopping:  # a second Ctrl-C: stop waiting for the drain
            log.warning("second interrupt: killing %d remaining processes", len(self._workers))
            self._workers.kill_all()
            return
        self._begin_stop("SIGINT")

    # ------------------------------------------------------------------ stopping

    def _begin_stop(self, why: str) -> None:
        if self._stopping:
            return
        self._stopping = True
        grace = self._swap.config.timeouts.graceful_shutdown
        log.info("%s: draining %d processes (up to %.0fs)", why, len(self._workers), grace)
        self._readiness.stopping()
        self._swap.cancel()
        self._workers.retire_all(grace)

    def _fail(self, message: str) -> None:
        log.error("%s", message)
        self._fatal = message
        self._begin_stop("fatal")


def _nothing() -> None:
    pass


def _register_labels(registry: LabelRegistry, kind: str, names: list[str]) -> None:
    """Give a config's new names their metrics index before its workers fork; warn about the ones past
    the registry's capacity (once each): they are counted under ``other``."""
    unlabelled = registry.register(names)
    if unlabelled:
        log.warning("metrics: %ss %s are counted under %s=\"other\": the supervisor labels at most %d %s names "
                    "until it restarts", kind, ", ".join(unlabelled), kind, len(registry.names), kind)
