"""The supervisor's arbiter: start-up, the loop and its signal table, stopping.

Modelled on gunicorn's arbiter. One asyncio loop does all the work: signal handlers only enqueue an
action name (``SIGNAL_ACTIONS``, policy.py); the loop takes one action at a time, runs
``handle_<action>``, then ``_tick`` (reap, replace, retire, notify). The children (processes.py),
reloads (reload.py) and readiness (readiness.py) are parts of this same class.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

from gateway.config import Config, ConfigError
from gateway.host_segment import create_segment, endpoint_ids
from gateway.notify import Notifier
from gateway.supervisor.children import _default_health_entry, _default_worker_entry
from gateway.supervisor.lifecycle import Child, CrashBackoff, PendingGeneration, SlotPool, in_background
from gateway.supervisor.observability import SupervisorAdminSources, SupervisorCollector, WorkerCounters
from gateway.supervisor.overlay_keeper import LastGoodOverlay
from gateway.supervisor.policy import SIGNAL_ACTIONS, TICK
from gateway.supervisor.processes import ProcessMixin
from gateway.supervisor.quota_backend import EmbeddedQuotaBackend, quota_url_for
from gateway.supervisor.readiness import ReadinessMixin
from gateway.supervisor.reload import ReloadMixin
from gateway.supervisor.startup import (
    RunOverrides,
    StartupError,
    bind_admin_socket,
    check_listen_address,
    validate_deployment,
)
from shm.segment import MAX_WORKERS_LIMIT
from workers.admin import AdminApp, AdminServer, MetricsExposition, QuotaReporter
from workers.context import WorkerContext

log = logging.getLogger("gridgate.supervisor")


class Supervisor(ReloadMixin, ReadinessMixin, ProcessMixin):
    """Owns one host's worker and health processes; the mixins share the state set up here."""

    def __init__(
        self,
        config_path: str,
        config: Config,
        overrides: RunOverrides | None = None,
        *,
        worker_entry: Callable[[WorkerContext], object] = _default_worker_entry,
        health_entry: Callable[[WorkerContext], object] = _default_health_entry,
    ) -> None:
        self.config_path = config_path
        self.config = config
        self.overrides = overrides or RunOverrides()
        self.worker_entry = worker_entry
        self.health_entry = health_entry

        self.generation = 1
        self.target = config.worker_count()
        # The most workers one generation may have (SIGTTIN and reloads included); rows cover two.
        headroom = min(max(2 * self.target, self.target + 8), MAX_WORKERS_LIMIT // 2)
        self.max_workers = max(self.target, headroom)
        # Two generations side by side during a reload.
        self.slots = SlotPool(2 * self.max_workers)
        self.last_good_overlay = LastGoodOverlay()
        self.children: dict[int, Child] = {}
        self.pending: PendingGeneration | None = None

        self.notifier = Notifier()
        self.embedded_quota = EmbeddedQuotaBackend()
        self.segment: Any = None
        self.affinity_capacity = config.routing.session_affinity.capacity
        self.worker_counters: WorkerCounters | None = None
        self.quota_reporter: QuotaReporter | None = None
        self.metrics = MetricsExposition()
        self.metrics.register(SupervisorCollector(self))
        self.admin: AdminServer | None = None

        self.restarts_total = 0
        self.reloads_total = 0
        self.reload_failures_total = 0
        self.last_overlay_rejection: dict[str, Any] | None = None

        self._events: asyncio.Queue[str] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._worker_backoff = CrashBackoff()
        self._health_backoff = CrashBackoff()
        self._next_worker_spawn = 0.0
        self._next_health_spawn = 0.0
        self._ever_ready = False
        self._announced_ready = False
        self._startup_failures = 0
        self._reload_again = False
        self._stopping = False
        self._fatal: str | None = None
        self._next_watchdog = 0.0
        self._last_status = ""
        self._endpoint_slots_widened = False  # the directory holds two generations' endpoints
        self._generations_started = self.generation

    # ------------------------------------------------------------------ running

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT; 0 after a clean stop. Raises StartupError for fatal setup problems."""
        admin_sock: socket.socket | None = None
        try:
            try:
                validate_deployment(self.config)  # an invalid overlay at startup is a startup error
            except ConfigError as exc:
                raise StartupError("; ".join(exc.problems)) from None
            self.last_good_overlay.capture(self.config)
            # Cheap checks first, so a taken port fails before anything was started.
            check_listen_address(self.config.listen)
            admin_sock = bind_admin_socket(self.config.admin.listen)
            quota_url_for(self.config, self.embedded_quota)  # the embedded Valkey starts before any fork
            self._create_segment()
            return asyncio.run(self._serve(admin_sock))
        except BaseException:
            if admin_sock is not None and self.admin is None:
                admin_sock.close()
            raise
        finally:
            self.embedded_quota.stop()  # after the workers drained: their last settlements landed
            self.notifier.close()

    def _create_segment(self) -> None:
        try:
            self.segment = create_segment(self.config, self.slots.capacity)
            self.segment.directory.assign(endpoint_ids(self.config))
        except ValueError as exc:  # shm.segment.ShmCapacityError
            raise StartupError(f"workers/clusters: {exc}") from None
        self.worker_counters = WorkerCounters(self.segment)
        self.metrics.register_text(self._render_worker_counters)

    async def _serve(self, admin_sock: socket.socket) -> int:
        self._loop = asyncio.get_running_loop()
        self._events = asyncio.Queue()
        for sig, action in SIGNAL_ACTIONS.items():
            self._loop.add_signal_handler(sig, self._events.put_nowait, action)
        self.admin = AdminServer(AdminApp(SupervisorAdminSources(self), self.metrics), admin_sock)
        await self.admin.start()
        log.info(
            "supervisor pid %d: listen %s, admin %s, %d workers",
            os.getpid(), self.config.listen, self.config.admin.listen, self.target,
        )
        tick = TICK if self.notifier.watchdog_interval is None else min(TICK, self.notifier.watchdog_interval / 2)
        try:
            self._tick()
            while not (self._stopping and not self.children):
                try:
                    action = await asyncio.wait_for(self._events.get(), tick)
                except TimeoutError:
                    action = None
                if action is not None:
                    getattr(self, f"handle_{action}")()
                self._tick()
        finally:
            await self.admin.close()
            if self.quota_reporter is not None:
                await self.quota_reporter.close()
        if self._fatal:
            raise StartupError(self._fatal)
        log.info("supervisor stopped")
        return 0

    def _tick(self) -> None:
        """Everything that is due: runs after every action and at least every TICK seconds."""
        now = time.monotonic()
        self._reap()
        self._kill_overdue(now)
        if not self._stopping:
            self._advance_reload(now)
            self._maintain_workers(now)
            self._maintain_health(now)
            self.embedded_quota.watch(now)
            self._release_old_endpoint_slots()
        self._notify_systemd(now)

    # ------------------------------------------------------------------ signal actions

    def handle_reap(self) -> None:
        pass  # _tick reaps after every action

    def handle_wake(self) -> None:
        pass  # _tick runs after every action

    def handle_terminate(self) -> None:
        self._begin_stop("SIGTERM")

    def handle_interrupt(self) -> None:
        if self._stopping:  # a second Ctrl-C: stop waiting for the drain
            log.warning("second interrupt: killing %d remaining processes", len(self.children))
            for child in self.children.values():
                self._signal(child, signal.SIGKILL)
            return
        self._begin_stop("SIGINT")

    def handle_increment(self) -> None:
        if self._stopping:
            return
        if self.target >= self.max_workers:
            log.warning("SIGTTIN ignored: already at the %d workers the shared memory was sized for", self.max_workers)
            return
        self.target += 1
        log.info("SIGTTIN: workers %d -> %d", self.target - 1, self.target)

    def handle_decrement(self) -> None:
        if self._stopping or self.target <= 1:
            return
        self.target -= 1
        log.info("SIGTTOU: workers %d -> %d", self.target + 1, self.target)

    # handle_reload (SIGHUP) lives with the generation swap in reload.py.

    # ------------------------------------------------------------------ stopping

    def _begin_stop(self, why: str) -> None:
        if self._stopping:
            return
        self._stopping = True
        grace = self.config.timeouts.graceful_shutdown
        log.info("%s: draining %d processes (up to %.0fs)", why, len(self.children), grace)
        self.notifier.stopping("draining")
        if self.pending is not None and self.pending.admin_sock is not None:
            self.pending.admin_sock.close()
        self.pending = None
        for child in self.children.values():
            self._retire(child, grace)

    def _fail(self, message: str) -> None:
        log.error("%s", message)
        self._fatal = message
        self._begin_stop("fatal")

    # ------------------------------------------------------------------ admin data

    def _render_worker_counters(self) -> bytes:
        assert self.worker_counters is not None
        slots = [c.slot for c in self._workers()]
        return self.worker_counters.render(slots, [cluster.name for cluster in self.config.clusters])

    def current_quota_reporter(self) -> QuotaReporter:
        quota = self.config.quota
        assert quota is not None
        url = quota_url_for(self.config, self.embedded_quota)
        assert url is not None
        reporter = self.quota_reporter
        if reporter is None or reporter.key != (url, quota):
            if reporter is not None:
                in_background(reporter.close())
            reporter = self.quota_reporter = QuotaReporter(url, quota)
        return reporter
