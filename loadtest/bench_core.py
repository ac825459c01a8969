"""wrk benchmark of the data plane: one gateway worker on one core, everything else on another.

    .venv/bin/python -m loadtest.bench_core [--duration 10] [--streams 1000] [--gateway-core 0 --load-core 1]

Topology: one mock provider per endpoint of loadtest/configs/bench.yaml (pinned to the load core),
the gateway with `--workers 1` (pinned to the gateway core), wrk and this script on the load core.
Measures:
  a. proxied non-streaming req/s of the single worker   (wrk -t1 -c32, chat completion, demo-model)
  b. the same load sent straight to one mock              (what the far end can do alone)
  c. gateway overhead p50/p99 at one connection           (x-gridgate-overhead-ms via a wrk Lua hook)
  d. worker RSS idle and after the load                   (/proc)
  e. 1,000 concurrent slow streams through the worker     (asyncio client; errors counted)
Prints a markdown table and writes loadtest/reports/bench-core-<time>.{json,md}.
Without wrk on PATH it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import yaml

from loadtest.mock_provider import MockProviderHandle, child_setup, start_mock_provider_process, terminate
from loadtest.report import (
    REPORTS_DIR,
    child_pids,
    core_busy_percent,
    cpu_times,
    markdown_table,
    rss_kib,
    summarize,
    timestamp,
    write_json,
    write_text,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_CONFIG = os.path.join(ROOT, "loadtest", "configs", "bench.yaml")
WRK_CHAT = os.path.join(ROOT, "loadtest", "configs", "wrk_chat.lua")
WRK_OVERHEAD = os.path.join(ROOT, "loadtest", "configs", "wrk_features.lua")
CHAT_PATH = "/v1/chat/completions"


# --------------------------------------------------------------------------------------------------
# Topology (also used by loadtest/bench.py)


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
                 quiet: bool = True) -> None:
        cmd = [sys.executable, "-m", "gateway", "run", "-c", topology.config_path]
        if workers is not None:
            cmd += ["--workers", str(workers)]
        self.topology = topology
        self.log_path = os.path.join(REPORTS_DIR, "gateway-bench.log")
        os.makedirs(REPORTS_DIR, exist_ok=True)
        self.log = open(self.log_path, "wb") if quiet else None  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT if quiet else None,
                                        preexec_fn=child_setup(cpus))

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


def raise_fd_limit() -> None:
    """Thousands of sockets per process (client + gateway + mocks inherit the raised soft limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))


def pin_self(cpus: set[int] | None) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)


# --------------------------------------------------------------------------------------------------
# wrk


UNITS = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60000.0}


def to_ms(text: str) -> float:
    match = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    return float(match.group(1)) * UNITS[match.group(2)] if match else float("nan")


def parse_wrk(output: str) -> dict[str, Any]:
    result: dict[str, Any] = {}
    if match := re.search(r"Requests/sec:\s+([\d.]+)", output):
        result["requests_per_s"] = float(match.group(1))
    if match := re.search(r"(\d+) requests in ([\d.]+\w+)", output):
        result["requests"] = int(match.group(1))
    for pct in ("50", "75", "90", "99"):
        if match := re.search(rf"^\s+{pct}(?:\.000)?%\s+(\S+)", output, re.M):
            result[f"latency_p{pct}_ms"] = to_ms(match.group(1))
    result["non_2xx"] = int(m.group(1)) if (m := re.search(r"Non-2xx or 3xx responses: (\d+)", output)) else 0
    if match := re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output):
        result["socket_errors"] = sum(int(g) for g in match.groups())
    else:
        result["socket_errors"] = 0
    if match := re.search(r"OVERHEAD_MS n=(\d+) missing=(\d+) p50=([\d.]+) p90=([\d.]+) p99=([\d.]+) max=([\d.]+)",
                          output):
        n, missing, p50, p90, p99, peak = match.groups()
        result["overhead_ms"] = {"n": int(n), "missing": int(missing), "p50": float(p50), "p90": float(p90),
                                 "p99": float(p99), "max": float(peak)}
    return result


def run_wrk(url: str, script: str, connections: int, duration_s: int, cpus: set[int] | None) -> dict[str, Any]:
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{duration_s}s", "--latency", "-s", script, url]
    done = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=child_setup(cpus),
                          timeout=duration_s + 30, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stderr.strip()}")
    result = parse_wrk(done.stdout)
    result["command"] = " ".join(cmd)
    return result


# --------------------------------------------------------------------------------------------------
# Slow streams


