"""Active and passive health against real loopback servers and a real forked health process."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable

import pytest

from gateway.cluster.balancers import build_balancer
from gateway.cluster.outcome import Outcome
from gateway.cluster.outlier import OutlierState
from gateway.cluster.report import endpoints_report
from gateway.cluster.shared_view import SharedEndpointState
from gateway.cluster.spec import ClusterSpec, EndpointSpec, HealthCheckSpec, OutlierSpec, all_endpoint_ids
from gateway.health.writer import health_process_main, run_health_checks
from shm.counters import HealthTable, WorkerRow, WorkerStatus
from shm.segment import Segment


class ProbeServer:
    """A tiny HTTP server answering health probes with a switchable status; counts probes."""

    def __init__(self, sock: socket.socket | None = None) -> None:
        self.sock = sock
        self.status = 200
        self.probes: list[tuple[int, float]] = []  # (status answered, when)
        self.on_probe: Callable[[], None] = lambda: None
        self.request_lines: list[bytes] = []
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._handle, sock=self.sock) if self.sock else \
            await asyncio.start_server(self._handle, "127.0.0.1", 0)
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        self.request_lines.append(head.split(b"\r\n", 1)[0])
        self.on_probe()
        self.probes.append((self.status, time.monotonic()))
        reason = b"OK" if self.status == 200 else b"Unavailable"
        writer.write(b"HTTP/1.1 %d %s\r\nContent-Length: 0\r\nConnection: close\r\n\r\n" % (self.status, reason))
        await writer.drain()
        writer.close()

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()


async def _until(condition: Callable[[], bool], timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def _fork_health_process(clusters: list[ClusterSpec], segment: Segment, **options: float) -> int:
    """The health process as the supervisor runs it: forked, sharing the segment, until SIGTERM."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            health_process_main(clusters, segment, **options)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


class Endpoint:
    """A worker's endpoint object as far as a balancer cares."""

    def __init__(self, slot: int, address: str) -> None:
        self.slot, self.address, self.weight = slot, address, 1


def _segment_for(*clusters: ClusterSpec) -> tuple[Segment, dict[str, int]]:
    segment = Segment.create(max_workers=4, max_endpoints=16)
    return segment, segment.directory.assign(all_endpoint_ids(clusters))


