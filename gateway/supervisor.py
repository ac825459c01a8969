"""The supervisor: owns the lifecycle of the worker processes (DESIGN "Process model").

Modelled on gunicorn's arbiter. Before forking it validates the config and the
overlay, starts the embedded Valkey when configured, creates the shared-memory
segment and binds the admin listener. Then one asyncio loop does all the work:

- signal handlers only enqueue an action name (``SIGNAL_ACTIONS``); the loop
  takes one action at a time, then runs ``_tick`` (reap, replace, retire, notify);
- workers report over a status pipe each (``workers/status.py``), read with
  ``loop.add_reader``; that is how readiness, serving revisions and heartbeats
  are known;
- the admin HTTP listener (``workers/admin.py``) runs on the same loop.

Generations: every config reload that needs new workers forks a new generation
next to the old one (``SO_REUSEPORT`` sockets overlap, so no connection is
refused), waits until all of it reports ``ready``, then retires the old one with
SIGTERM (drain) and SIGKILL after ``graceful_shutdown``. Shared-memory rows are
allocated for two full generations so both fit during the swap.

The supervisor does no request work.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NoReturn

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gateway.config import Config, ConfigError, load_config, parse_host_port
from gateway.endpoints import cluster_specs_from_config, endpoints_report
from gateway.host_segment import AFFINITY_REGION, METRICS_REGION, create_segment, endpoint_ids
from gateway.metrics import COUNTERS, render_prometheus
from gateway.notify import Notifier
from gateway.overlay.contract import OverlayRejected
from gateway.overlay.watch import load_overlay_file
from shm.metrics import MetricsTable
from shm.segment import MAX_WORKERS_LIMIT, Segment
from workers.admin import AdminApp, AdminServer, MetricsExposition, QuotaReporter, ReportUnavailable
from workers.context import WorkerContext
from workers.status import StatusReader

log = logging.getLogger("gridgate.supervisor")

# A worker exits with this code when its listening socket cannot be bound.
EXIT_CANNOT_BIND = 3

# Workers send a heartbeat once a second (workers/status.py).
HEARTBEAT_STALE_AFTER = 5.0  # readyz and the systemd watchdog stop vouching for it
HUNG_AFTER = 30.0  # the worker's loop is stuck: SIGKILL and replace it
BOOT_TIMEOUT = 60.0  # a worker that never reports ready is killed
RELOAD_TIMEOUT = 60.0  # a new generation that is not ready by then is abandoned
KILL_GRACE = 1.0  # after graceful_shutdown, before SIGKILL: lets a worker finish its own deadline

# Crash-loop protection: the first crash is replaced at once, then the delay doubles.
RESTART_BACKOFF_BASE = 0.5
RESTART_BACKOFF_CAP = 30.0
STABLE_AFTER = 10.0  # a worker that lived this long resets the backoff
STARTUP_FAILURE_LIMIT = 5  # consecutive boot failures before any worker was ever ready: give up

TICK = 0.25
_PR_SET_PDEATHSIG = 1

SIGNAL_ACTIONS: dict[signal.Signals, str] = {
    signal.SIGHUP: "reload",
    signal.SIGTERM: "terminate",
    signal.SIGINT: "interrupt",
    signal.SIGTTIN: "increment",
    signal.SIGTTOU: "decrement",
    signal.SIGCHLD: "reap",
}
WAKE = "wake"  # not a signal: a status message arrived, re-evaluate readiness now


class StartupError(Exception):
    """The gateway cannot start; the message is one line naming the cause."""


@dataclass(frozen=True, slots=True)
class RunOverrides:
    """Command-line values that win over the config file, at start and on every reload."""

    workers: int | str | None = None
    listen: str | None = None

    def apply(self, config: Config) -> Config:
        changes: dict[str, Any] = {}
        if self.workers is not None:
            changes["workers"] = self.workers
        if self.listen is not None:
            changes["listen"] = self.listen
        return msgspec.structs.replace(config, **changes) if changes else config


class CrashBackoff:
    """Delay before replacing a crashed worker: 0, base, 2*base, ... capped; reset by a stable worker."""

    def __init__(self, base: float | None = None, cap: float | None = None) -> None:
        self.base = RESTART_BACKOFF_BASE if base is None else base
        self.cap = RESTART_BACKOFF_CAP if cap is None else cap
        self.streak = 0

    def next_delay(self, lifetime: float) -> float:
        if lifetime >= STABLE_AFTER:
            self.streak = 0
        self.streak += 1
        return 0.0 if self.streak == 1 else min(self.cap, self.base * 2 ** (self.streak - 2))


class SlotPool:
    """Shared-memory row indexes; the lowest free one is handed out so rows stay dense."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free = set(range(capacity))

    def acquire(self) -> int:
        if not self._free:
            raise RuntimeError("no free shared-memory worker row")
        slot = min(self._free)
        self._free.remove(slot)
        return slot

    def release(self, slot: int) -> None:
        if 0 <= slot < self.capacity:
            self._free.add(slot)


