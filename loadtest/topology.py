"""The benchmark topology: a gateway config's addresses, its mock providers, the gateway process.

Shared by every benchmark (bench_core, bench_streams, bench_features, bench): start the mocks a config
names, run `python -m gateway run` pinned to cores, read RSS and the mocks' in-flight counts, and
derive variants of loadtest/configs/bench.yaml.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml

from loadtest.mock_provider import MockProviderHandle, child_setup, start_mock_provider_process, terminate
from loadtest.report import REPORTS_DIR, child_pids, rss_kib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_CONFIG = os.path.join(ROOT, "loadtest", "configs", "bench.yaml")
CHAT_PATH = "/v1/chat/completions"


def split_host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


@dataclass
class Topology:
    """Addresses a gateway config names: where it listens and the provider endpoints to mock."""

    config_path: str
    listen: tuple[str, int]
    admin: tuple[str, int]
    endpoints: list[tuple[str, str, int]]  # (cluster name, host, port)

    @classmethod
    def from_config(cls, path: str) -> Topology:
        with open(path) as src:
            raw = yaml.safe_load(src)
        endpoints = []
        for cluster in raw.get("clusters", []):
            for endpoint in cluster["endpoints"]:
                address = endpoint if isinstance(endpoint, str) else endpoint["address"]
                host, port = split_host_port(address)
                endpoints.append((cluster["name"], host, port))
        admin = (raw.get("admin") or {}).get("listen", "127.0.0.1:9901")
        return cls(path, split_host_port(raw.get("listen", "127.0.0.1:8080")), split_host_port(admin), endpoints)


def start_mocks(topology: Topology, cpus: set[int] | None, **opts: Any) -> list[MockProviderHandle]:
    mocks: list[MockProviderHandle] = []
    try:
        for name, host, port in topology.endpoints:
            mocks.append(start_mock_provider_process(port, name, host=host, cpus=cpus, **opts))
    except BaseException:
        stop_all(mocks)
        raise
    return mocks


def stop_all(mocks: list[MockProviderHandle]) -> None:
    for mock in mocks:
        mock.stop()


def http_get(address: tuple[str, int], path: str, timeout: float = 1.0) -> tuple[int, bytes]:
    """A one-shot GET (status, body); (0, b'') when nothing answers."""
    try:
        with socket.create_connection(address, timeout=timeout) as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {address[0]}\r\nConnection: close\r\n\r\n".encode())
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
    except OSError:
        return 0, b""
    data = b"".join(chunks)
    head, _, body = data.partition(b"\r\n\r\n")
    parts = head.split(b" ", 2)
    return (int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0), body


class GatewayProcess:
    """`python -m gateway run` as a child process, optionally pinned to cores (workers inherit it)."""

    def __init__(self, topology: Topology, workers: int | None, cpus: set[int] | None,
                 quiet: bool = True, log_name: str = "gateway-bench.log", env: dict[str, str] | None = None) -> None:
        """``env``: variables added to this process's environment for the gateway's."""
        cmd = [sys.executable, "-m", "gateway", "run", "-c", topology.config_path]
        if workers is not None:
            cmd += ["--workers", str(workers)]
        self.topology = topology
        self.log_path = os.path.join(REPORTS_DIR, log_name)  # one per gateway when several run at once
        os.makedirs(REPORTS_DIR, exist_ok=True)
        self.log = open(self.log_path, "wb") if quiet else None  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT if quiet else None,
                                        preexec_fn=child_setup(cpus), env=None if env is None else {**os.environ, **env})

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.process.returncode}; see {self.log_path}")
            if http_get(self.topology.admin, "/readyz", timeout=0.5)[0] == 200:
                return
            time.sleep(0.1)
        raise RuntimeError(f"gateway not ready within {timeout}s; see {self.log_path}")

    def worker_pids(self) -> list[int]:
        """Worker processes: children of the supervisor, minus an embedded Valkey if there is one."""
        pids = []
        for pid in child_pids(self.process.pid):
            try:
                with open(f"/proc/{pid}/comm") as comm:
                    if "valkey" in comm.read():
                        continue
            except OSError:
                continue
            pids.append(pid)
        return pids

    def rss(self) -> dict[str, Any]:
        workers = {pid: rss_kib(pid) for pid in self.worker_pids()}
        return {"supervisor_kib": rss_kib(self.process.pid),
                "workers_kib": {str(pid): kib for pid, kib in workers.items() if kib is not None}}

    def stop(self, timeout: float = 35.0) -> int:
        code = terminate(self.process, timeout)
        if self.log is not None:
            self.log.close()
        return code


def raise_fd_limit(wanted: int = 65536) -> tuple[int, int]:
    """Raise RLIMIT_NOFILE of this process (children inherit it) towards `wanted`; the new limits.

    Root may raise the hard limit too (up to fs.nr_open); others get their hard limit.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= wanted:
        return soft, hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, max(hard, wanted)))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def pin_self(cpus: set[int] | None) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)


def add_core_arguments(parser: Any) -> None:
    """``--gateway-core`` and ``--load-core``: the two cores ``split_cores`` pins to."""
    parser.add_argument("--gateway-core", type=int, default=0)
    parser.add_argument("--load-core", type=int, default=1)


def split_cores(proxy_core: int = 0, load_core: int = 1) -> tuple[set[int] | None, set[int] | None]:
    """(proxy cores, load cores): one core for the proxy under test and one for the load, mocks and
    Valkey, when this process may use more than one; (None, None) (no pinning) on a single core."""
    if len(os.sched_getaffinity(0)) > 1:
        return {proxy_core}, {load_core}
    return None, None


def upstream_in_flight(mocks: list[MockProviderHandle]) -> int:
    """Requests the mocks are serving right now (from their /metrics)."""
    total = 0
    for mock in mocks:
        _, body = http_get((mock.host, mock.port), "/metrics")
        if match := re.search(rb"^mock_requests_in_flight\{[^}]*\} (\d+)", body, re.M):
            total += int(match.group(1))
    return total


def write_derived_config(base_path: str, work_dir: str, name: str,
                         change: Callable[[dict[str, Any]], None]) -> str:
    """A copy of a gateway config, changed by `change`, next to a copy of its overlay; its path."""
    with open(base_path) as src:
        config = yaml.safe_load(src)
    overlay = config["routing"].get("overlay_file")
    if overlay:
        shutil.copy(os.path.join(os.path.dirname(base_path), overlay), work_dir)
    change(config)
    path = os.path.join(work_dir, f"{name}.yaml")
    with open(path, "w") as out:
        yaml.safe_dump(config, out)
    return path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def move_to_free_ports(config: dict[str, Any]) -> None:
    """Listen, admin and every endpoint on free loopback ports: runs beside other gateways and benches."""
    config["listen"] = f"127.0.0.1:{free_port()}"
    config["admin"] = {**config.get("admin", {}), "listen": f"127.0.0.1:{free_port()}"}
    for cluster in config["clusters"]:
        cluster["endpoints"] = [f"127.0.0.1:{free_port()}" for _ in cluster["endpoints"]]

