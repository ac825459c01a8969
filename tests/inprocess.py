"""One worker's whole request path in the test's own process and event loop.

``InProcessGateway`` builds the path exactly as a worker does (``RequestPath.build``: head gate, proxy,
forwarding, relay, outcomes, quota gate, access log, metrics writer) from a real config and overlay
file, and serves it through the real ``ServerConnection``. Downstream, a client is a stand-in transport
(``tests/sansio_server.py``) that records every write the server makes and what the gateway's own
counters said at that moment (``probe``), so a test can ask what was counted before the last byte left.
Upstream, the providers are the real mock providers (``loadtest/mock_provider.py``) served on loopback
sockets by the same loop. Quota tests point the config at the session's real Valkey.
"""

from __future__ import annotations

import asyncio
import copy
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvloop
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import parse_config
from gateway.host_segment import AFFINITY_REGION, METRICS_REGION
from gateway.metrics.render import render_prometheus
from gateway.process_protocol import WorkerContext
from loadtest.mock_provider import INFERENCE_PATHS, MockHTTPProtocol, MockSettings, MockState, SharedHealth
from shm.counters import WorkerRow
from tests.sansio_server import StandInTransport
from workers.main import Worker, _private_segment
from workers.request_path import RequestPath
from workers.server import ServerConnection
from workers.server_state import ServerState

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


# -- upstream: mock providers on loopback, in this loop ------------------------------------------------

@dataclass
class Provider:
    name: str
    state: MockState
    server: asyncio.AbstractServer

    @property
    def address(self) -> str:
        host, port = self.server.sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    @property
    def served(self) -> int:
        """Inference requests it answered (or began to)."""
        return sum(count for endpoint, count in self.state.served.items() if endpoint in INFERENCE_PATHS.values())


async def start_provider(name: str, **settings: Any) -> Provider:
    state = MockState(MockSettings(name=name, **settings), SharedHealth(200))
    server = await asyncio.get_running_loop().create_server(lambda: MockHTTPProtocol(state), "127.0.0.1", 0)
    return Provider(name, state, server)


# -- downstream: a client on a stand-in transport ------------------------------------------------------

@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes  # the payload (de-chunked)
    complete: bool  # its framing ended (the last chunk, or the declared length)

    def json(self) -> Any:
        return json.loads(self.body)


def parse_answer(data: bytes) -> Answer | None:
    """The first response in ``data`` as far as it arrived (None: not even its head)."""
    head, sep, rest = data.partition(b"\r\n\r\n")
    if not sep:
        return None
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower().decode()] = value.strip().decode("latin-1")
    if "content-length" in headers:
        length = int(headers["content-length"])
        return Answer(status, headers, rest[:length], len(rest) >= length)
    body, pos = [], 0
    while (end := rest.find(b"\r\n", pos)) >= 0:
        size = int(rest[pos:end], 16)
        if size == 0:
            return Answer(status, headers, b"".join(body), True)
        if end + 2 + size + 2 > len(rest):
            break
        body.append(rest[end + 2:end + 2 + size])
        pos = end + 2 + size + 2
    return Answer(status, headers, b"".join(body), False)


class ClientTransport(StandInTransport):
    """A client that reads everything at once, and notes what ``probe`` said at each write the server made."""

    def __init__(self, protocol: ServerConnection, probe: Callable[[], Any]) -> None:
        super().__init__(protocol)
        self.probe = probe
        self.writes: list[tuple[int, Any]] = []  # (bytes received so far, what probe said then)

    def write(self, data: bytes) -> None:
        super().write(data)
        if not self.closed:
            self.writes.append((len(self.out), self.probe()))

    def seen_when_complete(self) -> Any:
        """What ``probe`` said when the write that completed the first answer was made."""
        for received, seen in self.writes:
            answer = parse_answer(bytes(self.out[:received]))
            if answer is not None and answer.complete:
                return seen
        raise AssertionError(f"no complete answer: {bytes(self.out)[:300]!r}")