@dataclass
class StreamOutcome:
    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    durations_s: list[float] = field(default_factory=list)

    def fail(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


def stream_request(host: str, tokens: int, tokens_per_s: float) -> bytes:
    body = json.dumps({"model": "demo-model", "stream": True, "max_tokens": tokens,
                       "messages": [{"role": "user", "content": "Tell me a slow story."}]}).encode()
    head = (f"POST {CHAT_PATH} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nX-Mock-Tokens: {tokens}\r\nX-Mock-Tokens-Per-S: {tokens_per_s}\r\n"
            "Connection: close\r\n\r\n")
    return head.encode() + body


async def one_stream(address: tuple[str, int], request: bytes, tokens: int, timeout: float,
                     outcome: StreamOutcome) -> None:
    started = time.monotonic()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(*address), timeout)
    except (TimeoutError, OSError):
        outcome.fail("connect")
        return
    try:
        writer.write(request)
        data = await asyncio.wait_for(reader.read(), timeout)  # Connection: close -> read to EOF
    except (TimeoutError, OSError) as exc:
        outcome.fail("timeout" if isinstance(exc, TimeoutError) else "read")
        return
    finally:
        writer.close()
    if not data.startswith(b"HTTP/1.1 200"):
        outcome.fail("status " + data[9:12].decode(errors="replace"))
    elif b"data: [DONE]" not in data or data.count(b'"content"') < tokens:
        outcome.fail("incomplete")
    else:
        outcome.ok += 1
        outcome.durations_s.append(time.monotonic() - started)


