"""Real processes for integration tests: gateways, overlays and raw HTTP clients on loopback."""

from __future__ import annotations

import copy
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import h11
import yaml

from gateway.overlay.digest import semantic_revision

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Sockets that hold refused_port()'s ports for the life of the test process.
_HELD_PORTS: list[socket.socket] = []


def refused_port() -> int:
    """A loopback port where every connection is refused, for as long as the tests run.

    free_port()'s port is free only until someone binds it: a gateway or mock started later in the same
    test may get it, and a "dead" provider then answers (CI once saw a 404 where a 502 was due). A bound
    socket that never listens refuses every connect and keeps the port from anyone else.
    """
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    _HELD_PORTS.append(sock)
    return sock.getsockname()[1]


def envelope(candidates: list[dict[str, Any]], mode: str | None = "roundRobin", *, network: str = "test-net",
             local_site: str = "site-a", generation: int = 1) -> dict[str, Any]:
    """A valid envelope-v1 overlay with its digest stamped."""
    document: dict[str, Any] = {"network": network, "local_site": local_site, "candidates": candidates}
    if mode is not None:
        document["selection_policy"] = {"mode": mode}
    revision = semantic_revision(document)
    return {
        "schema_version": "1.0.0",
        "revision": {"kind": "content_addressed", "algorithm": "sha256", "value": revision},
        "content_digest": {"algorithm": "sha256", "value": revision},
        "scope": {"network": network, "gateway": "gw", "namespace": "ns", "local_site": local_site},
        "provenance": {
            "producer": "gridgate-tests", "producer_version": "0", "source_name": network,
            "source_uid": "uid", "source_generation": generation, "rendered_at": "2026-11-30T00:00:00Z",
        },
        "overlay": {**document, "generated_at": "2026-11-30T00:00:00Z"},
    }


def candidate(name: str, cluster: str, group: int | None = 0, admission: str = "new_and_existing",
              kind: str = "inference_model", **extra: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "kind": kind, "name": name, "site": f"site-{cluster}", "cluster": cluster,
        "admission_state": admission, "stable_id": f"{cluster}-{name}", **extra,
    }
    if group is not None:
        entry["selection_group"] = group
    return entry


def write_json_atomic(path: str, data: Any) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as handle:
        json.dump(data, handle)
    os.replace(tmp, path)


