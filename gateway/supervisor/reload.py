"""Reload (SIGHUP) by generation swap.

``ReloadMixin`` is one part of ``Supervisor`` (arbiter.py). Every config reload that needs new
workers forks a new generation next to the old one (``SO_REUSEPORT`` sockets overlap, so no connection
is refused), waits until all of it reports ``ready``, then retires the old one with SIGTERM (drain)
and SIGKILL after ``graceful_shutdown``. A reload that changes nothing a worker cares about only
forwards SIGHUP so the workers re-read the overlay.
"""

from __future__ import annotations

import logging
import signal
import socket
import time

import msgspec

from gateway.config import Config, ConfigError, load_config
from gateway.host_segment import endpoint_ids
from gateway.supervisor.lifecycle import Child, PendingGeneration, in_background
from gateway.supervisor.observability import SupervisorAdminSources
from gateway.supervisor.policy import RELOAD_TIMEOUT
from gateway.supervisor.quota_backend import quota_url_for
from gateway.supervisor.startup import (
    StartupError,
    bind_admin_socket,
    check_listen_address,
    validate_deployment,
)
from workers.admin import AdminApp, AdminServer

log = logging.getLogger("gridgate.supervisor")


class ReloadMixin:
    """SIGHUP: reload the config in place or by starting, promoting or abandoning a generation."""

    # ------------------------------------------------------------------ the signal action (SIGHUP)

    def handle_reload(self) -> None:
        if self._stopping:
            return
        if self.pending is not None:
            self._reload_again = True  # picked up when the reload in progress ends
            return
        self.reloads_total += 1
        self.notifier.reloading("reloading configuration")
        try:
            new = self.overrides.apply(load_config(self.config_path))
            if new.worker_count() > self.max_workers:
                raise ConfigError([
                    f"workers: {new.worker_count()} exceeds the {self.max_workers} the shared memory was sized "
                    "for at start; restart the service to grow further"
                ])
            validate_deployment(new)
        except ConfigError as exc:
            self._reload_failed(exc.problems)
            return

        if _same_workers(new, self.config):
            # Nothing a worker cares about changed: they only need to re-read the overlay.
            try:
                self._swap_admin(new, bind_admin_socket(new.admin.listen) if _admin_moved(new, self.config) else None)
            except StartupError as exc:
                self._reload_failed([str(exc)])
                return
            if new.workers != self.config.workers:
                self.target = new.worker_count()
            self.config = new
            self._signal_serving(signal.SIGHUP)
            log.info("reload: configuration unchanged for workers; forwarded SIGHUP to re-read the overlay")
            self.notifier.ready(self._status_text())
            return
        self._start_generation(new)

    # ------------------------------------------------------------------ reload: generations

    def _start_generation(self, new: Config) -> None:
        if self._desired_workers(new) > self.slots.free:
            self._reload_failed([
                f"workers: {self._desired_workers(new)} new workers need shared-memory rows but only {self.slots.free} "
                "are free (older generations are still draining); retry when they have finished"
            ])
            return
        try:
            if new.listen != self.config.listen:
                check_listen_address(new.listen)
            quota_url_for(new, self.embedded_quota)
            # Both generations' endpoints keep slots while both run; the old ones are freed afterwards.
            self.segment.directory.assign(endpoint_ids(self.config, new))
            self._endpoint_slots_widened = True
            admin_sock = bind_admin_socket(new.admin.listen) if _admin_moved(new, self.config) else None
        except StartupError as exc:
            self._reload_failed([str(exc)])
            return
        except ValueError as exc:  # shm.segment.ShmCapacityError
            self._reload_failed([f"clusters: {exc}; restart the service to resize shared memory"])
            return
        # Numbers are never reused: an abandoned generation may still be draining when the next starts.
        self._generations_started += 1
        generation = self._generations_started
        workers = self._desired_workers(new)
        self.pending = PendingGeneration(new, generation, time.monotonic() + RELOAD_TIMEOUT, admin_sock, workers)
        for _ in range(workers):
            self._spawn_worker(new, self.pending.generation)
        log.info("reload: starting generation %d with %d workers", self.pending.generation, workers)

    def _desired_workers(self, new: Config) -> int:
        """The config's count when its ``workers`` changed; else the current one, SIGTTIN/TTOU included."""
        return new.worker_count() if new.workers != self.config.workers else self.target

    def _advance_reload(self, now: float) -> None:
        pending = self.pending
        if pending is None:
            return
        booting = [c for c in self._workers() if c.generation == pending.generation and not c.retiring]
        if len(booting) == pending.workers and all(c.ready for c in booting):
            self._promote(pending, booting)
        elif now >= pending.deadline:
            self._abandon_generation(f"new workers not ready within {RELOAD_TIMEOUT:.0f}s")

    def _promote(self, pending: PendingGeneration, fresh: list[Child]) -> None:
        old_config = self.config
        for child in self._serving():
            self._retire(child, old_config.timeouts.graceful_shutdown)
        self.pending = None
        self.config, self.generation = pending.config, pending.generation
        self.target = pending.workers
        self._swap_admin(self.config, pending.admin_sock)
        # The prober follows the clusters: restart it with the new config.
        for child in self._health():
            self._retire(child, old_config.timeouts.graceful_shutdown)
        self._next_health_spawn = 0.0
        log.info("reload: generation %d serving (pids %s)", self.generation, ", ".join(str(c.pid) for c in fresh))
        self.notifier.ready(self._status_text())
        self._reload_follow_up()

    def _release_old_endpoint_slots(self) -> None:
        """Once only the current generation runs, endpoints it no longer has give their slots back."""
        if not self._endpoint_slots_widened or self.pending is not None:
            return
        if all(c.generation == self.generation for c in self.children.values()):
            self.segment.directory.assign(endpoint_ids(self.config))
            self._endpoint_slots_widened = False

    def _abandon_generation(self, reason: str) -> None:
        pending = self.pending
        assert pending is not None
        self.pending = None
        for child in self._workers():
            if child.generation == pending.generation:
                self._retire(child, 0.0)
        if pending.admin_sock is not None:
            pending.admin_sock.close()
        self._reload_failed([reason])

    def _reload_failed(self, problems: list[str]) -> None:
        self.reload_failures_total += 1
        for problem in problems:
            log.error("reload rejected, keeping the running config: %s", problem)
        self.notifier.ready(self._status_text())
        self._reload_follow_up()

    def _reload_follow_up(self) -> None:
        if self._reload_again and self._events is not None:
            self._reload_again = False
            self._events.put_nowait("reload")

    def _swap_admin(self, config: Config, new_sock: socket.socket | None) -> None:
        if new_sock is None or self.admin is None:
            return
        old = self.admin
        self.admin = AdminServer(AdminApp(SupervisorAdminSources(self), self.metrics), new_sock)
        in_background(self.admin.start())
        in_background(old.close())
        log.info("admin listener moved to %s", config.admin.listen)


def _same_workers(new: Config, old: Config) -> bool:
    """True when only supervisor-side settings (worker count, admin listener) differ."""
    return msgspec.structs.replace(old, workers=new.workers, admin=new.admin) == new


def _admin_moved(new: Config, old: Config) -> bool:
    return new.admin.listen != old.admin.listen