@dataclass
class Client:
    transport: ClientTransport
    connection: ServerConnection

    def send(self, method: str, target: str, body: dict | bytes | None = None,
             headers: list[tuple[str, str]] = ()) -> None:
        payload = json.dumps(body).encode() if isinstance(body, dict) else (body or b"")
        head = [f"{method} {target} HTTP/1.1", "host: gateway", *(f"{n}: {v}" for n, v in headers)]
        if payload or method == "POST":
            head += ["content-type: application/json", f"content-length: {len(payload)}"]
        self.connection.data_received(("\r\n".join(head) + "\r\n\r\n").encode() + payload)

    def answer(self) -> Answer | None:
        return parse_answer(bytes(self.transport.out))

    async def answered(self, timeout: float = 10.0, head_only: bool = False) -> Answer:
        """The answer, once complete (or once its head arrived); fails after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            answer = self.answer()
            if answer is not None and (head_only or answer.complete):
                return answer
            assert time.monotonic() < deadline, f"no answer within {timeout}s: {bytes(self.transport.out)[:300]!r}"
            await asyncio.sleep(0.005)

    def hang_up(self) -> None:
        """The client closes its socket, and the server learns it at once: nothing written after this
        reaches the client."""
        if not self.transport.closed:
            self.transport.closed = True
            self.connection.connection_lost(None)


# -- the gateway ---------------------------------------------------------------------------------------

@dataclass
class InProcessGateway:
    path: RequestPath
    state: ServerState  # the worker's server state: its connections, draining
    directory: Path
    clients: list[Client] = field(default_factory=list)

    @classmethod
    async def start(cls, directory: Path, clusters: dict[str, list[str]], overlay: dict[str, Any], *,
                    quota_url: str | None = None, extra: dict[str, Any] | None = None,
                    cache_index: Any = None, slot: int = 0) -> InProcessGateway:
        """``cache_index``: a response-cache host index (shm.cache_index) this worker reads, as row ``slot``."""
        config_dict: dict[str, Any] = {
            "clusters": [{"name": name, "endpoints": endpoints} for name, endpoints in clusters.items()],
            "routing": {"overlay_file": "overlay.json"},
            "access_log": {"path": "access.log"},
        }
        for key, value in (extra or {}).items():
            if isinstance(value, dict) and isinstance(config_dict.get(key), dict):
                config_dict[key].update(value)
            else:
                config_dict[key] = value
        (directory / "overlay.json").write_text(json.dumps(overlay))
        config = parse_config(yaml.safe_dump(config_dict), str(directory))
        segment = _private_segment(config)
        ctx = WorkerContext(
            config=config, slot=slot, generation=1, segment=segment, status_fd=-1, listen_fd=None,
            quota_url=quota_url, affinity_region=AFFINITY_REGION,
            affinity_capacity=config.routing.session_affinity.capacity, metrics_region=METRICS_REGION,
            metric_clusters=tuple(clusters), cache_index=cache_index,
        )
        path = await RequestPath.build(ctx, segment, WorkerRow(segment, 0))
        return cls(path, path.server_state(), directory)

    def connect(self) -> Client:
        connection = ServerConnection(self.state)
        transport = ClientTransport(connection, self.samples)
        connection.connection_made(transport)
        client = Client(transport, connection)
        self.clients.append(client)
        return client

    async def request(self, method: str, target: str, body: dict | bytes | None = None,
                      headers: list[tuple[str, str]] = ()) -> Answer:
        client = self.connect()
        client.send(method, target, body, headers)
        return await client.answered()

    async def chat(self, model: str = "m", headers: list[tuple[str, str]] = (), **fields: Any) -> Answer:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], **fields}
        return await self.request("POST", "/v1/chat/completions", body, headers)

    def samples(self) -> Samples:
        """What /metrics would say now (this worker's row; every sample by name and sorted labels)."""
        text = render_prometheus(list(self.path.metrics.row), list(self.path.metrics.cluster_index),
                                 list(self.path.metrics.tenant_index))
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text.decode()) for s in family.samples}

    def access_lines(self) -> list[dict[str, Any]]:
        writer = self.path.access_log.writer
        assert writer is not None
        writer.flush()
        text = (self.directory / "access.log").read_text()
        return [json.loads(line) for line in text.splitlines()]

    async def used(self, tenant: str = "anonymous") -> dict[str, Any]:
        """The tenant's first window in the ledger, once the settlements queued so far are reconciled."""
        quota = self.path.quota
        assert quota is not None
        await quota.drain()
        report = await quota.quota_report(tenant)
        return report["rules"][0]["windows"][0]

    async def close(self) -> None:
        for client in self.clients:
            client.hang_up()
        await asyncio.sleep(0)
        await self.path.close()


