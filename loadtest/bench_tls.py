"""wrk benchmark of what HTTPS on the listener and the access log cost one worker core.

    .venv/bin/python -m loadtest.bench_tls [--duration 10] [--rounds 3] [--connections 32] [--gateway-core 0 --load-core 1]

The loadtest/bench_core.py topology (one gateway worker pinned to the gateway core; wrk and the mock
providers on the load core), run with variants of loadtest/configs/bench.yaml:
  a. keep-alive HTTP, access log off               (the baseline)
  b. keep-alive HTTP, access log on (to a file)    (the access log's cost)
  c. keep-alive HTTPS, access log off              (TLS record cost per request)
  d. HTTP, one connection per request              (TCP connects/s, for comparison)
  e. HTTPS, one connection per request, ECDSA P-256 and RSA 2048 certificates (full handshakes/s)
"req/s per core" is 1 / (the worker's own CPU time per request, from /proc), so the figures hold on
a machine whose cores other processes share; the measured req/s is shown beside it. Needs wrk and
the openssl CLI (certificates are made in a temporary directory). Prints a markdown table and writes
loadtest/reports/bench-tls-<time>.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import yaml

from loadtest.bench_core import (
    BENCH_CONFIG,
    CHAT_PATH,
    WRK_CHAT,
    GatewayProcess,
    Topology,
    parse_wrk,
    pin_self,
    raise_fd_limit,
    start_mocks,
    stop_all,
)
from loadtest.mock_provider import child_setup
from loadtest.report import (
    core_busy_percent,
    cpu_times,
    invocation,
    markdown_table,
    run_bench,
    write_report,
)
from loadtest.topology import add_core_arguments, split_cores

KEY_TYPES = {
    "ecdsa-p256": ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"],
    "rsa-2048": ["-newkey", "rsa:2048"],
}


def make_certificate(directory: str, kind: str) -> dict[str, str]:
    cert, key = os.path.join(directory, f"{kind}.crt"), os.path.join(directory, f"{kind}.key")
    subprocess.run(["openssl", "req", "-x509", *KEY_TYPES[kind], "-nodes", "-days", "1", "-subj", "/CN=bench",
                    "-keyout", key, "-out", cert], check=True, capture_output=True)
    return {"cert_file": cert, "key_file": key}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_config(directory: str, name: str, endpoints: dict[str, int], **overrides: Any) -> Topology:
    """loadtest/configs/bench.yaml on free ports (other benchmarks may hold its fixed ones), with
    ``endpoints`` (cluster name -> mock port) shared by every variant."""
    with open(BENCH_CONFIG) as src:
        config = yaml.safe_load(src)
    config["routing"]["overlay_file"] = os.path.join(os.path.dirname(BENCH_CONFIG), config["routing"]["overlay_file"])
    config["listen"] = f"127.0.0.1:{free_port()}"
    config["admin"]["listen"] = f"127.0.0.1:{free_port()}"
    for cluster in config["clusters"]:
        cluster["endpoints"] = [f"127.0.0.1:{endpoints.setdefault(cluster['name'], free_port())}"]
    config.update(overrides)
    path = os.path.join(directory, f"{name}.yaml")
    with open(path, "w") as out:
        yaml.safe_dump(config, out)
    return Topology.from_config(path)


def wrk(url: str, connections: int, duration_s: int, cpus: set[int] | None, close: bool = False) -> dict[str, Any]:
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{duration_s}s", "--latency", "-s", WRK_CHAT, url]
    if close:
        cmd[1:1] = ["-H", "Connection: close"]
    before = cpu_times()
    done = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=child_setup(cpus),
                          timeout=duration_s + 30, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stderr.strip()}")
    result = parse_wrk(done.stdout)
    result["core_busy_percent"] = core_busy_percent(before, cpu_times())
    result["command"] = " ".join(cmd)
    return result


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time the processes used so far."""
    ticks = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def measure(topology: Topology, scheme: str, args: argparse.Namespace, gateway_cpus: set[int] | None,
            load_cpus: set[int] | None, close: bool = False) -> dict[str, Any]:
    """wrk through one worker; ``cpu_us_per_request`` is the worker's own CPU time per request, which
    stays meaningful when other processes share its core (req/s does not)."""
    host, port = topology.listen
    url = f"{scheme}://{host}:{port}{CHAT_PATH}"
    gateway = GatewayProcess(topology, 1, gateway_cpus)
    try:
        gateway.wait_ready()
        wrk(url, args.connections, 2, load_cpus, close)  # warm-up: pools, caches
        workers = gateway.worker_pids()
        before = cpu_seconds(workers)
        result = wrk(url, args.connections, args.duration, load_cpus, close)
        used = cpu_seconds(workers) - before
        result["cpu_us_per_request"] = round(used * 1e6 / max(1, result.get("requests", 0)), 1)
        return result
    finally:
        gateway.stop()


