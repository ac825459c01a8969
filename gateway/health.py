"""The health process: active probes plus passive outlier detection, one writer for every verdict.

The supervisor forks one health process per host (:func:`health_process_main`), so each endpoint is
probed once per interval however many workers run. It

* probes endpoints with a tiny HTTP/1.1 or TCP client (one asyncio task per actively checked endpoint),
  counting ``healthy_threshold``/``unhealthy_threshold`` consecutive results before flipping;
* every ``poll_interval_s`` samples every worker row and advances the circuit breakers
  (gateway.outlier) and the slow-start ramps;
* publishes one seqlocked record per endpoint slot, bumping the generation word only when something a
  balancer routes on changed.

On a reload the supervisor restarts this process; it adopts the records of slots whose directory
generation is unchanged, so an ejected or unhealthy endpoint stays so across the restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from gateway.endpoints import ClusterSpec, HealthCheckSpec, OutlierSpec, endpoint_id
from gateway.outlier import ClusterBreakers, EndpointBreaker, WorkerSample, slow_start_permille
from shm.counters import (
    CONSECUTIVE,
    FAIL_5XX,
    FAIL_CONNECT,
    FAIL_RESET,
    FAIL_TIMEOUT,
    INFLIGHT,
    REQUESTS,
    HealthRecord,
    HealthTable,
    OutlierState,
    RowsReader,
    WorkerStatus,
)
from shm.segment import SLOT_LINE_WORDS, Segment
from shm.seqlock import SeqlockBusy

log = logging.getLogger("gridgate.health")

WORKER_STALE_S = 5.0  # a worker whose heartbeat is older is not handed half-open probes
_DISABLED_OUTLIER = OutlierSpec(consecutive_failures=0)


# -- active checks: thresholds (pure) and probes (I/O) ---------------------------------------------

@dataclass(slots=True)
class ActiveHealth:
    """Consecutive-result thresholds. Endpoints start healthy."""

    healthy: bool = True
    streak: int = 0  # consecutive results contradicting the current verdict

    def observe(self, ok: bool, spec: HealthCheckSpec) -> bool:
        """Count one probe result; True if the verdict flipped."""
        if ok == self.healthy:
            self.streak = 0
            return False
        self.streak += 1
        if self.streak >= (spec.healthy_threshold if ok else spec.unhealthy_threshold):
            self.healthy, self.streak = ok, 0
            return True
        return False


def split_address(address: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _ssl_context(spec: HealthCheckSpec) -> ssl.SSLContext | None:
    if not spec.tls:
        return None
    context = ssl.create_default_context(cafile=spec.tls_ca_file)
    if not spec.tls_verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


async def probe_tcp(host: str, port: int, timeout_s: float) -> bool:
    """Healthy if a TCP connection opens within the timeout."""
    try:
        async with asyncio.timeout(timeout_s):
            _, writer = await asyncio.open_connection(host, port)
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        return True
    except (OSError, TimeoutError):
        return False


async def probe_http(host: str, port: int, path: str, timeout_s: float, *, host_header: str,
                     ssl_context: ssl.SSLContext | None = None, server_name: str | None = None) -> bool:
    """Healthy if ``GET path`` answers a 2xx status line within the timeout."""
    request = (f"GET {path} HTTP/1.1\r\nHost: {host_header}\r\nUser-Agent: gridgate-health\r\n"
               "Accept: */*\r\nConnection: close\r\n\r\n").encode()
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(
                host, port, ssl=ssl_context, server_hostname=(server_name or host) if ssl_context else None)
            try:
                writer.write(request)
                await writer.drain()
                status_line = await reader.readline()
            finally:
                writer.close()
                with contextlib.suppress(OSError, ssl.SSLError):
                    await writer.wait_closed()
    except (OSError, TimeoutError, ssl.SSLError):
        return False
    parts = status_line.split(None, 2)
    return (len(parts) >= 2 and parts[0].startswith(b"HTTP/1.") and len(parts[1]) == 3
            and parts[1].isdigit() and parts[1][:1] == b"2")


# -- the single writer ---------------------------------------------------------------------------

@dataclass(slots=True)
class _Endpoint:
    cluster: ClusterSpec
    address: str
    slot: int
    slot_generation: int
    active: ActiveHealth
    was_routable: bool = True
    back_at: float | None = None  # slow-start origin
    changed_at_ns: int = 0
    published: HealthRecord | None = None


def _routing_view(record: HealthRecord) -> tuple[int, ...]:
    # The fields balancers act on; report-only fields (streak counts) do not bump the generation.
    return (record.active_down, record.outlier_state, record.ramp_permille, record.probe_worker,
            record.probe_epoch)


class HealthService:
    """All health state of the host, written to shared memory by this one object."""

    def __init__(self, clusters: Sequence[ClusterSpec], segment: Segment, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._table = HealthTable(segment)
        self._rows = RowsReader(segment)
        self._segment = segment
        directory = {e.endpoint_id: e for e in segment.directory.entries()}
        now = clock()
        self.endpoints: list[_Endpoint] = []
        self.breakers: list[tuple[ClusterBreakers, list[_Endpoint]]] = []
        for cluster in clusters:
            members = []
            for spec in cluster.endpoints:
                entry = directory.get(endpoint_id(cluster.name, spec.address))
                if entry is None:
                    log.warning("endpoint %s/%s has no shared-memory slot; not health checked",
                                cluster.name, spec.address)
                    continue
                members.append(_Endpoint(cluster, spec.address, entry.slot, entry.generation, ActiveHealth()))
            breakers = ClusterBreakers(cluster.outlier or _DISABLED_OUTLIER, [m.slot for m in members])
            for member in members:
                self._adopt(member, breakers, now)
            self.endpoints.extend(members)
            self.breakers.append((breakers, members))
        self.poll()

    def _adopt(self, member: _Endpoint, breakers: ClusterBreakers, now: float) -> None:
        try:
            old = self._table.read(member.slot)
        except SeqlockBusy:
            return
        if old.slot_generation != member.slot_generation:
            return  # a new endpoint in this slot (or a fresh segment): start healthy
        member.active.healthy = not old.active_down or member.cluster.health_check is None
        breakers.adopt(member.slot, OutlierState(old.outlier_state), old.ejections, old.ejected_until_ns / 1e9,
                       old.total_ejections, old.probe_epoch)
        member.was_routable = old.routable and member.active.healthy
        if old.ramp_permille and member.cluster.slow_start_s > 0:
            member.back_at = now - old.ramp_permille / 1000 * member.cluster.slow_start_s

    # -- passive side: called every poll interval ----------------------------------------------
    def _samples(self) -> dict[int, list[WorkerSample]]:
        samples: dict[int, list[WorkerSample]] = {m.slot: [] for m in self.endpoints}
        for worker in range(self._rows.rows_in_use()):
            lines = self._rows.slot_lines(worker)
            for slot, rows in samples.items():
                b = slot * SLOT_LINE_WORDS
                rows.append(WorkerSample(
                    requests=lines[b + REQUESTS],
                    failures=lines[b + FAIL_CONNECT] + lines[b + FAIL_RESET] + lines[b + FAIL_TIMEOUT] + lines[b + FAIL_5XX],
                    consecutive=lines[b + CONSECUTIVE],
                    inflight=lines[b + INFLIGHT],
                ))
        return samples

    def _live_workers(self, now_ns: int) -> list[int]:
        live = []
        for worker in range(self._rows.rows_in_use()):
            header = self._rows.header(worker)
            fresh = now_ns - header.heartbeat_ns < WORKER_STALE_S * 1e9
            if header.status == WorkerStatus.RUNNING and header.heartbeat_ns and fresh:
                live.append(worker)
        return live

    def poll(self) -> None:
        now = self._clock()
        now_ns = time.monotonic_ns()
        samples = self._samples()
        live = self._live_workers(now_ns)
        for breakers, _members in self.breakers:
            breakers.update(now, samples, live)
        self._publish_all(now)
        self._table.writer_alive(os.getpid(), now_ns)

    # -- active side -----------------------------------------------------------------------------
    def actively_checked(self) -> list[_Endpoint]:
        return [m for m in self.endpoints if m.cluster.health_check is not None]

    async def run_active(self, member: _Endpoint, stop: asyncio.Event) -> None:
        spec = member.cluster.health_check
        assert spec is not None
        host, port = split_address(member.address)
        context = _ssl_context(spec)
        next_at = self._clock()
        while not stop.is_set():
            if spec.type == "tcp":
                ok = await probe_tcp(host, port, spec.timeout_s)
            else:
                ok = await probe_http(host, port, spec.path, spec.timeout_s, host_header=member.address,
                                      ssl_context=context, server_name=spec.tls_server_name)
            if member.active.observe(ok, spec):
                log.warning("endpoint %s/%s is %s (active %s check)", member.cluster.name, member.address,
                            "healthy" if ok else "unhealthy", spec.type)
                self._publish_all(self._clock())
            next_at += spec.interval_s
            delay = next_at - self._clock()
            if delay < 0:  # a slow probe: do not burst to catch up
                next_at, delay = self._clock(), 0.0
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)

    # -- publishing ------------------------------------------------------------------------------
    def _publish_all(self, now: float) -> None:
        bumped = False
        for breakers, members in self.breakers:
            for member in members:
                record = self._compose(member, breakers.breakers[member.slot], now)
                if record != member.published:
                    if member.published is None or _routing_view(record) != _routing_view(member.published):
                        bumped = True
                        member.changed_at_ns = time.monotonic_ns()
                        record = replace(record, changed_at_ns=member.changed_at_ns)
                    self._table.publish(member.slot, record)
                    member.published = record
        if bumped:
            self._table.bump_generation()

    def _compose(self, member: _Endpoint, breaker: EndpointBreaker, now: float) -> HealthRecord:
        routable = member.active.healthy and breaker.state == OutlierState.CLOSED
        if routable and not member.was_routable:
            member.back_at = now
            log.info("endpoint %s/%s back in service (slow start %.1fs)", member.cluster.name, member.address,
                     member.cluster.slow_start_s)
        member.was_routable = routable
        ramp = 0
        if routable and member.back_at is not None:
            ramp = slow_start_permille(now - member.back_at, member.cluster.slow_start_s)
            if not ramp:
                member.back_at = None
        ejected = breaker.state != OutlierState.CLOSED
        return HealthRecord(
            slot_generation=member.slot_generation,
            active_down=int(not member.active.healthy),
            outlier_state=int(breaker.state),
            ejected_until_ns=int(breaker.ejected_until * 1e9) if ejected else 0,
            ejections=breaker.ejections,
            ramp_permille=ramp,
            probe_worker=breaker.probe_worker if breaker.state == OutlierState.HALF_OPEN else -1,
            probe_epoch=breaker.probe_epoch,
            consecutive_failures=breaker.consecutive,
            total_ejections=breaker.total_ejections,
            changed_at_ns=member.changed_at_ns,
        )


async def run_health_checks(clusters: Sequence[ClusterSpec], segment: Segment, stop_event: asyncio.Event, *,
                            poll_interval_s: float = 0.1, clock: Callable[[], float] = time.monotonic) -> None:
    """Run every active check and the outlier poll until ``stop_event`` is set (one per host)."""
    service = HealthService(clusters, segment, clock=clock)
    tasks = [asyncio.create_task(service.run_active(m, stop_event)) for m in service.actively_checked()]
    try:
        while not stop_event.is_set():
            service.poll()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop_event.wait(), poll_interval_s)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def health_process_main(clusters: Sequence[ClusterSpec], segment: Segment, *, poll_interval_s: float = 0.1) -> None:
    """Body of the health child process; returns after SIGTERM/SIGINT."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the supervisor restarts us on reload instead

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await run_health_checks(clusters, segment, stop, poll_interval_s=poll_interval_s)

    try:
        import uvloop

        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(main())


def spawn_health_process(clusters: Sequence[ClusterSpec], segment: Segment, *,
                         poll_interval_s: float = 0.1) -> int:
    """Fork the health process (for a supervisor without its own fork helper); returns its pid."""
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        asyncio._set_running_loop(None)  # forked from inside a running loop: that loop is not ours
        health_process_main(clusters, segment, poll_interval_s=poll_interval_s)
    except BaseException:  # the child must never return into the parent's stack
        log.exception("health process crashed")
        code = 1
    finally:
        os._exit(code)