@dataclass(eq=False)
class Child:
    """A forked process (a worker, or the health prober) and what it last told us."""

    role: str  # "worker" | "health"
    pid: int
    slot: int
    generation: int
    status_fd: int
    started_at: float
    reader: StatusReader = field(default_factory=StatusReader)
    ready: bool = False
    revision: str | None = None
    mode: str | None = None
    capabilities: list[str] = field(default_factory=list)
    last_heartbeat: float | None = None
    retiring: bool = False
    kill_at: float | None = None

    def heartbeat_age(self, now: float) -> float:
        return now - (self.last_heartbeat if self.last_heartbeat is not None else self.started_at)


@dataclass(eq=False)
class PendingGeneration:
    """A reload in progress: the new config's workers booting next to the serving ones."""

    config: Config
    generation: int
    deadline: float
    admin_sock: socket.socket | None  # bound early when admin.listen changes, swapped in on promotion


# --------------------------------------------------------------------------- pre-fork checks


def validate_overlay(config: Config) -> None:
    """Raise ConfigError when the overlay the config names would be rejected at startup."""
    path = config.overlay_path()
    if path is None:
        return
    try:
        load_overlay_file(path, config.routing.expected_overlay_scope)
    except OverlayRejected as exc:
        raise ConfigError([f"routing.overlay_file: {path}: {exc}"]) from None


def _resolve(address: str) -> tuple[int, tuple[Any, ...]]:
    host, port = parse_host_port(address)
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    return family, sockaddr


def _bind_error(field_name: str, address: str, exc: OSError) -> StartupError:
    reason = "address already in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
    return StartupError(f"{field_name}: cannot bind {address}: {reason}")


def check_listen_address(address: str) -> None:
    """Fail fast, with one line, when the data-plane port is taken.

    Bound without SO_REUSEPORT on purpose: that also detects another gateway
    (whose workers do use SO_REUSEPORT) instead of silently sharing its port.
    """
    try:
        family, sockaddr = _resolve(address)
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(sockaddr)
    except OSError as exc:
        raise _bind_error("listen", address, exc) from None


def bind_admin_socket(address: str) -> socket.socket:
    try:
        family, sockaddr = _resolve(address)
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        raise _bind_error("admin.listen", address, exc) from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(128)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise _bind_error("admin.listen", address, exc) from None
    return sock


def needs_health_process(config: Config) -> bool:
    return any(c.health_check is not None or c.outlier_detection is not None for c in config.clusters)


class WorkerCounters:
    """The workers' request counters in shared memory, summed when /metrics is scraped."""

    def __init__(self, segment: Segment) -> None:
        self.table = MetricsTable(segment.region(METRICS_REGION), segment.max_workers, COUNTERS)
        self.retired = [0] * COUNTERS  # dead workers' counts: totals must never go backwards

    def retire(self, slot: int) -> None:
        self.table.retire(slot, self.retired)

    def render(self, slots: list[int], cluster_names: list[str]) -> bytes:
        live = self.table.sum_rows(slots)
        return render_prometheus([a + b for a, b in zip(live, self.retired, strict=True)], cluster_names)


cluster_specs = cluster_specs_from_config


class EmbeddedQuotaBackend:
    """Starts the bundled Valkey for ``quota.backend.kind: embedded``; stops it at exit."""

    def __init__(self) -> None:
        self._server: Any = None
        self._data_dir: str | None = None
        self._owns_data_dir = False
        self.url: str | None = None

    def ensure_started(self, data_dir: str | None) -> str:
        if self.url is not None:
            return self.url
        from gateway.quota.embedded import EmbeddedValkey

        # quota.backend.data_dir, else systemd's StateDirectory=, else a private temp dir (not persistent).
        state = os.environ.get("STATE_DIRECTORY", "").split(":")[0]
        if data_dir is None and state:
            data_dir = os.path.join(state, "valkey")
        if data_dir is None:
            self._data_dir, self._owns_data_dir = tempfile.mkdtemp(prefix="gridgate-valkey-"), True
        else:
            self._data_dir = data_dir
        try:
            self._server = EmbeddedValkey(self._data_dir)
            self.url = self._server.start()
        except Exception as exc:
            self.stop()
            raise StartupError(f"quota.backend: cannot start the embedded Valkey in {self._data_dir}: {exc}") from None
        log.info("embedded Valkey started at %s", self.url)
        return self.url

    def stop(self) -> None:
        if self._server is not None:
            try:
                self._server.stop()
            except Exception:
                log.exception("stopping the embedded Valkey failed")
            self._server = None
        if self._owns_data_dir and self._data_dir:
            shutil.rmtree(self._data_dir, ignore_errors=True)
        self.url = None


