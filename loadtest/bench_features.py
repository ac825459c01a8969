"""What each feature costs on the request path, measured in one run (ratios, not absolute figures).

    python -m loadtest.bench_features [--duration 8] [--connections 32]

One gateway worker pinned to core 0; wrk, the mock providers and the embedded Valkey on core 1. The
same topology is run with the routing core only, then with active health checks and outlier
detection, session affinity, auth + token quota (embedded Valkey), and everything together. For each:
proxied req/s (32 connections), the worker's CPU time per request and the capacity of one worker core
that implies (1 / CPU per request), its ratio to the core run, and the gateway overhead p50/p99 at one
connection (``x-gridgate-overhead-ms``: request bytes in to upstream request written).

The ratio is taken on the worker's CPU per request, not on req/s: with quota on, the load core also
runs Valkey's Lua ledger for every request and saturates first, which says nothing about the gateway.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from gateway.auth import hash_api_key
from loadtest.bench_core import run_wrk
from loadtest.report import REPORTS_DIR, child_pids, markdown_table, timestamp, write_json, write_text
from loadtest.topology import (
    BENCH_CONFIG,
    CHAT_PATH,
    GatewayProcess,
    Topology,
    pin_self,
    raise_fd_limit,
    split_cores,
    start_mocks,
    stop_all,
    write_derived_config,
)

HERE = os.path.dirname(os.path.abspath(__file__))
WRK_FEATURES = os.path.join(HERE, "configs", "wrk_features.lua")
BENCH_KEY = "sk-bench"

FAST_HEALTH = {"type": "http", "path": "/health", "interval": "1s", "timeout": "500ms"}


def _health(config: dict[str, Any]) -> None:
    for cluster in config["clusters"]:
        cluster["health_check"] = dict(FAST_HEALTH)
        cluster["outlier_detection"] = {"consecutive_failures": 5, "base_ejection": "30s"}


def _affinity(config: dict[str, Any]) -> None:
    config["routing"]["session_affinity"] = {"enabled": True, "header": "X-Session-Id", "ttl": "1h"}


def _quota(config: dict[str, Any], data_dir: str) -> None:
    config["auth"] = {"keys": [{"tenant": "bench", "key": hash_api_key(BENCH_KEY)}]}
    config["quota"] = {
        "backend": {"kind": "embedded", "data_dir": data_dir},
        "rules": [{"name": "bench", "match": {"tenant": "bench"},
                   "budgets": [{"window": "1m", "tokens": 10**12}, {"window": "1d", "tokens": 10**13}]}],
    }


Feature = Callable[[dict[str, Any]], None]


def variants(work_dir: str) -> list[tuple[str, Feature]]:
    """(name, config change) per variant of loadtest/configs/bench.yaml."""

    def derive(*features: Feature) -> Feature:
        def change(config: dict[str, Any]) -> None:
            for feature in features:
                feature(config)

        return change

    quota = lambda c: _quota(c, os.path.join(work_dir, "valkey"))  # noqa: E731
    return [
        ("core (auth, quota, health off)", derive()),
        ("+ health checks + outlier detection", derive(_health)),
        ("+ session affinity", derive(_affinity)),
        ("+ auth + token quota", derive(quota)),
        ("everything", derive(_health, _affinity, quota)),
    ]


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds a process used so far."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pin_valkey(supervisor_pid: int, cpus: set[int] | None) -> None:
    """The embedded Valkey stands in for a remote server: keep it off the measured worker's core."""
    if not cpus:
        return
    for pid in child_pids(supervisor_pid):
        try:
            with open(f"/proc/{pid}/comm") as comm:
                if "valkey" in comm.read():
                    os.sched_setaffinity(pid, cpus)
        except OSError:
            continue


def run(args: argparse.Namespace) -> int:
    if shutil.which("wrk") is None:
        print("bench_features: wrk not found on PATH; skipping (apt-get install -y wrk)")
        return 0
    gateway_cpus, load_cpus = split_cores()
    raise_fd_limit()
    pin_self(load_cpus)
    work_dir = tempfile.mkdtemp(prefix="gridgate-bench-")
    topology = Topology.from_config(BENCH_CONFIG)
    url = f"http://{topology.listen[0]}:{topology.listen[1]}{CHAT_PATH}"
    mocks = start_mocks(topology, load_cpus, tokens=16, models="demo-model")
    rows: list[dict[str, Any]] = []
    try:
        for index, (name, change) in enumerate(variants(work_dir)):
            variant_topology = Topology.from_config(write_derived_config(BENCH_CONFIG, work_dir, f"variant-{index}",
                                                                         change))
            gateway = GatewayProcess(variant_topology, 1, gateway_cpus)
            try:
                gateway.wait_ready()
                pin_valkey(gateway.process.pid, load_cpus)
                time.sleep(1.0)
                run_wrk(url, WRK_FEATURES, args.connections, 2, load_cpus)  # warm-up
                print(f"bench_features: {name}", file=sys.stderr)
                workers = gateway.worker_pids()
                cpu_before = sum(process_cpu_s(pid) for pid in workers)
                throughput = run_wrk(url, WRK_FEATURES, args.connections, args.duration, load_cpus)
                cpu_s = sum(process_cpu_s(pid) for pid in workers) - cpu_before
                requests = throughput.get("requests", 0) or 1
                throughput["worker_cpu_us_per_request"] = cpu_s / requests * 1e6
                overhead = run_wrk(url, WRK_FEATURES, 1, max(3, args.duration // 2), load_cpus)
                rows.append({"variant": name, "throughput": throughput, "overhead_1conn": overhead,
                             "rss_kib": gateway.rss()["workers_kib"]})
            finally:
                gateway.stop()
    finally:
        stop_all(mocks)
        shutil.rmtree(work_dir, ignore_errors=True)
    core_cpu = rows[0]["throughput"].get("worker_cpu_us_per_request") or 1.0
    table_rows = []
    for row in rows:
        rps = row["throughput"].get("requests_per_s", 0.0)
        cpu = row["throughput"].get("worker_cpu_us_per_request") or 1.0
        over = row["overhead_1conn"].get("overhead_ms", {})
        errors = row["throughput"].get("non_2xx", 0) + row["throughput"].get("socket_errors", 0)
        table_rows.append((row["variant"], f"{rps:,.0f}", f"{cpu:.0f}", f"{1e6 / cpu:,.0f}", f"{core_cpu / cpu:.1%}",
                           f"{over.get('p50', 0):.3f}", f"{over.get('p99', 0):.3f}", str(errors)))
    table = markdown_table(("variant (1 worker core)", "req/s", "worker CPU µs/req", "req/s per worker core",
                            "vs core", "overhead p50 ms", "overhead p99 ms", "errors"), table_rows)
    stamp = timestamp()
    write_json(os.path.join(REPORTS_DIR, f"bench-features-{stamp}.json"), rows)
    write_text(os.path.join(REPORTS_DIR, f"bench-features-{stamp}.md"), table + "\n")
    print(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_features", description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=int, default=8)
    parser.add_argument("--connections", type=int, default=32)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