async def slow_streams(address: tuple[str, int], count: int, tokens: int, tokens_per_s: float,
                       on_peak: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Open `count` streams (ramped in batches so the accept backlog keeps up) and wait for all."""
    request = stream_request(address[0], tokens, tokens_per_s)
    stream_s = tokens / tokens_per_s
    outcome = StreamOutcome()
    started = time.monotonic()
    tasks = []
    for index in range(count):
        tasks.append(asyncio.ensure_future(one_stream(address, request, tokens, stream_s + 60, outcome)))
        if index % 100 == 99:
            await asyncio.sleep(0.05)
    await asyncio.sleep(max(0.0, stream_s / 2 - (time.monotonic() - started)))
    peak = await asyncio.get_running_loop().run_in_executor(None, on_peak)
    await asyncio.gather(*tasks)
    return {"streams": count, "ok": outcome.ok, "errors": outcome.errors, "error_count": sum(outcome.errors.values()),
            "tokens_per_stream": tokens, "tokens_per_s": tokens_per_s, "wall_s": round(time.monotonic() - started, 2),
            "duration_s": summarize(outcome.durations_s), "at_midpoint": peak}


def upstream_in_flight(mocks: list[MockProviderHandle]) -> int:
    total = 0
    for mock in mocks:
        _, body = http_get((mock.host, mock.port), "/metrics")
        if match := re.search(rb"^mock_requests_in_flight\{[^}]*\} (\d+)", body, re.M):
            total += int(match.group(1))
    return total


# --------------------------------------------------------------------------------------------------
# The run


def render(results: dict[str, Any]) -> str:
    gw, direct, one = results["proxied"], results["direct"], results["overhead_1conn"]
    overhead = one.get("overhead_ms", {})
    rss, streams = results["rss"], results["slow_streams"]
    idle = ", ".join(f"{kib / 1024:.1f}" for kib in rss["idle"]["workers_kib"].values()) or "?"
    loaded = ", ".join(f"{kib / 1024:.1f}" for kib in rss["after_load"]["workers_kib"].values()) or "?"
    rows = [
        ("a. proxied req/s, 1 worker (c=32)", f"{gw.get('requests_per_s', 0):,.0f}",
         f"p50 {gw.get('latency_p50_ms', 0):.2f} ms, p99 {gw.get('latency_p99_ms', 0):.2f} ms, "
         f"non-2xx {gw['non_2xx']}, socket errors {gw['socket_errors']}, core busy % "
         + ", ".join(f"cpu{core} {pct:.0f}" for core, pct in gw.get("core_busy_percent", {}).items())),
        ("b. direct to mock req/s (c=32)", f"{direct.get('requests_per_s', 0):,.0f}",
         f"p50 {direct.get('latency_p50_ms', 0):.2f} ms, p99 {direct.get('latency_p99_ms', 0):.2f} ms "
         "(mock and wrk share the load core)"),
        ("c. gateway overhead p50 / p99 (c=1)", f"{overhead.get('p50', 0):.3f} / {overhead.get('p99', 0):.3f} ms",
         f"n={overhead.get('n', 0)} missing header={overhead.get('missing', 0)}; end-to-end p50 "
         f"{one.get('latency_p50_ms', 0):.3f} ms vs direct {results['direct_1conn'].get('latency_p50_ms', 0):.3f} ms"),
        ("d. worker RSS idle / after load", f"{idle} / {loaded} MiB",
         f"supervisor {(rss['idle']['supervisor_kib'] or 0) / 1024:.1f} MiB"),
        (f"e. {streams['streams']} concurrent slow streams", f"{streams['error_count']} errors",
         f"ok {streams['ok']}, {streams['tokens_per_stream']} tok at {streams['tokens_per_s']} tok/s, "
         f"wall {streams['wall_s']} s, upstream in flight at midpoint "
         f"{streams['at_midpoint'].get('upstream_in_flight')}, worker RSS then "
         f"{streams['at_midpoint'].get('worker_rss_mib')} MiB"),
    ]
    return markdown_table(("measure", "result", "detail"), rows)


def run(args: argparse.Namespace) -> int:
    if shutil.which("wrk") is None:
        print("bench_core: wrk not found on PATH; skipping (install it: apt-get install -y wrk)")
        return 0
    multi_core = len(os.sched_getaffinity(0)) > 1
    gateway_cpus = {args.gateway_core} if multi_core else None
    load_cpus = {args.load_core} if multi_core else None
    raise_fd_limit()
    pin_self(load_cpus)
    topology = Topology.from_config(args.config)
    host, port = topology.listen
    url = f"http://{host}:{port}{CHAT_PATH}"
    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": args.config,
                               "gateway_cpus": sorted(gateway_cpus or []), "load_cpus": sorted(load_cpus or []),
                               "duration_s": args.duration}
    mocks = start_mocks(topology, load_cpus, tokens=16, models="demo-model")
    gateway: GatewayProcess | None = None
    try:
        _, mock_host, mock_port = topology.endpoints[0]
        direct_url = f"http://{mock_host}:{mock_port}{CHAT_PATH}"
        print("bench_core: (b) direct-to-mock baseline", file=sys.stderr)
        results["direct"] = run_wrk(direct_url, WRK_CHAT, args.connections, args.duration, load_cpus)
        results["direct_1conn"] = run_wrk(direct_url, WRK_CHAT, 1, max(3, args.duration // 2), load_cpus)
        gateway = GatewayProcess(topology, 1, gateway_cpus)
        gateway.wait_ready()
        time.sleep(1.0)  # let start-up settle before measuring idle memory
        results["rss"] = {"idle": gateway.rss()}
        run_wrk(url, WRK_CHAT, args.connections, 2, load_cpus)  # warm-up: pools, caches
        print("bench_core: (a) proxied throughput", file=sys.stderr)
        before = cpu_times()
        results["proxied"] = run_wrk(url, WRK_CHAT, args.connections, args.duration, load_cpus)
        results["proxied"]["core_busy_percent"] = core_busy_percent(before, cpu_times())
        print("bench_core: (c) overhead at one connection", file=sys.stderr)
        results["overhead_1conn"] = run_wrk(url, WRK_OVERHEAD, 1, max(3, args.duration // 2), load_cpus)
        results["rss"]["after_load"] = gateway.rss()
        print(f"bench_core: (e) {args.streams} concurrent slow streams", file=sys.stderr)

        def midpoint() -> dict[str, Any]:
            rss = gateway.rss()["workers_kib"] if gateway else {}
            return {"upstream_in_flight": upstream_in_flight(mocks),
                    "worker_rss_mib": [round(kib / 1024, 1) for kib in rss.values()]}

        results["slow_streams"] = asyncio.run(slow_streams(topology.listen, args.streams, args.stream_tokens,
                                                           args.stream_tokens_per_s, midpoint))
    finally:
        if gateway is not None:
            results["gateway_exit_code"] = gateway.stop()
        stop_all(mocks)
    table = render(results)
    stamp = timestamp()
    json_path = write_json(os.path.join(REPORTS_DIR, f"bench-core-{stamp}.json"), results)
    md_path = write_text(os.path.join(REPORTS_DIR, f"bench-core-{stamp}.md"),
                         f"# gridgate data-plane benchmark ({results['started']})\n\n{table}\n")
    print(table)
    print(f"\nbench_core: wrote {json_path} and {md_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_core", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=BENCH_CONFIG)
    parser.add_argument("--duration", type=int, default=10, help="seconds per throughput run")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--stream-tokens", type=int, default=30)
    parser.add_argument("--stream-tokens-per-s", type=float, default=10.0)
    parser.add_argument("--gateway-core", type=int, default=0)
    parser.add_argument("--load-core", type=int, default=1)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except RuntimeError as exc:
        print(f"bench_core: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