def test_http_check_flips_after_the_unhealthy_then_healthy_threshold(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        server = ProbeServer()
        address = await server.start()
        check = HealthCheckSpec(type="http", path="/healthz", interval_s=0.03, timeout_s=2.0,
                                healthy_threshold=2, unhealthy_threshold=3)
        cluster = ClusterSpec("a", (EndpointSpec(address),), health_check=check, slow_start_s=0)
        segment, slots = _segment_for(cluster)
        table = HealthTable(segment)
        seen: list[tuple[int, int]] = []  # (status this probe gets, verdict published before it)
        server.on_probe = lambda: seen.append((server.status, table.read(slots[f"a/{address}"]).active_down))
        stop = asyncio.Event()
        task = asyncio.create_task(run_health_checks([cluster], segment, stop))
        await _until(lambda: len(seen) >= 3)
        server.status = 503
        await _until(lambda: sum(s == 503 for s, _ in seen) >= 5)
        server.status = 200
        await _until(lambda: sum(s == 200 for s, _ in seen[8:]) >= 4)
        stop.set()
        await task
        await server.stop()

        failing = [down for status, down in seen if status == 503]
        assert failing[:5] == [0, 0, 0, 1, 1]  # down only after the 3rd failed probe
        back = max(i for i, (status, _) in enumerate(seen) if status == 503) + 1
        recovering = [down for _, down in seen[back:]]
        assert recovering[:4] == [1, 1, 0, 0]  # up again only after the 2nd good probe
        assert all(line == b"GET /healthz HTTP/1.1" for line in server.request_lines)

    with caplog.at_level(logging.INFO, logger="gridgate.health"):
        asyncio.run(scenario())
    # Going down needs a look (WARNING); coming back is good news (INFO), not another warning.
    flips = [(r.levelname, r.getMessage()) for r in caplog.records if " is " in r.getMessage()]
    assert [level for level, _ in flips] == ["WARNING", "INFO"], flips
    assert "is unhealthy (active http check: HTTP 503)" in flips[0][1] and "is healthy" in flips[1][1]


def test_tcp_check_marks_a_closed_port_unhealthy_and_a_reopened_one_healthy() -> None:
    async def scenario() -> None:
        accepted = 0

        def count(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            nonlocal accepted
            accepted += 1
            w.close()

        server = await asyncio.start_server(count, "127.0.0.1", 0)
        host, port = server.sockets[0].getsockname()[:2]
        check = HealthCheckSpec(type="tcp", interval_s=0.03, timeout_s=0.5, healthy_threshold=2, unhealthy_threshold=2)
        cluster = ClusterSpec("t", (EndpointSpec(f"{host}:{port}"),), health_check=check, slow_start_s=0)
        segment, slots = _segment_for(cluster)
        table = HealthTable(segment)

        def down() -> bool:
            return bool(table.read(slots[f"t/{host}:{port}"]).active_down)

        stop = asyncio.Event()
        task = asyncio.create_task(run_health_checks([cluster], segment, stop))
        await _until(lambda: accepted >= 2)
        assert not down()
        server.close()
        await server.wait_closed()
        await _until(down)
        server = await asyncio.start_server(count, host, port)
        before = accepted
        await _until(lambda: not down())
        assert accepted - before >= 2  # healthy_threshold successful connects were needed
        stop.set()
        await task
        server.close()
        await server.wait_closed()

    asyncio.run(scenario())


def test_one_health_process_probes_each_endpoint_once_per_interval_however_many_workers() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    host, port = listener.getsockname()[:2]
    address = f"{host}:{port}"
    check = HealthCheckSpec(type="http", path="/health", interval_s=0.1, timeout_s=0.5)
    cluster = ClusterSpec("p", (EndpointSpec(address),), health_check=check)
    segment, _ = _segment_for(cluster)
    for worker in range(2):  # two workers are up; they never probe
        segment.claim_worker_row(worker)
        WorkerRow(segment, worker).mark(WorkerStatus.RUNNING, 1000 + worker, time.monotonic_ns())
    pid = _fork_health_process([cluster], segment)
    try:
        async def count() -> list[tuple[int, float]]:
            server = ProbeServer(listener)
            await server.start()
            await _until(lambda: len(server.probes) >= 1)
            await asyncio.sleep(1.0)
            await server.stop()
            return server.probes

        probes = asyncio.run(count())
    finally:
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    window = [t for _, t in probes if t <= probes[0][1] + 1.0]
    assert 6 <= len(window) <= 13  # ~ one per 0.1 s interval; one prober per worker would give ~20


def test_passive_failures_eject_then_one_probe_restores_with_slow_start() -> None:
    outlier = OutlierSpec(consecutive_failures=3, base_ejection_s=0.3, max_ejection_percent=50)
    cluster = ClusterSpec("o", (EndpointSpec("127.0.0.1:1"), EndpointSpec("127.0.0.1:2")), outlier=outlier,
                          slow_start_s=5.0)
    segment, slots = _segment_for(cluster)
    segment.claim_worker_row(0)
    row = WorkerRow(segment, 0)
    row.mark(WorkerStatus.RUNNING, os.getpid(), time.monotonic_ns())
    bad, good = slots["o/127.0.0.1:1"], slots["o/127.0.0.1:2"]
    refs = [Endpoint(bad, "127.0.0.1:1"), Endpoint(good, "127.0.0.1:2")]
    balancer = build_balancer("round_robin", refs, SharedEndpointState(segment, 0), cluster="o")
    table = HealthTable(segment)

    def wait_for(state: OutlierState, timeout_s: float = 3.0) -> None:
        deadline = time.monotonic() + timeout_s
        while table.read(bad).outlier_state != state:
            assert time.monotonic() < deadline, f"no {state.name} in time"
            row.heartbeat(time.monotonic_ns())
            time.sleep(0.01)

    pid = _fork_health_process([cluster], segment, poll_interval_s=0.02)
    try:
        deadline = time.monotonic() + 3.0
        while table.writer()[0] != pid:  # the health process has taken its first sample
            assert time.monotonic() < deadline
            time.sleep(0.005)
        for _ in range(3):
            row.inc_inflight(bad)
            row.dec_inflight(bad)
            row.record(bad, Outcome.CONNECT)
        wait_for(OutlierState.EJECTED)
        report = endpoints_report(segment, [cluster])
        entry = report["clusters"][0]["endpoints"][0]
        assert entry["health"] == "ejected" and entry["ejection"]["until"].endswith("Z")
        assert entry["consecutive_failures"] == 3 and entry["failures"]["connect"] == 3
        assert report["health_process"]["pid"] == pid
        assert {balancer.pick().slot for _ in range(10)} == {good}

        wait_for(OutlierState.HALF_OPEN)
        assert table.read(bad).probe_worker == 0
        assert balancer.pick().slot == bad  # the single probe, handed to this worker
        assert {balancer.pick().slot for _ in range(10)} == {good}
        row.record(bad, Outcome.OK)
        wait_for(OutlierState.CLOSED)
        record = table.read(bad)
        assert 0 < record.ramp_permille < 1000
        assert endpoints_report(segment, [cluster])["clusters"][0]["endpoints"][0]["health"] == "slow_start"
        counts = [balancer.pick().slot for _ in range(200)]
        assert 0 < counts.count(bad) < 60  # re-enters with a fraction of its weight
    finally:
        os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)
