"""Reload (SIGHUP) by generation swap.

Every config reload that needs new workers forks a new generation next to the old one, waits until
all of it reports ``ready``, then retires the old one with SIGTERM (drain) and SIGKILL after
``graceful_shutdown``. The new worker at each position inherits the old one's listening socket
(listeners.py), so no listener closes and no connection waiting to be accepted is refused or reset. A
reload that changes nothing a worker cares about only forwards SIGHUP so the workers re-read the
overlay. An invalid config, a taken port or too little shared memory keeps the running config.

``GenerationSwap`` owns the running config and the reload in progress; the decisions themselves are
pure (generations.py).
"""

from __future__ import annotations

import hashlib
import logging
import re
import signal
import socket
import ssl
import time
from collections.abc import Callable

from gateway.admin.server import AdminServer
from gateway.check import validate_deployment
from gateway.config import Config, ConfigError, load_config
from gateway.host_segment import endpoint_ids
from gateway.supervisor.children import describe_exit
from gateway.supervisor.generations import ReloadPlan, SwapStep, plan_reload, swap_step
from gateway.supervisor.lifecycle import Child, PendingGeneration, in_background
from gateway.supervisor.policy import RELOAD_TIMEOUT
from gateway.supervisor.quota_backend import EmbeddedQuotaBackend, quota_url_for
from gateway.supervisor.readiness import Readiness
from gateway.supervisor.spend import warn_unmatched_overrides
from gateway.supervisor.startup import (
    RunOverrides,
    StartupError,
    bind_admin_socket,
    bind_error,
    check_listen_address,
)
from gateway.supervisor.worker_set import WorkerSet
from shm.segment import Segment

log = logging.getLogger("gridgate.supervisor")

_PEM_CERTIFICATE = re.compile(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.S)


def certificate_fingerprint(config: Config) -> str | None:
    """SHA-256 of the serving certificate of ``server_tls`` (the first in its chain file), as
    ``openssl x509 -noout -fingerprint -sha256`` prints it; None without HTTPS or a readable file."""
    if config.server_tls is None:
        return None
    try:
        with open(config.file_path(config.server_tls.cert_file), "rb") as handle:
            found = _PEM_CERTIFICATE.search(handle.read())
        if found is None:
            return None
        digest = hashlib.sha256(ssl.PEM_cert_to_DER_cert(found.group().decode("ascii"))).hexdigest().upper()
    except (OSError, ValueError):
        return None
    return ":".join(digest[i:i + 2] for i in range(0, len(digest), 2))


def certificate_note(config: Config, before: str | None, after: str | None) -> str | None:
    """The log line that says what a reload did to the HTTPS certificate; None without HTTPS."""
    if config.server_tls is None or after is None:
        return None
    path = config.file_path(config.server_tls.cert_file)
    if after == before:
        return f"reload: server_tls certificate {path} re-read, unchanged (sha256 {after})"
    return (f"reload: server_tls certificate {path} reloaded (sha256 {after}, was {before or 'none'}): new "
            "handshakes use it, open connections keep theirs")


