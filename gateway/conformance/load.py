"""``providers verify --load DURATION``: a short bounded load through a gateway built from the same config.

A child gateway (``gridgate run``, one worker, free loopback ports, no auth, quota or access log: the
pool is under test, not the door) serves one model; a few client connections send small chat requests
for the duration. Half way, one provider is forced down: the child's config gets a refused address for
that cluster and a SIGHUP, so the gateway sees what a dead provider looks like while the provider
itself is untouched. The report: per phase, each provider's share against the even share the picker
promises its selection group, latency percentiles and the client's error rate (failover should keep it
at zero).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import yaml

from gateway.conformance.client import send
from gateway.conformance.probe import Probe, Target, post

CONNECTIONS = 4
RELOAD_SETTLE_S = 1.0  # a SIGHUP's new worker generation takes over well within this on a quiet host


@dataclass(slots=True)
class Phase:
    name: str
    providers: list[str]  # the members the picker may choose in this phase
    served: dict[str, int] = field(default_factory=dict)
    latencies_ms: list[float] = field(default_factory=list)
    errors: int = 0

    @property
    def requests(self) -> int:
        return len(self.latencies_ms) + self.errors

    def as_dict(self) -> dict[str, Any]:
        total = max(1, sum(self.served.values()))
        ordered = sorted(self.latencies_ms)
        return {"phase": self.name, "requests": self.requests, "error_rate": self.errors / max(1, self.requests),
                "share": {p: self.served.get(p, 0) / total for p in sorted(set(self.providers) | set(self.served))},
                "promised": {p: 1 / len(self.providers) for p in self.providers},
                "latency_ms": {f"p{q}": percentile(ordered, q) for q in (50, 90, 99)}}


def percentile(ordered: list[float], q: int) -> float | None:
    if not ordered:
        return None
    return round(ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))], 2)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _refused_address() -> tuple[str, socket.socket]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound, never listening: every connect is refused
    return f"127.0.0.1:{sock.getsockname()[1]}", sock


def child_config(source: dict[str, Any], base_dir: str, port: int, admin: int) -> dict[str, Any]:
    config = {key: value for key, value in source.items() if key not in ("auth", "quota", "listen", "admin", "workers")}
    config.update(listen=f"127.0.0.1:{port}", admin={"listen": f"127.0.0.1:{admin}"}, workers=1,
                  access_log={"enabled": False})
    routing = dict(config["routing"])
    routing.pop("conformance", None)
    if routing.get("overlay_file"):
        routing["overlay_file"] = os.path.join(base_dir, routing["overlay_file"])
    config["routing"] = routing
    return config


class ChildGateway:
    def __init__(self, config_path: str, providers: list[str]) -> None:
        with open(config_path) as handle:
            self.source = yaml.safe_load(handle)
        self.port, self.admin = _free_port(), _free_port()
        self.directory = tempfile.mkdtemp(prefix="gridgate-load-")
        self.path = os.path.join(self.directory, "gateway.yaml")
        self.config = child_config(self.source, os.path.dirname(os.path.abspath(config_path)), self.port, self.admin)
        self.config["clusters"] = [c for c in self.config["clusters"] if c["name"] in providers]
        self._write()
        self.process = subprocess.Popen([sys.executable, "-m", "gateway", "run", "-c", self.path],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._held: list[socket.socket] = []

    def _write(self) -> None:
        with open(self.path, "w") as handle:
            yaml.safe_dump(self.config, handle)

    async def ready(self, timeout_s: float = 20.0) -> None:
        probe = Target("admin", f"127.0.0.1:{self.admin}", "-")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the load gateway exited with {self.process.returncode}")
            if (await send(probe, Probe("GET", "/readyz"), 1.0)).status == 200:
                return
            await asyncio.sleep(0.1)
        raise RuntimeError("the load gateway did not become ready")

    def force_down(self, cluster: str) -> None:
        address, held = _refused_address()
        self._held.append(held)
        for entry in self.config["clusters"]:
            if entry["name"] == cluster:
                entry["endpoints"] = [address]
        self._write()
        self.process.send_signal(signal.SIGHUP)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
        for held in self._held:
            held.close()


async def _client(target: Target, probe: Probe, phase_of: Any, stop_at: float) -> None:
    while time.monotonic() < stop_at:
        phase = phase_of()
        answer = await send(target, probe, 10.0)
        provider = answer.headers.get("x-gridgate-provider")
        if answer.error is None and answer.status == 200:
            phase.latencies_ms.append(answer.total_s * 1000)
            phase.served[provider or "?"] = phase.served.get(provider or "?", 0) + 1
        else:
            phase.errors += 1


async def run_load(config_path: str, model: str, providers: list[str], duration_s: float,
                   max_tokens: int) -> list[Phase]:
    """Load through a child gateway for ``duration_s``: the first half with every provider, the second
    with the last one forced down."""
    gateway = ChildGateway(config_path, providers)
    phases = [Phase("all up", list(providers)), Phase(f"{providers[-1]} down", list(providers[:-1]))]
    current = [phases[0]]
    try:
        await gateway.ready()
        target = Target("gateway", f"127.0.0.1:{gateway.port}", model)
        probe = post("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "Hi."}],
                                              "max_tokens": max_tokens}, 8 + max_tokens)
        start = time.monotonic()
        clients = [asyncio.create_task(_client(target, probe, lambda: current[0], start + duration_s))
                   for _ in range(CONNECTIONS)]
        await asyncio.sleep(duration_s / 2)
        gateway.force_down(providers[-1])
        await asyncio.sleep(RELOAD_SETTLE_S)  # the reload takes effect; requests meanwhile count as phase one
        current[0] = phases[1]
        await asyncio.gather(*clients)
    finally:
        gateway.stop()
    return phases


def plot(phases: list[Phase], path: str) -> None:
    """Share against promise per phase, as a PNG beside the table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(phases), figsize=(5 * len(phases), 3.5), squeeze=False)
    for axis, phase in zip(axes[0], phases, strict=True):
        view = phase.as_dict()
        names = sorted(view["share"])
        xs = range(len(names))
        axis.bar([x - 0.2 for x in xs], [view["share"][n] for n in names], 0.4, label="observed")
        axis.bar([x + 0.2 for x in xs], [view["promised"].get(n, 0) for n in names], 0.4, label="promised")
        axis.set_xticks(list(xs), names)
        axis.set_ylim(0, 1)
        axis.set_title(f"{phase.name}: {view['requests']} requests, errors {view['error_rate']:.1%}")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def load_table(phases: list[Phase]) -> str:
    lines = []
    for phase in phases:
        view = phase.as_dict()
        latency = view["latency_ms"]
        lines.append(f"load, {view['phase']}: {view['requests']} requests, error rate {view['error_rate']:.2%}, "
                     f"latency p50 {latency['p50']} ms, p90 {latency['p90']} ms, p99 {latency['p99']} ms")
        for name, share in view["share"].items():
            lines.append(f"  {name:20} share {share:6.1%}  promised {view['promised'].get(name, 0):6.1%}")
    return "\n".join(lines)