class Gateway:
    """A real `python -m gateway run` supervisor with its workers, on free loopback ports."""

    def __init__(self, directory: str, clusters: dict[str, list[str]], overlay: dict[str, Any], *,
                 workers: int = 1, extra: dict[str, Any] | None = None,
                 cluster_options: dict[str, Any] | None = None, env: dict[str, str] | None = None) -> None:
        self.directory = directory
        self.port = free_port()
        self.admin_port = free_port()
        self.overlay_path = os.path.join(directory, "overlay.json")
        self.config_path = os.path.join(directory, "gridgate.yaml")
        self.workers = workers
        self.env = env
        self.process: subprocess.Popen | None = None
        self.config: dict[str, Any] = {
            "listen": f"127.0.0.1:{self.port}",
            "workers": workers,
            "admin": {"listen": f"127.0.0.1:{self.admin_port}"},
            "clusters": [
                {"name": name, "endpoints": endpoints, **copy.deepcopy(cluster_options or {})}
                for name, endpoints in clusters.items()
            ],
            "routing": {"overlay_file": "overlay.json"},
        }
        for key, value in (extra or {}).items():
            if isinstance(value, dict) and isinstance(self.config.get(key), dict):
                self.config[key].update(value)
            else:
                self.config[key] = value
        write_json_atomic(self.overlay_path, overlay)
        self.write_config()

    def write_config(self) -> None:
        with open(self.config_path, "w") as handle:
            yaml.safe_dump(self.config, handle)

    def start(self, timeout: float = 20.0) -> Gateway:
        for attempt in range(3):
            env = {**os.environ, **(self.env or {})}
            self.log_path = os.path.join(self.directory, "gateway.log")
            self._log = open(self.log_path, "wb")
            self.process = subprocess.Popen(
                [sys.executable, "-m", "gateway", "run", "-c", self.config_path],
                cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env=env,
            )
            try:
                self.wait_ready(timeout)
                return self
            except RuntimeError as exc:
                # A port free_port() found free was taken before the gateway bound it (another process's
                # ephemeral port): the harness's race, not the gateway's. New ports, once or twice.
                if "address already in use" not in str(exc) or attempt == 2 or not self._own_ports():
                    raise
                self._log.close()
                self.port, self.admin_port = free_port(), free_port()
                self.config["listen"] = f"127.0.0.1:{self.port}"
                self.config["admin"]["listen"] = f"127.0.0.1:{self.admin_port}"
                self.write_config()
        return self

    def _own_ports(self) -> bool:
        """Whether the config still listens where the harness chose (a test may have set its own)."""
        admin = self.config.get("admin") or {}
        return (self.config.get("listen") == f"127.0.0.1:{self.port}"
                and admin.get("listen") == f"127.0.0.1:{self.admin_port}")

    def wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.process.returncode}:\n{self.log()}")
            status, _, _ = admin_get(self.admin_port, "/readyz")
            if status == 200:
                return
            time.sleep(0.05)
        raise RuntimeError(f"gateway not ready within {timeout}s:\n{self.log()}")

    def log(self) -> str:
        """The end of the gateway's own log: the access log's JSON lines, on the same stdout, left out."""
        with open(self.log_path, "rb") as handle:
            own = b"".join(line for line in handle if not line.startswith(b'{"ts":'))
        return own.decode(errors="replace")[-6000:]

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def stop(self, timeout: float = 15.0) -> int:
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else 0
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return -9
        finally:
            self._log.close()

    def worker_pids(self) -> list[int]:
        _, _, body = admin_get(self.admin_port, "/admin/overlay")
        return sorted(w["pid"] for w in json.loads(body)["workers"])

    def url(self, path: str = "/") -> str:
        return f"http://127.0.0.1:{self.port}{path}"


