"""The health process: active probes plus passive outlier detection, one writer for every verdict.

The supervisor forks one health process per host and runs :func:`health_process_main` in it, so each
endpoint is probed once per interval however many workers run. It

* probes endpoints with the probe client (one asyncio task per actively checked endpoint), counting
  consecutive results against the thresholds before flipping (gateway.health.verdict);
* every ``poll_interval_s`` samples every worker row and advances the circuit breakers
  (gateway.cluster.outlier) and the slow-start ramps;
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
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

from gateway.cluster.outlier import ClusterBreakers, OutlierState, WorkerSample
from gateway.cluster.spec import ClusterSpec, HealthCheckSpec, OutlierSpec, endpoint_id
from gateway.health.probe import ProbeError, ProbeTarget, http_get, tcp_connect
from gateway.health.verdict import EndpointVerdict, routing_view
from gateway.net import client_tls_context, parse_host_port
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
    RowsReader,
    WorkerStatus,
)
from shm.segment import SLOT_LINE_WORDS, Segment
from shm.seqlock import SeqlockBusy

log = logging.getLogger("gridgate.health")

WORKER_STALE_S = 5.0  # a worker whose heartbeat is older is not handed half-open probes
USER_AGENT = "gridgate-health"
_DISABLED_OUTLIER = OutlierSpec(consecutive_failures=0)


@dataclass(slots=True)
class _Member:
    """One endpoint as the writer tracks it."""

    cluster: ClusterSpec
    address: str
    slot: int
    verdict: EndpointVerdict
    changed_at_ns: int = 0
    published: HealthRecord | None = None


class HealthService:
    """All health state of the host, written to shared memory by this one object."""

    def __init__(self, clusters: Sequence[ClusterSpec], segment: Segment, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._table = HealthTable(segment)
        self._rows = RowsReader(segment)
        directory = {e.endpoint_id: e for e in segment.directory.entries()}
        now = clock()
        self.members: list[_Member] = []
        self.breakers: list[tuple[ClusterBreakers, list[_Member]]] = []
        for cluster in clusters:
            members = []
            for spec in cluster.endpoints:
                entry = directory.get(endpoint_id(cluster.name, spec.address))
                if entry is None:
                    log.warning("endpoint %s/%s has no shared-memory slot; not health checked",
                                cluster.name, spec.address)
                    continue
                members.append(_Member(cluster, spec.address, entry.slot, EndpointVerdict(entry.generation)))
            breakers = ClusterBreakers(cluster.outlier or _DISABLED_OUTLIER, [m.slot for m in members])
            for member in members:
                self._adopt(member, breakers, now)
            self.members.extend(members)
            self.breakers.append((breakers, members))
        self.poll()

    def _adopt(self, member: _Member, breakers: ClusterBreakers, now: float) -> None:
        try:
            old = self._table.read(member.slot)
        except SeqlockBusy:
            return
        cluster = member.cluster
        if member.verdict.adopt(old, now, actively_checked=cluster.health_check is not None,
                                slow_start_s=cluster.slow_start_s):
            breakers.adopt(member.slot, OutlierState(old.outlier_state), old.ejections, old.ejected_until_ns / 1e9,
                           old.total_ejections, old.probe_epoch)

    # -- passive side: called every poll interval ----------------------------------------------
    def _samples(self) -> dict[int, list[WorkerSample]]:
        samples: dict[int, list[WorkerSample]] = {m.slot: [] for m in self.members}
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
    def actively_checked(self) -> list[_Member]:
        return [m for m in self.members if m.cluster.health_check is not None]

    async def run_active(self, member: _Member, stop: asyncio.Event) -> None:
        spec = member.cluster.health_check
        assert spec is not None
        probe = _prober(member, spec)
        next_at = self._clock()
        while not stop.is_set():
            why = await probe()
            if member.verdict.active.observe(why is None, spec):
                # An endpoint coming back is good news (INFO); one going down needs a look (WARNING).
                log.log(logging.INFO if why is None else logging.WARNING, "endpoint %s/%s is %s (active %s check%s)",
                        member.cluster.name, member.address, "healthy" if why is None else "unhealthy", spec.type,
                        f": {why}" if why else "")
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
                verdict = member.verdict
                was_routable = verdict.was_routable
                record = verdict.compose(breakers.breakers[member.slot], now, member.cluster.slow_start_s,
                                         member.changed_at_ns)
                if verdict.was_routable and not was_routable:
                    log.info("endpoint %s/%s back in service (slow start %.1fs)", member.cluster.name,
                             member.address, member.cluster.slow_start_s)
                if record != member.published:
                    if member.published is None or routing_view(record) != routing_view(member.published):
                        bumped = True
                        member.changed_at_ns = time.monotonic_ns()
                        record = replace(record, changed_at_ns=member.changed_at_ns)
                    self._table.publish(member.slot, record)
                    member.published = record
        if bumped:
            self._table.bump_generation()


def _prober(member: _Member, spec: HealthCheckSpec) -> Callable[[], Awaitable[str | None]]:
    """One probe of ``member``: awaiting it gives None when healthy, else why not."""
    host, port = parse_host_port(member.address)
    if spec.type == "tcp":
        async def probe_tcp() -> str | None:
            try:
                await tcp_connect(host, port, spec.timeout_s)
            except ProbeError as error:
                return str(error)
            return None

        return probe_tcp
    tls = member.cluster.tls
    target = ProbeTarget(
        host, port, spec.path, member.address,
        ssl_context=None if tls is None else client_tls_context(ca_file=tls.ca_file, verify=tls.verify),
        server_name=None if tls is None else tls.sni,
    )

    async def probe_http() -> str | None:
        try:
            status, _ = await http_get(target, spec.timeout_s, status_only=True, user_agent=USER_AGENT)
        except ProbeError as error:
            return str(error)
        return None if 200 <= status < 300 else f"HTTP {status}"

    return probe_http


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
    """Body of the health child process (forked by the supervisor); returns after SIGTERM/SIGINT."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the supervisor restarts us on reload instead

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await run_health_checks(clusters, segment, stop, poll_interval_s=poll_interval_s)

    import uvloop  # here, not at the top: the supervisor imports this module and must not load uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())