async def until(predicate: Callable[[], Any], what: str, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)
    return value


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))



# -- the same worker on a real loopback socket, in a thread ---------------------------------------------

class LoopbackGateway:
    """One worker of a real config serving a real loopback socket from a thread of the test process: the
    tests of one request's behaviour that talk HTTP to ``port``, as to ``tests.harness.Gateway``, without
    the fork and the supervisor (0.6-0.8 s a gateway). What only a supervisor has is absent: the admin
    listener, active health checks, the embedded Valkey (a quota names its Valkey by URL), managed keys,
    more than one worker. The worker runs exactly ``Worker.serve`` (workers/main.py), signals aside."""

    def __init__(self, directory: str, clusters: dict[str, list[str]], overlay: dict[str, Any], *,
                 extra: dict[str, Any] | None = None, cluster_options: dict[str, Any] | None = None) -> None:
        self.directory = Path(directory)
        self.config_dict: dict[str, Any] = {
            "listen": "127.0.0.1:1",  # not bound: the worker serves the socket start() binds
            "clusters": [{"name": name, "endpoints": endpoints, **copy.deepcopy(cluster_options or {})}
                         for name, endpoints in clusters.items()],
            "routing": {"overlay_file": "overlay.json"},
            "access_log": {"path": "access.log"},  # the process's stdout is the test runner's
        }
        for key, setting in (extra or {}).items():
            if isinstance(setting, dict) and isinstance(self.config_dict.get(key), dict):
                self.config_dict[key].update(setting)
            else:
                self.config_dict[key] = setting
        self.overlay_path = str(self.directory / "overlay.json")  # rewritten by a test: the worker polls it
        Path(self.overlay_path).write_text(json.dumps(overlay))
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None

    def start(self, timeout: float = 10.0) -> LoopbackGateway:
        config = parse_config(yaml.safe_dump(self.config_dict), str(self.directory))
        quota = config.quota
        if quota is not None and quota.backend.kind == "embedded":
            raise ValueError("a LoopbackGateway's quota needs backend.kind valkey and its url (no supervisor "
                             "starts the embedded one)")
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        self.port = listener.getsockname()[1]
        segment = _private_segment(config)
        ctx = WorkerContext(
            config=config, slot=0, generation=1, segment=segment, status_fd=-1, listen_fd=listener.detach(),
            quota_url=None if quota is None else quota.backend.url, affinity_region=AFFINITY_REGION,
            affinity_capacity=config.routing.session_affinity.capacity, metrics_region=METRICS_REGION,
            metric_clusters=tuple(cluster.name for cluster in config.clusters),
        )
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(Worker(ctx), started), daemon=True,
                                        name=f"loopback-gateway-{self.port}")
        self._thread.start()
        if not started.wait(timeout) or self._failure is not None:
            self.stop()
            raise RuntimeError(f"the loopback gateway did not start: {self._failure!r}")
        return self

    def _run(self, worker: Worker, started: threading.Event) -> None:
        async def serve() -> None:
            self._loop = asyncio.get_running_loop()
            self._stopping = asyncio.Event()
            await worker.serve(self._stopping, started.set)

        try:
            uvloop.run(serve())
        except BaseException as error:  # start() says why
            self._failure = error
            started.set()

    def stop(self) -> None:
        """Drain (``timeouts.graceful_shutdown``) and stop; idempotent."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        if self._loop is not None and self._stopping is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stopping.set)
        thread.join(30)