def wait_until(predicate: Callable[[], Any], what: str, timeout: float = 10.0) -> Any:
    """Poll ``predicate`` until it returns something true, and return that."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def clear_of_window_end(window_s: float, margin_s: float) -> None:
    """Return at once when more than ``margin_s`` seconds are left of the current ``window_s`` window (aligned
    to the epoch, as the quota ledger's token windows are; UTC hours and days are such windows), else once
    the next window has begun. A test that fills a window, or reads back what one holds, and runs across its
    end finds a new, empty one: started clear of the end, it stays inside one window."""
    left = window_s - time.time() % window_s
    if left < margin_s:
        time.sleep(left + 0.05)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def ready_with(gateway: Gateway, count: int) -> list[int] | None:
    """The worker pids once exactly ``count`` serving workers exist and /readyz says 200."""
    if admin_get(gateway.admin_port, "/readyz")[0] != 200:
        return None
    pids = gateway.worker_pids()
    return pids if len(pids) == count else None


def admin_get(port: int, path: str, timeout: float = 2.0) -> tuple[int, dict[str, str], bytes]:
    try:
        return request("127.0.0.1", port, "GET", path, timeout=timeout)
    except OSError:
        return 0, {}, b""


def metric_value(admin_port: int, sample: str) -> float:
    """One sample of the admin listener's /metrics, named with its labels as exposed
    (``gridgate_quota_leases_total{event="granted"}``); 0 when absent."""
    _, _, body = admin_get(admin_port, "/metrics")
    match = re.search(rb"^" + re.escape(sample.encode()) + rb" (\S+)$", body, re.M)
    return float(match.group(1)) if match else 0.0


class Response:
    def __init__(self, status: int, headers: dict[str, str], body: bytes, chunks: list[bytes]) -> None:
        self.status = status
        self.headers = headers
        self.body = body
        self.chunks = chunks

    def json(self) -> Any:
        return json.loads(self.body)


class Client:
    """A keep-alive HTTP/1.1 client on one raw socket (h11), for exact control in tests."""

    def __init__(self, port: int, host: str = "127.0.0.1", timeout: float = 10.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conn = h11.Connection(h11.CLIENT)
        self.host = f"{host}:{port}"

    def send(self, method: str, path: str, body: bytes | dict | None = None,
             headers: Iterable[tuple[str, str]] = ()) -> None:
        if isinstance(body, dict):
            body = json.dumps(body).encode()
        hdrs = [("host", self.host), *headers]
        if body is not None:
            hdrs.append(("content-length", str(len(body))))
        data = self.conn.send(h11.Request(method=method, target=path, headers=hdrs))
        if body:
            data += self.conn.send(h11.Data(data=body))
        data += self.conn.send(h11.EndOfMessage())
        self.sock.sendall(data)

    def receive(self) -> Response:
        status, headers, chunks = 0, {}, []
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(self.sock.recv(65536))
                continue
            if isinstance(event, h11.Response):
                status = event.status_code
                headers = {k.decode(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed):
                break
        if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
            self.conn.start_next_cycle()
        return Response(status, headers, b"".join(chunks), chunks)

    def request(self, method: str, path: str, body: bytes | dict | None = None,
                headers: Iterable[tuple[str, str]] = ()) -> Response:
        self.send(method, path, body, headers)
        return self.receive()

    def close(self) -> None:
        self.sock.close()


def request(host: str, port: int, method: str, path: str, body: bytes | dict | None = None,
            headers: Iterable[tuple[str, str]] = (), timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    client = Client(port, host, timeout)
    try:
        response = client.request(method, path, body, headers)
        return response.status, response.headers, response.body
    finally:
        client.close()


def chat(port: int, model: str = "demo-model", headers: Iterable[tuple[str, str]] = (), **fields: Any) -> Response:
    client = Client(port)
    try:
        return client.request("POST", "/v1/chat/completions",
                              {"model": model, "messages": [{"role": "user", "content": "hi"}], **fields}, headers)
    finally:
        client.close()


def raw_exchange(port: int, payload: bytes, split: int | None = None, timeout: float = 5.0,
                 pause: float = 0.002) -> bytes:
    """Send raw bytes (whole, or in pieces of ``split`` bytes) and read until the server closes."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        if split:
            for start in range(0, len(payload), split):
                if select.select([sock], [], [], 0)[0]:
                    break  # the server answered already (a rejection): stop writing, read it
                try:
                    sock.sendall(payload[start:start + split])
                except OSError:
                    break
                time.sleep(pause)
        else:
            sock.sendall(payload)
        received = b""
        while True:
            try:
                data = sock.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not data:
                break
            received += data
        return received
    finally:
        sock.close()


def status_of(raw: bytes) -> int:
    line = raw.split(b"\r\n", 1)[0]
    parts = line.split(b" ")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


# What a mock provider saw, read from its Prometheus page: outcomes, not calls.
_TRAFFIC_ENDPOINTS = ("chat", "completions", "embeddings", "debug", "models")


def mock_served(handle: Any, endpoints: Iterable[str] = _TRAFFIC_ENDPOINTS) -> int:
    """Requests the mock answered on these endpoints (default: everything but health/metrics/admin)."""
    _, _, body = request("127.0.0.1", handle.port, "GET", "/metrics")
    total = 0
    for name in endpoints:
        match = re.search(rb'^mock_requests_served_total\{[^}]*endpoint="%s"\} (\S+)' % name.encode(), body, re.M)
        total += int(float(match.group(1))) if match else 0
    return total


def mock_in_flight(handle: Any) -> int:
    _, _, body = request("127.0.0.1", handle.port, "GET", "/metrics")
    match = re.search(rb"^mock_requests_in_flight\{[^}]*\} (\S+)", body, re.M)
    return int(float(match.group(1))) if match else -1
