"""The supervisor's children: forking, reaping, replacing with backoff, retiring and signalling them.

``ProcessMixin`` is one part of ``Supervisor`` (arbiter.py) and shares its state: ``children`` (pid ->
``Child``), ``slots``, the backoffs and spawn times. A crash during start-up counts towards giving up; a
crash of a pending generation abandons the reload (reload.py).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable

from gateway.config import Config
from gateway.host_segment import AFFINITY_REGION, METRICS_REGION
from gateway.supervisor.children import describe_exit, fork_child, loop_internal_fds, needs_health_process
from gateway.supervisor.lifecycle import Child
from gateway.supervisor.policy import (
    BOOT_TIMEOUT,
    EXIT_CANNOT_BIND,
    HUNG_AFTER,
    KILL_GRACE,
    STARTUP_FAILURE_LIMIT,
)
from gateway.supervisor.quota_backend import quota_url_for
from workers.context import WorkerContext

log = logging.getLogger("gridgate.supervisor")


class ProcessMixin:
    """Spawning, reaping and retiring the children; the views of them the other parts use."""

    # ------------------------------------------------------------------ forking

    def _spawn_worker(self, config: Config, generation: int) -> None:
        if not self.slots.free:
            # Every row is held by a worker still draining: the maintenance tick retries once one exits.
            log.warning("no free shared-memory worker row (workers still draining); worker start postponed")
            return
        self._spawn("worker", self.worker_entry, config, generation)

    def _spawn(self, role: str, entry: Callable[[WorkerContext], object], config: Config, generation: int) -> None:
        slot = self.slots.acquire() if role == "worker" else -1  # the health process has no worker row
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)  # a stuck supervisor must never block a worker: status.py drops instead
        ctx = WorkerContext(
            config=config, slot=slot, generation=generation, segment=self.segment,
            status_fd=write_fd, quota_url=quota_url_for(config, self.embedded_quota),
            extras={
                "role": role, "affinity_region": AFFINITY_REGION, "affinity_capacity": self.affinity_capacity,
                "metrics_region": METRICS_REGION, "overlay_fallback": self.last_good_overlay.data,
            },
        )
        if self.segment is not None and slot >= 0:
            self.segment.reset_worker_row(slot)
            self.segment.claim_worker_row(slot)  # readers sum rows up to the highest claimed one
        pid = fork_child(entry, ctx, close_in_child=[read_fd, *self._supervisor_fds()])
        os.close(write_fd)
        child = Child(role, pid, slot, generation, read_fd, time.monotonic())
        self.children[pid] = child
        assert self._loop is not None
        self._loop.add_reader(read_fd, self._read_status, child)
        log.info("%s pid %d started (slot %d, generation %d)", role, pid, slot, generation)

    def _supervisor_fds(self) -> list[int]:
        fds = [child.status_fd for child in self.children.values()]
        if self.admin is not None:
            fds.extend(self.admin.fds())
        if self.pending is not None and self.pending.admin_sock is not None:
            fds.append(self.pending.admin_sock.fileno())
        notify_fd = self.notifier.fileno()
        if notify_fd is not None:
            fds.append(notify_fd)
        if self._loop is not None:
            fds.extend(loop_internal_fds(self._loop))
        return fds

    # ------------------------------------------------------------------ reaping and replacing

    def _reap(self) -> None:
        # Only our own pids: waitpid(-1) would also steal the embedded Valkey's exit status from subprocess.
        for pid in list(self.children):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 0
            if done:
                self._on_exit(self.children.pop(pid), status)

    def _on_exit(self, child: Child, status: int) -> None:
        assert self._loop is not None
        # Read what the child said last (e.g. "draining") before closing its pipe.
        try:
            self._read_status(child)
        finally:
            self._loop.remove_reader(child.status_fd)
            os.close(child.status_fd)
        if child.slot >= 0:
            if self.segment is not None:
                self.segment.reset_worker_row(child.slot)  # its in-flight counts must not leak
            if self.worker_counters is not None:
                self.worker_counters.retire(child.slot)
            self.slots.release(child.slot)
        now = time.monotonic()
        lifetime = now - child.started_at
        how = describe_exit(status)
        if child.retiring:
            log.info("%s pid %d exited (%s) after retiring", child.role, child.pid, how)
            return
        if self.pending is not None and child.generation == self.pending.generation:
            if os.WIFEXITED(status) and os.WEXITSTATUS(status) == EXIT_CANNOT_BIND:
                self._abandon_generation(f"listen: cannot bind {self.pending.config.listen}: address already in use")
            else:
                self._abandon_generation(f"new worker pid {child.pid} {how} before it was ready")
            return
        if child.role == "health":
            delay = self._health_backoff.next_delay(lifetime)
            self._next_health_spawn = now + delay
            log.warning("health pid %d %s; restarting in %.1fs", child.pid, how, delay)
            return
        self.restarts_total += 1
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == EXIT_CANNOT_BIND and not self._ever_ready:
            self._fail(f"listen: cannot bind {self.config.listen}: address already in use")
            return
        if not self._ever_ready and not child.ready:
            self._startup_failures += 1
            if self._startup_failures >= STARTUP_FAILURE_LIMIT:
                self._fail(f"workers fail to start ({how}, {self._startup_failures} times); see the log above")
                return
        delay = self._worker_backoff.next_delay(lifetime)
        self._next_worker_spawn = max(self._next_worker_spawn, now + delay)
        log.warning("worker pid %d %s after %.1fs; replacing it in %.1fs", child.pid, how, lifetime, delay)

    def _maintain_workers(self, now: float) -> None:
        serving = self._serving()
        missing = self.target - len(serving)
        if missing > 0 and now >= self._next_worker_spawn:
            for _ in range(missing):
                self._spawn_worker(self.config, self.generation)
        elif missing < 0:
            # Retire the youngest: the older ones have warm pools and caches.
            for child in sorted(serving, key=lambda c: c.started_at)[missing:]:
                self._retire(child, self.config.timeouts.graceful_shutdown)
        for child in self._workers():
            if child.retiring:
                continue
            if not child.ready and now - child.started_at > BOOT_TIMEOUT:
                log.error("worker pid %d not ready after %.0fs; killing it", child.pid, BOOT_TIMEOUT)
                self._signal(child, signal.SIGKILL)
            elif child.ready and child.heartbeat_age(now) > HUNG_AFTER:
                log.error("worker pid %d sent no heartbeat for %.0fs; killing it", child.pid, HUNG_AFTER)
                self._signal(child, signal.SIGKILL)

    def _maintain_health(self, now: float) -> None:
        # One writer of the health records: a replacement starts only once the old prober is reaped.
        prober_alive = any(c.role == "health" for c in self.children.values())
        if needs_health_process(self.config) and not prober_alive and now >= self._next_health_spawn:
            self._spawn("health", self.health_entry, self.config, self.generation)

    def _retire(self, child: Child, grace: float) -> None:
        """SIGTERM now (the worker drains), SIGKILL once ``grace`` (+ a little) has passed."""
        deadline = time.monotonic() + grace + KILL_GRACE
        child.kill_at = deadline if child.kill_at is None else min(child.kill_at, deadline)
        if not child.retiring:
            child.retiring = True
            self._signal(child, signal.SIGTERM)

    def _kill_overdue(self, now: float) -> None:
        for child in self.children.values():
            if child.kill_at is not None and now >= child.kill_at:
                log.warning("%s pid %d still running after its drain deadline; SIGKILL", child.role, child.pid)
                self._signal(child, signal.SIGKILL)
                child.kill_at = None  # once

    def _signal(self, child: Child, sig: signal.Signals) -> None:
        try:
            os.kill(child.pid, sig)
        except ProcessLookupError:
            pass

    def _signal_serving(self, sig: signal.Signals) -> None:
        for child in self._serving() + self._health():
            self._signal(child, sig)

    # ------------------------------------------------------------------ views

    def _workers(self) -> list[Child]:
        return [c for c in self.children.values() if c.role == "worker"]

    def _serving(self) -> list[Child]:
        """Workers of the active generation that are not being retired."""
        return [c for c in self._workers() if c.generation == self.generation and not c.retiring]

    def _health(self) -> list[Child]:
        return [c for c in self.children.values() if c.role == "health" and not c.retiring]
