"""Drains and keep-alive recycling (docs/operations.md#drains-and-listening-sockets,
limits.max_requests_per_connection).

A drain (shutdown, reload, SIGTTOU) answers the next request on each keep-alive connection with
`Connection: close` and never cuts a client that is sending; streams still open at the graceful
deadline end with an SSE error event; a connection that reached its request cap is closed after the
response that says so.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import h11

from tests.harness import (
    ROOT,
    Client,
    alive,
    candidate,
    envelope,
    free_port,
    ready_with,
    request,
    wait_until,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


class KeepAliveClients:
    """Clients sending requests back to back, each on one keep-alive connection that it replaces only
    when the gateway answers `Connection: close`: what a pooled HTTP client does."""

    def __init__(self, port: int, count: int) -> None:
        self.port = port
        self.served = 0
        self.closes = 0  # responses that said `Connection: close`
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(count)]
        for thread in self._threads:
            thread.start()

    def _run(self) -> None:
        client: Client | None = None
        while not self._done.is_set():
            try:
                client = client or Client(self.port, timeout=10)
                response = client.request("POST", "/v1/chat/completions", CHAT)
            except (OSError, h11.ProtocolError) as exc:
                self._count(failure=f"{exc!r} after {self.served} served")
                client = self._drop(client)
                continue
            closing = response.headers.get("connection") == "close"
            self._count(failure=None if response.status == 200 else f"status {response.status}", closing=closing)
            if closing or response.status == 0:
                client = self._drop(client)
        self._drop(client)

    def _count(self, failure: str | None, closing: bool = False) -> None:
        with self._lock:
            if failure is None:
                self.served += 1
            else:
                self.failures.append(failure)
            self.closes += closing

    @staticmethod
    def _drop(client: Client | None) -> None:
        if client is not None:
            client.close()

    def wait_served(self, more: int) -> None:
        target = self.served + more
        wait_until(lambda: self.served >= target, f"{more} more requests served")

    def stop(self) -> None:
        self._done.set()
        for thread in self._threads:
            thread.join(15)


def new_generation(gateway, old: list[int]) -> list[int]:
    """Change a setting the workers use, SIGHUP, and wait until only the new generation runs."""
    gateway.config["timeouts"]["keepalive_idle"] = f"{int(gateway.config['timeouts']['keepalive_idle'][:-1]) + 1}s"
    gateway.write_config()
    gateway.signal(signal.SIGHUP)
    new = wait_until(lambda: (p := ready_with(gateway, len(old))) and not set(p) & set(old) and p,
                     "the new generation", timeout=20)
    wait_until(lambda: not any(alive(pid) for pid in old), "the old generation to exit", timeout=20)
    return new


def test_sigterm_lets_an_in_flight_stream_finish(mock_provider, gateway_factory):
    handle = mock_provider("slow", tokens_per_s=10, tokens=15)
    gateway = gateway_factory({"slow": [handle.address]}, envelope([candidate("m", "slow")]), workers=2)
    client = Client(gateway.port)
    client.send("POST", "/v1/chat/completions", {"model": "m", "stream": True})
    client.sock.settimeout(10)
    received = client.sock.recv(65536)
    assert b" 200 " in received.split(b"\r\n", 1)[0]
    gateway.signal(signal.SIGTERM)
    started = time.monotonic()
    while not received.endswith(b"0\r\n\r\n"):  # the events leave before the end's chunk, maybe apart
        chunk = client.sock.recv(65536)
        if not chunk:
            break
        received += chunk
    assert b"data: [DONE]" in received
    assert received.endswith(b"0\r\n\r\n")  # the chunked body was terminated properly
    assert gateway.process.wait(15) == 0
    assert time.monotonic() - started > 0.5  # it really waited for the stream
    client.close()


def test_a_stream_cut_by_the_graceful_deadline_ends_with_an_error_event(mock_provider, gateway_factory):
    handle = mock_provider("slow", tokens_per_s=10, tokens=60)  # a 6 s stream
    gateway = gateway_factory({"slow": [handle.address]}, envelope([candidate("m", "slow")]),
                              extra={"timeouts": {"graceful_shutdown": "1s"}})
    client = Client(gateway.port)
    client.send("POST", "/v1/chat/completions", {**CHAT, "stream": True})
    client.sock.settimeout(10)
    received = client.sock.recv(65536)
    assert b" 200 " in received.split(b"\r\n", 1)[0]
    gateway.signal(signal.SIGTERM)
    started = time.monotonic()
    while chunk := client.sock.recv(65536):
        received += chunk
    assert time.monotonic() - started < 4  # cut at the deadline, not after the whole stream
    assert b"data: [DONE]" not in received
    body = b"".join(chunk_payloads(received.split(b"\r\n\r\n", 1)[1]))
    last_event = body.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    assert json.loads(last_event.removeprefix(b"data: "))["error"]["code"] == "gateway_shutdown"
    assert received.endswith(b"\n\n\r\n0\r\n\r\n")  # the event, then a properly terminated chunked body
    assert gateway.process.wait(10) == 0
    client.close()


def chunk_payloads(body: bytes) -> list[bytes]:
    """The chunks of a complete chunked body (asserts it is well framed)."""
    payloads = []
    while True:
        size_line, _, rest = body.partition(b"\r\n")
        assert size_line, "the chunked body was cut before its last chunk"
        size = int(size_line, 16)
        if size == 0:
            assert rest == b"\r\n"
            return payloads
        payloads.append(rest[:size])
        assert rest[size:size + 2] == b"\r\n"
        body = rest[size + 2:]


def test_sigterm_with_nothing_in_flight_exits_promptly(mock_provider, gateway_factory):
    handle = mock_provider("idle")
    gateway = gateway_factory({"idle": [handle.address]}, envelope([candidate("m", "idle")]))
    idle = Client(gateway.port)  # an idle keep-alive connection must not hold the drain
    assert idle.request("POST", "/v1/chat/completions", {"model": "m"}).status == 200
    started = time.monotonic()
    gateway.signal(signal.SIGTERM)
    assert gateway.process.wait(10) == 0
    assert time.monotonic() - started < 3
    idle.close()


def test_the_request_that_reaches_the_per_connection_cap_is_answered_with_connection_close(
    mock_provider, gateway_factory,
):
    handle = mock_provider("fast")
    gateway = gateway_factory({"fast": [handle.address]}, envelope([candidate("m", "fast")]))
    client = Client(gateway.port)
    closing = []
    for n in range(1, 1051):
        response = client.request("GET", "/v1/models")
        assert response.status == 200
        if response.headers.get("connection") == "close":
            closing.append(n)
            client.sock.settimeout(5)
            assert client.sock.recv(1) == b""  # the gateway closed it after that response
            client.close()
            client = Client(gateway.port)  # the client reconnects and goes on
    client.close()
    assert closing == [1000]  # the default limits.max_requests_per_connection


def test_the_connection_is_closed_after_the_response_that_reaches_the_cap(mock_provider, gateway_factory):
    handle = mock_provider("fast")
    gateway = gateway_factory({"fast": [handle.address]}, envelope([candidate("m", "fast")]),
                              extra={"limits": {"max_requests_per_connection": 3}})
    client = Client(gateway.port)
    answers = [client.request("POST", "/v1/chat/completions", CHAT) for _ in range(3)]
    assert [a.status for a in answers] == [200, 200, 200]
    assert [a.headers.get("connection") for a in answers] == [None, None, "close"]
    client.sock.settimeout(5)
    assert client.sock.recv(1) == b""  # closed by the gateway, not left for the client to guess
    client.close()


def test_keep_alive_clients_see_no_failed_request_through_three_reloads(mock_provider, gateway_factory):
    handle = mock_provider("busy", latency_ms=5)  # requests are in flight when the drains begin
    gateway = gateway_factory({"busy": [handle.address]}, envelope([candidate("m", "busy")]), workers=2,
                              extra={"timeouts": {"graceful_shutdown": "10s", "keepalive_idle": "30s"}})
    load = KeepAliveClients(gateway.port, 4)
    try:
        load.wait_served(50)
        workers = gateway.worker_pids()
        for _ in range(3):
            closes = load.closes
            workers = new_generation(gateway, workers)
            assert load.closes >= closes + 1  # the old workers ended their connections with an answer
            load.wait_served(50)
    finally:
        load.stop()
    assert load.failures == []


def test_a_worker_stop_under_keep_alive_load_fails_no_request(mock_provider, gateway_factory):
    handle = mock_provider("busy", latency_ms=5)
    gateway = gateway_factory({"busy": [handle.address]}, envelope([candidate("m", "busy")]), workers=2,
                              extra={"timeouts": {"graceful_shutdown": "10s"}})
    load = KeepAliveClients(gateway.port, 4)
    try:
        load.wait_served(50)
        before = gateway.worker_pids()
        gateway.signal(signal.SIGTTOU)
        after = wait_until(lambda: ready_with(gateway, 1), "one worker")
        wait_until(lambda: all(alive(pid) == (pid in after) for pid in before), "the stopped worker to exit")
        load.wait_served(100)
    finally:
        load.stop()
    assert load.failures == []


def test_connections_queued_for_a_killed_worker_are_served_by_its_replacement(mock_provider, gateway_factory):
    handle = mock_provider("fast")
    gateway = gateway_factory({"fast": [handle.address]}, envelope([candidate("m", "fast")]), workers=2)
    frozen, other = gateway.worker_pids()
    os.kill(frozen, signal.SIGSTOP)  # it stops accepting: what the kernel hashes to its socket waits
    queued: list[Client] = []
    try:
        for _ in range(60):
            client = Client(gateway.port, timeout=10)
            client.send("GET", "/v1/models")
            client.sock.settimeout(0.3)
            try:
                answered = client.sock.recv(1, socket.MSG_PEEK)
            except TimeoutError:
                queued.append(client)
                if len(queued) == 3:
                    break
            else:
                assert answered
                client.close()
    finally:
        os.kill(frozen, signal.SIGKILL)
    assert queued, "no connection landed on the stopped worker's socket"
    for client in queued:
        client.sock.settimeout(15)
        assert client.receive().status == 200  # accepted by the replacement, not reset with the old socket
        client.close()
    assert other in wait_until(lambda: ready_with(gateway, 2), "the replacement worker")


def test_a_worker_run_without_a_supervisor_binds_its_own_socket(tmp_path):
    port = free_port()
    (tmp_path / "overlay.json").write_text(json.dumps(envelope([candidate("m", "cluster-a")])))
    (tmp_path / "gw.yaml").write_text(
        f"listen: '127.0.0.1:{port}'\nclusters: [{{name: cluster-a, endpoints: ['127.0.0.1:9']}}]\n"
        "routing: {overlay_file: overlay.json}\n"
    )
    program = (
        "import os\n"
        "from gateway.config import load_config\n"
        "from gateway.host_segment import AFFINITY_REGION, METRICS_REGION\n"
        "from gateway.process_protocol import WorkerContext\n"
        "from workers.main import worker_main\n"
        f"config = load_config({str(tmp_path / 'gw.yaml')!r})\n"
        "worker_main(WorkerContext(\n"
        "    config=config, slot=0, generation=1, segment=None, status_fd=os.open(os.devnull, os.O_WRONLY),\n"
        "    listen_fd=None, quota_url=None, affinity_region=AFFINITY_REGION,\n"
        "    affinity_capacity=config.routing.session_affinity.capacity, metrics_region=METRICS_REGION,\n"
        "    metric_clusters=(),\n"
        "))\n"
    )
    worker = subprocess.Popen([sys.executable, "-c", program], cwd=ROOT, stderr=subprocess.PIPE)
    try:
        def models() -> int:
            try:
                return request("127.0.0.1", port, "GET", "/v1/models", timeout=2)[0]
            except OSError:
                return 0

        assert wait_until(models, "the worker to serve", timeout=15) == 200
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(10) == 0
    finally:
        worker.kill()
        stderr = worker.communicate()[1]
    assert b"Traceback" not in stderr