def run(args: argparse.Namespace) -> int:
    for tool in ("wrk", "openssl"):
        if shutil.which(tool) is None:
            print(f"bench_tls: {tool} not found on PATH; skipping")
            return 0
    gateway_cpus, load_cpus = split_cores(args.gateway_core, args.load_core)
    raise_fd_limit()
    pin_self(load_cpus)
    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "duration_s": args.duration,
                               "connections": args.connections, "gateway_cpus": sorted(gateway_cpus or []),
                               "load_cpus": sorted(load_cpus or [])}
    with tempfile.TemporaryDirectory() as directory:
        off = {"enabled": False}
        mock_ports: dict[str, int] = {}
        plain = write_config(directory, "http", mock_ports, access_log=off)
        logged = write_config(directory, "http-log", mock_ports,
                              access_log={"path": os.path.join(directory, "access.log")})
        tls = {kind: write_config(directory, kind, mock_ports, access_log=off,
                                  server_tls=make_certificate(directory, kind))
               for kind in KEY_TYPES}
        mocks = start_mocks(plain, load_cpus, tokens=16, models="demo-model")
        try:
            runs = [
                ("a", "keep-alive HTTP, access log off", plain, "http", False),
                ("b", "keep-alive HTTP, access log on (file)", logged, "http", False),
                ("c", "keep-alive HTTPS (ECDSA P-256), access log off", tls["ecdsa-p256"], "https", False),
                ("d", "HTTP, a new connection per request", plain, "http", True),
                ("e1", "HTTPS, a full handshake per request (ECDSA P-256)", tls["ecdsa-p256"], "https", True),
                ("e2", "HTTPS, a full handshake per request (RSA 2048)", tls["rsa-2048"], "https", True),
            ]
            for round_number in range(args.rounds):  # interleaved, so a noisy minute hits every variant
                for key, label, topology, scheme, close in runs:
                    print(f"bench_tls: round {round_number + 1}/{args.rounds} ({key}) {label}", file=sys.stderr)
                    result = measure(topology, scheme, args, gateway_cpus, load_cpus, close)
                    results.setdefault(key, {"label": label, "runs": []})["runs"].append(result)
        finally:
            stop_all(mocks)
    rows = []
    for key, entry in results.items():
        if not isinstance(entry, dict) or "runs" not in entry:
            continue
        runs_done = entry["runs"]
        entry["cpu_us_per_request"] = statistics.median(r["cpu_us_per_request"] for r in runs_done)
        entry["requests_per_s"] = statistics.median(r.get("requests_per_s", 0) for r in runs_done)
        base = results["a"]["cpu_us_per_request"] or 1
        cpu_us = entry["cpu_us_per_request"]
        spread = ", ".join(f"{r['cpu_us_per_request']:.0f}" for r in runs_done)
        errors = sum(r["non_2xx"] + r["socket_errors"] for r in runs_done)
        rows.append((f"{key}. {entry['label']}", f"{cpu_us:.0f}", f"{1e6 / max(cpu_us, 1):,.0f}",
                     f"{cpu_us / base:.2f}", f"{entry['requests_per_s']:,.0f}",
                     f"CPU µs/request per round: {spread}; non-2xx + socket errors {errors}"))
    table = markdown_table((f"1 worker, wrk -t1 -c{args.connections}, median of {args.rounds}",
                            "worker CPU µs/request", "req/s per core", "CPU vs a", "req/s measured", "detail"), rows)
    write_report("bench-tls", results, f"HTTPS and access-log cost ({results['started']})",
                 invocation("loadtest.bench_tls"), table + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_tls", description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=int, default=10, help="seconds per run")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repetitions; medians are reported")
    add_core_arguments(parser)
    args = parser.parse_args(argv)
    return run_bench("bench_tls", run, args)


if __name__ == "__main__":
    sys.exit(main())
