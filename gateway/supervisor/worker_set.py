"""The supervisor's children: forking, status pipes, reaping, replacing with backoff, retiring.

``WorkerSet`` owns the child records (pid -> ``Child``), the shared-memory row pool, the listening
sockets (listeners.py), the crash backoffs, the worker count (SIGTTIN/SIGTTOU) and the number of the
generation that serves. It does
not decide what a status message means or what a reload is: messages go to the ``on_status``
callback, and a child of a pending generation that dies is reported back by ``reap``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable

from gateway.config import Config
from gateway.health.watch import HealthWatch
from gateway.host_segment import PREFIXES_REGION
from gateway.process_protocol import StatusMessage, WorkerContext
from gateway.supervisor.children import describe_exit, fork_child, needs_health_process
from gateway.supervisor.lifecycle import Child, CrashBackoff, SlotPool, StartupGuard
from gateway.supervisor.listeners import ListenerKey, ListenerSockets, lowest_free_position
from gateway.supervisor.policy import BOOT_TIMEOUT, HUNG_AFTER, KILL_GRACE
from gateway.supervisor.worker_counters import WorkerCounters
from shm.prefixes import PrefixCells
from shm.segment import Segment

log = logging.getLogger("gridgate.supervisor")

Entry = Callable[[WorkerContext], object]
# (config, slot, generation, status_fd, listen_fd) -> the context a child is forked with.
ContextFactory = Callable[[Config, int, int, int, int | None], WorkerContext]


class WorkerSet:
    """Worker processes of every generation, and the one health prober."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        segment: Segment,
        counters: WorkerCounters,
        *,
        rows: int,
        target: int,
        max_workers: int,
        worker_entry: Entry,
        health_entry: Entry,
        make_context: ContextFactory,
        on_status: Callable[[Child, StatusMessage, float], None],
        inherited_fds: Callable[[], list[int]],
    ) -> None:
        self._loop = loop
        self._segment = segment
        self._counters = counters
        self._worker_entry = worker_entry
        self._health_entry = health_entry
        self._make_context = make_context
        self._on_status = on_status
        self._inherited_fds = inherited_fds
        self._children: dict[int, Child] = {}
        self._slots = SlotPool(rows)
        self._listeners = ListenerSockets()
        self.target = target
        self.max_workers = max_workers
        self.generation = 1  # the generation that serves
        self.restarts_total = 0
        self._worker_backoff = CrashBackoff()
        self._health_backoff = CrashBackoff()
        self._startup = StartupGuard()
        self._next_worker_spawn = 0.0
        self._next_health_spawn = 0.0
        self.health_watch = HealthWatch(segment)  # the prober's heartbeat in shared memory

    # ------------------------------------------------------------------ views

    def all(self) -> list[Child]:
        return list(self._children.values())

    def workers(self) -> list[Child]:
        """Worker processes of every generation, retiring ones included."""
        return [c for c in self._children.values() if c.role == "worker"]

    def serving(self) -> list[Child]:
        """Workers of the serving generation that are not being retired."""
        return [c for c in self.workers() if c.generation == self.generation and not c.retiring]

    def booting(self, generation: int) -> list[Child]:
        """Workers of ``generation`` (a pending one) that are not being retired."""
        return [c for c in self.workers() if c.generation == generation and not c.retiring]

    def health(self) -> list[Child]:
        return [c for c in self._children.values() if c.role == "health" and not c.retiring]

    def only_generation(self, generation: int) -> bool:
        """True when every live child (the prober included) belongs to ``generation``."""
        return all(c.generation == generation for c in self._children.values())

    def worker_slots(self) -> list[int]:
        return [c.slot for c in self.workers()]

    def status_fds(self) -> list[int]:
        return [c.status_fd for c in self._children.values()]

    @property
    def free_rows(self) -> int:
        return self._slots.free

    def __len__(self) -> int:
        return len(self._children)

    # ------------------------------------------------------------------ the worker count

    def grow(self) -> None:
        """SIGTTIN: one worker more, up to what the shared memory was sized for."""
        if self.target >= self.max_workers:
            log.warning("SIGTTIN ignored: already at the %d workers the shared memory was sized for", self.max_workers)
            return
        self.target += 1
        log.info("SIGTTIN: workers %d -> %d", self.target - 1, self.target)

    def shrink(self) -> None:
        """SIGTTOU: one worker less, never below one."""
        if self.target <= 1:
            return
        self.target -= 1
        log.info("SIGTTOU: workers %d -> %d", self.target + 1, self.target)

    def resize(self, workers: int) -> None:
        """A reload applied in place sets the count (the config's, or the SIGTTIN/SIGTTOU-adjusted one)."""
        self.target = workers

    # ------------------------------------------------------------------ forking

    def prepare_listeners(self, address: str, workers: int) -> None:
        """Bind the sockets a generation of ``workers`` on ``address`` serves on; OSError if one cannot be."""
        for position in range(workers):
            self._listeners.acquire((address, position))

    def spawn_worker(self, config: Config, generation: int) -> bool:
        """Fork a worker of ``generation`` at its lowest free position; False when it has to wait."""
        if not self._slots.free:
            # Every row is held by a worker still draining: the maintenance tick retries once one exits.
            log.warning("no free shared-memory worker row (workers still draining); worker start postponed")
            return False
        taken = (c.listener[1] for c in self.booting(generation) if c.listener is not None)
        listener = (config.listen, lowest_free_position(taken))
        try:
            sock = self._listeners.acquire(listener)
        except OSError as exc:
            log.error("listen: cannot bind %s: %s; worker start postponed", config.listen, exc.strerror or exc)
            return False
        self._spawn("worker", self._worker_entry, config, generation, listener, sock.fileno())
        return True

    def _spawn(self, role: str, entry: Entry, config: Config, generation: int,
               listener: ListenerKey | None = None, listen_fd: int | None = None) -> None:
        slot = self._slots.acquire() if role == "worker" else -1  # the health process has no worker row
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)  # a stuck supervisor must never block a worker: it drops instead
        ctx = self._make_context(config, slot, generation, write_fd, listen_fd)
        if slot >= 0:
            self._segment.reset_worker_row(slot)
            self._segment.claim_worker_row(slot)  # readers sum rows up to the highest claimed one
        # A child keeps only its own listening socket: a retired one must close when its worker exits.
        close_in_child = [read_fd, *self._inherited_fds(), *self._listeners.fds(but=listener)]
        pid = fork_child(entry, ctx, close_in_child=close_in_child)
        os.close(write_fd)
        child = Child(role, pid, slot, generation, read_fd, time.monotonic(), listener=listener)
        self._children[pid] = child
        self._loop.add_reader(read_fd, self._read_status, child)
        log.info("%s pid %d started (slot %d, generation %d)", role, pid, slot, generation)

    def _read_status(self, child: Child) -> None:
        try:
            data = os.read(child.status_fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # EOF: the child is gone; not ready from now on, even before SIGCHLD reaps it
            self._loop.remove_reader(child.status_fd)
            child.ready = False
            return
        now = time.monotonic()
        for message in child.reader.feed(data):
            self._on_status(child, message, now)

    # ------------------------------------------------------------------ reaping and replacing

    def reap(self) -> list[tuple[Child, int]]:
        """Collect the children that exited, free their pipes and rows; returns them with their wait status."""
        exited = []
        # Only our own pids: waitpid(-1) would also steal the embedded Valkey's exit status from subprocess.
        for pid in list(self._children):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 0
            if done:
                child = self._children.pop(pid)
                self._release(child)
                exited.append((child, status))
        return exited

    def _release(self, child: Child) -> None:
        # Read what the child said last (e.g. "draining") before closing its pipe.
        try:
            self._read_status(child)
        finally:
            self._loop.remove_reader(child.status_fd)
            os.close(child.status_fd)
        if child.slot >= 0:
            self._segment.reset_worker_row(child.slot)  # its in-flight counts must not leak
            PrefixCells.attach(self._segment.region(PREFIXES_REGION)).reset_inflight(child.slot)  # nor its prefixes'
            self._counters.retire(child.slot)
            self._slots.release(child.slot)

    def replace_later(self, child: Child, status: int, now: float, *, ever_ready: bool) -> str | None:
        """Schedule the replacement of a child that died unasked; returns why to give up, if so."""
        lifetime = now - child.started_at
        how = describe_exit(status)
        if child.role == "health":
            delay = self._health_backoff.next_delay(lifetime)
            self._next_health_spawn = now + delay
            log.warning("health pid %d %s; restarting in %.1fs", child.pid, how, delay)
            return None
        self.restarts_total += 1
        if not ever_ready and not child.ready and self._startup.boot_failed():
            return f"workers fail to start ({how}, {self._startup.failures} times); see the log above"
        delay = self._worker_backoff.next_delay(lifetime)
        self._next_worker_spawn = max(self._next_worker_spawn, now + delay)
        log.warning("worker pid %d %s after %.1fs; replacing it in %.1fs", child.pid, how, lifetime, delay)
        return None

    def maintain(self, config: Config, now: float) -> None:
        """Keep ``target`` serving workers and one prober; kill workers that never boot or hang."""
        serving = self.serving()
        missing = self.target - len(serving)
        if missing > 0 and now >= self._next_worker_spawn:
            for _ in range(missing):
                if not self.spawn_worker(config, self.generation):
                    break
        elif missing < 0:
            # Retire the youngest: the older ones have warm pools and caches.
            for child in sorted(serving, key=lambda c: c.started_at)[missing:]:
                self.retire(child, config.timeouts.graceful_shutdown)
        for child in self.workers():
            if child.retiring:
                continue
            if not child.ready and now - child.started_at > BOOT_TIMEOUT:
                log.error("worker pid %d not ready after %.0fs; killing it", child.pid, BOOT_TIMEOUT)
                _signal(child, signal.SIGKILL)
            elif child.ready and child.heartbeat_age(now) > HUNG_AFTER:
                log.error("worker pid %d sent no heartbeat for %.0fs; killing it", child.pid, HUNG_AFTER)
                _signal(child, signal.SIGKILL)
        self._watch_health()
        # One writer of the health records: a replacement starts only once the old prober is reaped.
        prober_alive = any(c.role == "health" for c in self._children.values())
        if needs_health_process(config) and not prober_alive and now >= self._next_health_spawn:
            self._spawn("health", self._health_entry, config, self.generation)
        # A crashed worker's socket waits for its replacement only when that starts at once.
        self._release_listeners()

    def _watch_health(self) -> None:
        """Keep the verdicts-stale flag in step with the prober's heartbeat; kill a prober that stopped
        beating (gateway.health.watch): it is replaced like a dead one once reaped."""
        prober = next((c for c in self.health()), None)
        verdict = self.health_watch.check(time.monotonic_ns(), prober.pid if prober else None,
                                          int(prober.started_at * 1e9) if prober else 0)
        if verdict.hung and prober is not None:
            own_beat = prober.pid == self.health_watch.writer_pid()
            silence = f"no heartbeat for {verdict.age_s:.1f}s" if own_beat else "no heartbeat since it started"
            log.error("health pid %d sent %s; killing it (its verdicts count as unknown until a new one beats)",
                      prober.pid, silence)
            _signal(prober, signal.SIGKILL)

    # ------------------------------------------------------------------ generations

    def promote(self, generation: int, workers: int, grace: float) -> None:
        """``generation`` serves from now on with ``workers`` workers; the old one and the prober drain."""
        for child in self.serving() + self.health():
            self.retire(child, grace)
        self.generation, self.target = generation, workers
        self._next_health_spawn = 0.0  # the prober follows the clusters: restart it with the new config

    def abandon(self, generation: int) -> None:
        """Stop a pending generation's workers at once."""
        for child in self.workers():
            if child.generation == generation:
                self.retire(child, 0.0)

    # ------------------------------------------------------------------ retiring and signalling

    def retire(self, child: Child, grace: float) -> None:
        """SIGTERM now (the worker drains), SIGKILL once ``grace`` (+ a little) has passed."""
        deadline = time.monotonic() + grace + KILL_GRACE
        child.kill_at = deadline if child.kill_at is None else min(child.kill_at, deadline)
        if not child.retiring:
            child.retiring = True
            # Before the signal: when no serving worker takes over its socket, the worker's own close
            # (as it starts draining) must be the last one, before its clients reconnect elsewhere.
            self._release_listeners()
            _signal(child, signal.SIGTERM)

    def retire_all(self, grace: float) -> None:
        for child in self.all():
            self.retire(child, grace)

    def _release_listeners(self) -> None:
        """Close the sockets no serving or booting worker holds (a draining worker closes its own copy)."""
        self._listeners.keep_only(c.listener for c in self.workers() if not c.retiring and c.listener is not None)

    def draining(self, child: Child, now: float, grace: float) -> None:
        """A worker said it drains (it may decide so on its own): it is no longer serving."""
        child.retiring = True
        if child.kill_at is None:
            child.kill_at = now + grace + KILL_GRACE

    def kill_overdue(self, now: float) -> None:
        for child in self._children.values():
            if child.kill_at is not None and now >= child.kill_at:
                log.warning("%s pid %d still running after its drain deadline; SIGKILL", child.role, child.pid)
                _signal(child, signal.SIGKILL)
                child.kill_at = None  # once

    def kill_all(self) -> None:
        for child in self._children.values():
            _signal(child, signal.SIGKILL)

    def signal_workers(self, sig: signal.Signals) -> None:
        """Forward a signal to every worker, retiring ones included."""
        for child in self.workers():
            _signal(child, sig)

    def signal_serving(self, sig: signal.Signals) -> None:
        """Forward a signal to the serving workers and the prober (SIGHUP: re-read the overlay)."""
        for child in self.serving() + self.health():
            _signal(child, sig)


def _signal(child: Child, sig: signal.Signals) -> None:
    try:
        os.kill(child.pid, sig)
    except ProcessLookupError:
        pass