class GenerationSwap:
    """SIGHUP: reload the config in place or by starting, promoting or abandoning a generation."""

    def __init__(
        self,
        config_path: str,
        overrides: RunOverrides,
        config: Config,
        *,
        workers: WorkerSet,
        readiness: Readiness,
        admin: AdminServer,
        segment: Segment,
        quota_backend: EmbeddedQuotaBackend,
        request_reload: Callable[[], None],
        for_workers: Callable[[Config], Config] = lambda config: config,
    ) -> None:
        self._config_path = config_path
        self._overrides = overrides
        self.config = config  # the running config: the serving generation's
        self.pending: PendingGeneration | None = None
        self.reloads_total = 0
        self.reload_failures_total = 0
        self._workers = workers
        self._readiness = readiness
        self._admin = admin
        self._segment = segment
        self._quota_backend = quota_backend
        self._request_reload = request_reload
        self._for_workers = for_workers  # the overlay feed's view of a config (overlay_feed.py)
        self._reload_again = False
        self._endpoint_slots_widened = False  # the directory holds two generations' endpoints
        self._certificate = certificate_fingerprint(config)  # the serving generation's HTTPS certificate
        # Numbers are never reused: an abandoned generation may still be draining when the next starts.
        self._generations_started = workers.generation

    def fds(self) -> list[int]:
        """The admin socket bound for a pending generation: a forked child must close it."""
        sock = None if self.pending is None else self.pending.admin_sock
        return [] if sock is None else [sock.fileno()]

    # ------------------------------------------------------------------ SIGHUP

    def reload(self) -> None:
        if self.pending is not None:
            self._reload_again = True  # picked up when the reload in progress ends
            return
        self.reloads_total += 1
        self._readiness.reloading()
        workers = self._workers
        try:
            new = self._for_workers(self._overrides.apply(load_config(self._config_path)))
            plan = plan_reload(new, self.config, target=workers.target, max_workers=workers.max_workers,
                               free_rows=workers.free_rows)
            overlay = validate_deployment(new)
        except ConfigError as exc:
            self._refused(exc.problems)
            return
        warn_unmatched_overrides(new, overlay)
        if plan.new_generation:
            self._start_generation(new, plan)
        else:
            self._apply_in_place(new, plan)

    def _apply_in_place(self, new: Config, plan: ReloadPlan) -> None:
        try:
            admin_sock = bind_admin_socket(new.admin.listen) if plan.admin_moved else None
        except StartupError as exc:
            self._refused([str(exc)])
            return
        self._move_admin(new, admin_sock)
        self._workers.resize(plan.workers)
        self.config = new
        self._workers.signal_serving(signal.SIGHUP)
        log.info("reload: configuration unchanged for workers; forwarded SIGHUP to re-read the overlay"
                 + (" and the TLS certificate" if new.server_tls is not None else ""))
        self._certificate_served(new)
        self._readiness.reloaded()

    def _start_generation(self, new: Config, plan: ReloadPlan) -> None:
        try:
            if plan.listen_moved:
                check_listen_address(new.listen)
            try:
                self._workers.prepare_listeners(new.listen, plan.workers)
            except OSError as exc:
                raise bind_error("listen", new.listen, exc) from None
            quota_url_for(new, self._quota_backend)
            # Both generations' endpoints keep slots while both run; the old ones are freed afterwards.
            self._segment.directory.assign(endpoint_ids(self.config, new))
            self._endpoint_slots_widened = True
            admin_sock = bind_admin_socket(new.admin.listen) if plan.admin_moved else None
        except StartupError as exc:
            self._refused([str(exc)])
            return
        except ValueError as exc:  # shm.segment.ShmCapacityError
            self._refused([f"clusters: {exc}; restart the service to resize shared memory"])
            return
        self._generations_started += 1
        generation = self._generations_started
        self.pending = PendingGeneration(new, generation, time.monotonic() + RELOAD_TIMEOUT, admin_sock, plan.workers)
        for _ in range(plan.workers):
            self._workers.spawn_worker(new, generation)
        log.info("reload: starting generation %d with %d workers", generation, plan.workers)

    # ------------------------------------------------------------------ a generation in progress

    def advance(self, now: float) -> None:
        """Every tick: promote the pending generation once it is ready, abandon it once it is late."""
        pending = self.pending
        if pending is None:
            return
        step = swap_step(pending, self._workers.booting(pending.generation), now)
        if step is SwapStep.PROMOTE:
            self._promote(pending)
        elif step is SwapStep.ABANDON:
            self._abandon(f"new workers not ready within {RELOAD_TIMEOUT:.0f}s")

    def pending_worker_died(self, child: Child, status: int) -> bool:
        """A child of the pending generation died before it was ready: abandon the reload. False if not one."""
        pending = self.pending
        if pending is None or child.generation != pending.generation:
            return False
        self._abandon(f"new worker pid {child.pid} {describe_exit(status)} before it was ready")
        return True

    def release_old_endpoint_slots(self) -> None:
        """Once only the current generation runs, endpoints it no longer has give their slots back."""
        if not self._endpoint_slots_widened or self.pending is not None:
            return
        if self._workers.only_generation(self._workers.generation):
            self._segment.directory.assign(endpoint_ids(self.config))
            self._endpoint_slots_widened = False

    def cancel(self) -> None:
        """The supervisor stops: forget a reload in progress (its workers are retired with the rest)."""
        if self.pending is not None and self.pending.admin_sock is not None:
            self.pending.admin_sock.close()
        self.pending = None

    def _promote(self, pending: PendingGeneration) -> None:
        fresh = self._workers.booting(pending.generation)
        self.pending = None
        self._workers.promote(pending.generation, pending.workers, self.config.timeouts.graceful_shutdown)
        self.config = pending.config
        self._move_admin(self.config, pending.admin_sock)
        log.info("reload: generation %d serving (pids %s)", pending.generation, ", ".join(str(c.pid) for c in fresh))
        self._certificate_served(self.config)
        self._readiness.reloaded()
        self._follow_up()

    def _abandon(self, reason: str) -> None:
        pending = self.pending
        assert pending is not None
        self.pending = None
        self._workers.abandon(pending.generation)
        if pending.admin_sock is not None:
            pending.admin_sock.close()
        self._refused([reason])

    def _refused(self, problems: list[str]) -> None:
        self.reload_failures_total += 1
        for problem in problems:
            log.error("reload rejected, keeping the running config: %s", problem)
        self._readiness.reloaded()
        self._follow_up()

    def _follow_up(self) -> None:
        if self._reload_again:
            self._reload_again = False
            self._request_reload()

    def _certificate_served(self, config: Config) -> None:
        """The workers serve ``config``'s certificate now (it loaded in ``validate_deployment``): say which."""
        fingerprint = certificate_fingerprint(config)
        note = certificate_note(config, self._certificate, fingerprint)
        self._certificate = fingerprint
        if note is not None:
            log.info("%s", note)

    def _move_admin(self, config: Config, sock: socket.socket | None) -> None:
        if sock is None:
            return
        in_background(self._admin.start(sock))
        log.info("admin listener moved to %s", config.admin.listen)
