"""``providers verify --load DURATION``: a short bounded load through a gateway built from the same config.

A child gateway (``gridgate run``, one worker, free loopback ports, no auth, quota or access log: the
pool is under test, not the door) serves one model; a few client connections send small chat requests
for the duration (plus the reload's takeover). Half way, one provider is forced down: the child's
config gets a refused address for that cluster and a SIGHUP, so the gateway sees what a dead provider
looks like while the provider itself is untouched. The phases split where the change took effect: when the child's metrics show the
new config generation serving and the old generation's worker gone (bounded by a timeout), not after a
guessed pause. The report: per phase, each provider's share against the share the picker promises
(gateway.conformance.promise) with a pass/fail verdict, latency percentiles and the client's error rate
(failover should keep it at zero).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import yaml

from gateway.conformance.client import send
from gateway.conformance.probe import Probe, Target, post
from gateway.conformance.promise import Promise, judge

CONNECTIONS = 4
RELOAD_TIMEOUT_S = 15.0  # the longest a SIGHUP's new generation may take to serve alone before the split anyway
SHARE_TOLERANCE = 0.05  # a measured share this far (plus sampling error) from its promise still passes


@dataclass(slots=True)
class Phase:
    name: str
    providers: list[str]  # the members the picker may choose in this phase
    promise: Promise
    tolerance: float = SHARE_TOLERANCE
    served: dict[str, int] = field(default_factory=dict)
    latencies_ms: list[float] = field(default_factory=list)
    errors: int = 0
    note: str = ""  # how the phase began (the reload's observed takeover, or its timeout)

    @property
    def requests(self) -> int:
        return len(self.latencies_ms) + self.errors

    def as_dict(self) -> dict[str, Any]:
        answered = sum(self.served.values())
        ordered = sorted(self.latencies_ms)
        share = {p: self.served.get(p, 0) / max(1, answered) for p in sorted(set(self.providers) | set(self.served))}
        promised = self.promise.shares
        if promised is None:
            misses = None
        elif not answered:
            misses = ["no request was answered in this phase"]
        else:
            misses = judge(share, promised, answered, self.tolerance)
        return {"phase": self.name, "requests": self.requests, "error_rate": self.errors / max(1, self.requests),
                "picker": self.promise.picker, "share": share, "promised": promised, "tolerance": self.tolerance,
                "share_verdict": "no promise" if misses is None else "fail" if misses else "pass",
                "share_misses": misses or [], "note": self.note,
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

    async def metrics(self) -> dict[str, float]:
        """The child's unlabelled gauges and counters (``name value`` lines of /metrics)."""
        answer = await send(Target("admin", f"127.0.0.1:{self.admin}", "-"), Probe("GET", "/metrics"), 2.0)
        values: dict[str, float] = {}
        if answer.status == 200:
            for line in answer.body.decode("utf-8", "replace").splitlines():
                name, _, value = line.partition(" ")
                if name and not name.startswith("#") and "{" not in name:
                    with contextlib.suppress(ValueError):
                        values[name] = float(value)
        return values

    async def took_over(self, generation: float, timeout_s: float = RELOAD_TIMEOUT_S) -> bool:
        """Wait until a generation after ``generation`` serves and no older worker is left (so every new
        request meets the new config); False when ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            values = await self.metrics()
            if (values.get("gridgate_config_generation", 0) > generation
                    and values.get("gridgate_workers_live", 2) <= values.get("gridgate_workers_target", 1)):
                return True
            await asyncio.sleep(0.02)
        return False

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
        for held in self._held:
            held.close()


async def _client(target: Target, probe: Probe, phase_of: Any, stop_at: list[float]) -> None:
    while time.monotonic() < stop_at[0]:
        phase = phase_of()
        answer = await send(target, probe, 10.0)
        provider = answer.headers.get("x-gridgate-provider")
        if answer.error is None and answer.status == 200:
            phase.latencies_ms.append(answer.total_s * 1000)
            phase.served[provider or "?"] = phase.served.get(provider or "?", 0) + 1
        else:
            phase.errors += 1


async def run_load(config_path: str, model: str, providers: list[str], duration_s: float, max_tokens: int,
                   promise_of: Callable[[list[str]], Promise], tolerance: float = SHARE_TOLERANCE) -> list[Phase]:
    """Load through a child gateway for ``duration_s``: the first half with every provider, the second
    (from the moment the reload took effect) with the last one forced down. ``promise_of(usable)`` is
    what the picker promises those providers."""
    gateway = ChildGateway(config_path, providers)
    up, down = list(providers), list(providers[:-1])
    phases = [Phase("all up", up, promise_of(up), tolerance), Phase(f"{providers[-1]} down", down, promise_of(down),
                                                                      tolerance)]
    current = [phases[0]]
    try:
        await gateway.ready()
        target = Target("gateway", f"127.0.0.1:{gateway.port}", model)
        probe = post("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "Hi."}],
                                              "max_tokens": max_tokens}, 8 + max_tokens)
        start = time.monotonic()
        stop_at = [start + duration_s]
        clients = [asyncio.create_task(_client(target, probe, lambda: current[0], stop_at))
                   for _ in range(CONNECTIONS)]
        await asyncio.sleep(duration_s / 2)
        generation = (await gateway.metrics()).get("gridgate_config_generation", 0)
        forced_at = time.monotonic()
        stop_at[0] = math.inf  # the clients keep going while the reload takes over, however long it takes
        gateway.force_down(providers[-1])
        took_over = await gateway.took_over(generation)  # requests meanwhile count as phase one
        waited = time.monotonic() - forced_at
        phases[1].note = (f"split {waited:.2f}s after the SIGHUP, when the new generation served alone" if took_over
                          else f"split after {waited:.0f}s: the reload was not seen taking over")
        current[0] = phases[1]
        stop_at[0] = time.monotonic() + duration_s / 2  # phase two gets its full half, however long the reload took
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
        promised = view["promised"] or {}
        axis.bar([x + 0.2 for x in xs], [promised.get(n, 0) for n in names], 0.4, label="promised")
        axis.set_xticks(list(xs), names)
        axis.set_ylim(0, 1)
        axis.set_title(f"{phase.name}: {view['requests']} requests, errors {view['error_rate']:.1%}, "
                       f"shares {view['share_verdict']}")
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
        verdict = view["share_verdict"]
        if view["share_misses"]:
            verdict += ": " + "; ".join(view["share_misses"])
        lines.append(f"  shares against {view['picker']}'s promise (+-{view['tolerance']:.0%} and sampling error): "
                     f"{verdict}" + (f"  [{view['note']}]" if view["note"] else ""))
        promised = view["promised"]
        for name, share in view["share"].items():
            wanted = "    n/a" if promised is None else f"{promised.get(name, 0):6.1%}"
            lines.append(f"  {name:20} share {share:6.1%}  promised {wanted}")
    return "\n".join(lines)