def quota_url_for(config: Config, embedded: EmbeddedQuotaBackend) -> str | None:
    if config.quota is None:
        return None
    backend = config.quota.backend
    if backend.kind == "embedded":
        data_dir = None if backend.data_dir is None else os.path.join(config.base_dir, backend.data_dir)
        return embedded.ensure_started(data_dir)
    return config.quota.backend.url


# --------------------------------------------------------------------------- the child side of fork


def _loop_internal_fds(loop: asyncio.AbstractEventLoop) -> list[int]:
    """The epoll fd and self-pipe of the parent's loop: useless in a child, so closed there."""
    fds = []
    for attribute in ("_selector", "_ssock", "_csock"):
        try:
            fds.append(getattr(loop, attribute).fileno())
        except (AttributeError, OSError, ValueError):
            pass
    return fds


def _die_with_supervisor(supervisor_pid: int) -> None:
    """SIGTERM this child (a graceful drain) if the supervisor dies without stopping it."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the supervisor's own shutdown still applies
        return
    if os.getppid() != supervisor_pid:  # it died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def become_child(close_fds: list[int], supervisor_pid: int) -> None:
    """First thing after fork in the child: shed everything that belongs to the supervisor."""
    # Signals are blocked across fork (see Supervisor._fork); make them default before unblocking.
    signal.set_wakeup_fd(-1)
    for sig in SIGNAL_ACTIONS:
        signal.signal(sig, signal.SIG_DFL)
    # Ctrl-C reaches the whole process group; the supervisor turns it into SIGTERM per worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Forget the parent's running loop so the child can start its own (uvloop in workers).
    asyncio._set_running_loop(None)
    asyncio.set_event_loop_policy(None)
    for fd in close_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    _die_with_supervisor(supervisor_pid)  # an orphan at birth gets a pending SIGTERM: default action, gone
    signal.pthread_sigmask(signal.SIG_SETMASK, set())


def run_child(entry: Callable[[WorkerContext], object], ctx: WorkerContext) -> NoReturn:
    """Run a child's entry point; whatever happens, end the process here (never return into the parent's code)."""
    code = 1
    try:
        entry(ctx)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        try:
            log.exception("%s process (slot %d) crashed", getattr(entry, "__name__", "child"), ctx.slot)
        except BaseException:
            pass
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _default_worker_entry(ctx: WorkerContext) -> None:
    from workers.worker import worker_main

    worker_main(ctx)


def _default_health_entry(ctx: WorkerContext) -> None:
    from gateway.health import health_process_main

    health_process_main(cluster_specs(ctx.config), ctx.segment)


def _describe_exit(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit code {os.waitstatus_to_exitcode(status)}"


# --------------------------------------------------------------------------- the supervisor


class Supervisor:
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
                validate_overlay(self.config)  # an invalid overlay at startup is a startup error
            except ConfigError as exc:
                raise StartupError("; ".join(exc.problems)) from None
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
            validate_overlay(new)
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
        self.pending = PendingGeneration(new, generation, time.monotonic() + RELOAD_TIMEOUT, admin_sock)
        for _ in range(new.worker_count()):
            self._spawn_worker(new, self.pending.generation)
        log.info("reload: starting generation %d with %d workers", self.pending.generation, new.worker_count())

    def _advance_reload(self, now: float) -> None:
        pending = self.pending
        if pending is None:
            return
        booting = [c for c in self._workers() if c.generation == pending.generation and not c.retiring]
        if len(booting) == pending.config.worker_count() and all(c.ready for c in booting):
            self._promote(pending, booting)
        elif now >= pending.deadline:
            self._abandon_generation(f"new workers not ready within {RELOAD_TIMEOUT:.0f}s")

    def _promote(self, pending: PendingGeneration, fresh: list[Child]) -> None:
        old_config = self.config
        for child in self._serving():
            self._retire(child, old_config.timeouts.graceful_shutdown)
        self.pending = None
        self.config, self.generation = pending.config, pending.generation
        self.target = self.config.worker_count()
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
        asyncio.ensure_future(self.admin.start())
        asyncio.ensure_future(old.close())
        log.info("admin listener moved to %s", config.admin.listen)

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

    # ------------------------------------------------------------------ forking

    def _spawn_worker(self, config: Config, generation: int) -> None:
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
                "metrics_region": METRICS_REGION,
            },
        )
        if self.segment is not None and slot >= 0:
            self.segment.reset_worker_row(slot)
            self.segment.claim_worker_row(slot)  # readers sum rows up to the highest claimed one
        pid = self._fork(entry, ctx, close_in_child=[read_fd, *self._supervisor_fds()])
        os.close(write_fd)
        child = Child(role, pid, slot, generation, read_fd, time.monotonic())
        self.children[pid] = child
        assert self._loop is not None
        self._loop.add_reader(read_fd, self._read_status, child)
        log.info("%s pid %d started (slot %d, generation %d)", role, pid, slot, generation)

    def _fork(self, entry: Callable[[WorkerContext], object], ctx: WorkerContext, close_in_child: list[int]) -> int:
        # Blocked across fork: a signal landing in the child before it resets its handlers would
        # otherwise run the parent's handler there (and write into the parent's wakeup pipe).
        supervisor_pid = os.getpid()
        signal.pthread_sigmask(signal.SIG_BLOCK, set(SIGNAL_ACTIONS))
        try:
            pid = os.fork()
            if pid == 0:
                try:
                    become_child(close_in_child, supervisor_pid)
                except BaseException:
                    os._exit(1)  # never fall back into the parent's code
                run_child(entry, ctx)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, set(SIGNAL_ACTIONS))
        return pid

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
            fds.extend(_loop_internal_fds(self._loop))
        return fds

    # ------------------------------------------------------------------ status pipes

    def _read_status(self, child: Child) -> None:
        try:
            data = os.read(child.status_fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # EOF: the child is gone; not ready from now on, even before SIGCHLD reaps it
            assert self._loop is not None
            self._loop.remove_reader(child.status_fd)
            child.ready = False
            return
        now = time.monotonic()
        for message in child.reader.feed(data):
            self._apply_status(child, message, now)

    def _apply_status(self, child: Child, message: dict[str, Any], now: float) -> None:
        kind = message.get("kind")
        if kind == "heartbeat":
            child.last_heartbeat = now
        elif kind == "ready":
            first = not child.ready
            child.ready, child.last_heartbeat = True, now
            child.revision = message.get("revision")
            child.mode = message.get("mode")
            if "capabilities" in message:
                child.capabilities = list(message["capabilities"])
            if first:
                log.info("%s pid %d ready (overlay %s)", child.role, child.pid, (child.revision or "-")[:12])
                if self._events is not None:
                    self._events.put_nowait(WAKE)  # readiness and reloads advance without waiting a tick
        elif kind == "overlay_rejected":
            self.last_overlay_rejection = {
                "pid": child.pid,
                "reason": message.get("reason"),
                "retained_revision": message.get("retained_revision"),
            }
            log.warning(
                "worker pid %d rejected the overlay (%s); still serving %s",
                child.pid, message.get("reason"), message.get("retained_revision"),
            )
        elif kind == "draining":
            child.retiring = True
            if child.kill_at is None:  # the worker decided to drain on its own
                child.kill_at = now + self.config.timeouts.graceful_shutdown + KILL_GRACE

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
        how = _describe_exit(status)
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
        if needs_health_process(self.config) and not self._health() and now >= self._next_health_spawn:
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

    def readiness(self) -> tuple[bool, str]:
        if self._stopping:
            return False, "shutting down"
        serving = self._serving()
        if not serving:
            return False, "no worker is running"
        booting = [c for c in serving if not c.ready]
        if booting:
            return False, f"{len(booting)} of {len(serving)} workers have not reported ready"
        now = time.monotonic()
        stale = [c for c in serving if c.heartbeat_age(now) > HEARTBEAT_STALE_AFTER]
        if stale:
            return False, f"worker pid {stale[0].pid} sent no heartbeat for {stale[0].heartbeat_age(now):.1f}s"
        return True, "ok"

    def heartbeats_fresh(self) -> bool:
        now = time.monotonic()
        return all(c.heartbeat_age(now) <= HEARTBEAT_STALE_AFTER for c in self._serving() if c.ready)

    def _status_text(self) -> str:
        serving = self._serving()
        ready = [c for c in serving if c.ready]
        revisions = Counter(c.revision for c in ready if c.revision)
        revision = revisions.most_common(1)[0][0][:12] if revisions else "-"
        return f"{len(ready)}/{len(serving)} workers ready, generation {self.generation}, overlay {revision}"

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
                asyncio.ensure_future(reporter.close())
            reporter = self.quota_reporter = QuotaReporter(url, quota)
        return reporter

    # ------------------------------------------------------------------ systemd

    def _notify_systemd(self, now: float) -> None:
        if not self._stopping:
            ready, _ = self.readiness()
            if ready and not self._announced_ready:
                self._announced_ready = self._ever_ready = True
                self._startup_failures = 0
                log.info("all %d workers ready", len(self._serving()))
                self.notifier.ready(self._status_text())
            elif ready:
                self._ever_ready = True
            status = self._status_text()
            if status != self._last_status:
                self._last_status = status
                self.notifier.status(status)
        interval = self.notifier.watchdog_interval
        # The watchdog vouches for the workers too: a supervisor whose workers are hung must be restarted.
        if interval is not None and now >= self._next_watchdog and self.heartbeats_fresh():
            self.notifier.watchdog()
            self._next_watchdog = now + interval


def _same_workers(new: Config, old: Config) -> bool:
    """True when only supervisor-side settings (worker count, admin listener) differ."""
    return msgspec.structs.replace(old, workers=new.workers, admin=new.admin) == new


def _admin_moved(new: Config, old: Config) -> bool:
    return new.admin.listen != old.admin.listen


# --------------------------------------------------------------------------- admin and metrics


class SupervisorAdminSources:
    """What the admin pages read from the supervisor (workers/admin.py ``AdminSources``)."""

    def __init__(self, supervisor: Supervisor) -> None:
        self._supervisor = supervisor

    def readiness(self) -> tuple[bool, str]:
        return self._supervisor.readiness()

    def overlay_report(self) -> dict[str, Any]:
        serving = self._supervisor._serving()
        ready = [c for c in serving if c.ready]
        revisions = Counter(c.revision for c in ready)
        revision = revisions.most_common(1)[0][0] if revisions else None
        leader = next((c for c in ready if c.revision == revision), None)
        return {
            "serving_revision": revision,
            "mode": leader.mode if leader else None,
            "capabilities": leader.capabilities if leader else [],
            "converged": len(revisions) <= 1 and len(ready) == len(serving),
            "workers": [{"pid": c.pid, "serving_revision": c.revision} for c in serving],
            "last_rejection": self._supervisor.last_overlay_rejection,
        }

    def endpoints_report(self) -> dict[str, Any]:
        segment = self._supervisor.segment
        if segment is None:
            raise ReportUnavailable("shared memory is not available")
        return endpoints_report(segment, cluster_specs(self._supervisor.config))

    def quota_enabled(self) -> bool:
        return self._supervisor.config.quota is not None

    async def quota_report(self, tenant: str) -> dict[str, Any]:
        return await self._supervisor.current_quota_reporter().report(tenant)


class SupervisorCollector:
    """The supervisor's own metric families, computed at scrape time."""

    def __init__(self, supervisor: Supervisor) -> None:
        self._supervisor = supervisor

    def collect(self) -> Iterator[Any]:
        sup = self._supervisor
        now = time.monotonic()
        serving = sup._serving()
        yield GaugeMetricFamily("gridgate_workers_live", "Worker processes alive (all generations)", len(sup._workers()))
        yield GaugeMetricFamily("gridgate_workers_ready", "Serving workers that reported ready",
                                sum(1 for c in serving if c.ready))
        yield GaugeMetricFamily("gridgate_workers_target", "Workers the supervisor keeps running", sup.target)
        yield GaugeMetricFamily("gridgate_config_generation", "Config generation being served", sup.generation)
        yield CounterMetricFamily("gridgate_worker_restarts", "Workers replaced after dying", sup.restarts_total)
        yield CounterMetricFamily("gridgate_reloads", "Reloads requested (SIGHUP)", sup.reloads_total)
        yield CounterMetricFamily("gridgate_reload_failures", "Reloads that kept the running config",
                                  sup.reload_failures_total)
        ages = [c.heartbeat_age(now) for c in serving if c.ready]
        yield GaugeMetricFamily("gridgate_worker_heartbeat_age_max_seconds",
                                "Oldest heartbeat among serving workers", max(ages, default=0.0))
