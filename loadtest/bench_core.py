"""wrk benchmark of the data plane: one gateway worker on one core, everything else on another.

    .venv/bin/python -m loadtest.bench_core [--duration 10] [--only wrk|streams]
        [--streams 10000] [--probe-at 1000] [--gateway-core 0 --load-core 1]

Topology: one mock provider per endpoint of loadtest/configs/bench.yaml (pinned to the load core),
the gateway with `--workers 1` (pinned to the gateway core), wrk and this script on the load core.
Measures:
  a. proxied non-streaming req/s of the single worker   (wrk -t1 -c32, chat completion, demo-model)
  b. the same load sent straight to one mock              (what the far end can do alone)
  c. gateway overhead p50/p99 at one connection           (x-gridgate-overhead-ms via a wrk Lua hook)
  d. worker RSS idle and after the load                   (/proc)
  e. 10,000 concurrent slow SSE streams on the worker, and the first-token overhead at 1,000
     (loadtest/bench_streams.py: errors, worker RSS, upstream in flight)
Prints a markdown table and writes loadtest/reports/bench-core-<time>.{json,md}.
Without wrk on PATH, (a)-(d) are skipped with a note; (e) needs no wrk.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from typing import Any

from loadtest import bench_streams
from loadtest.mock_provider import child_setup
from loadtest.report import (
    core_busy_percent,
    cpu_times,
    invocation,
    markdown_table,
    run_bench,
    write_report,
)
from loadtest.topology import (
    BENCH_CONFIG,
    CHAT_PATH,
    ROOT,
    GatewayProcess,
    Topology,
    add_core_arguments,
    pin_self,
    raise_fd_limit,
    split_cores,
    start_mocks,
    stop_all,
)

WRK_CHAT = os.path.join(ROOT, "loadtest", "configs", "wrk_chat.lua")
WRK_OVERHEAD = os.path.join(ROOT, "loadtest", "configs", "wrk_features.lua")


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


def run_wrk(url: str, script: str, connections: int, duration_s: int, cpus: set[int] | None,
            threads: int = 1) -> dict[str, Any]:
    cmd = ["wrk", f"-t{threads}", f"-c{connections}", f"-d{duration_s}s", "--latency", "-s", script, url]
    done = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=child_setup(cpus),
                          timeout=duration_s + 30, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stderr.strip()}")
    result = parse_wrk(done.stdout)
    result["command"] = " ".join(cmd)
    return result


# --------------------------------------------------------------------------------------------------
# The run


def render_wrk(results: dict[str, Any]) -> list[tuple[str, str, str]]:
    gw, direct, one = results["proxied"], results["direct"], results["overhead_1conn"]
    overhead = one.get("overhead_ms", {})
    rss = results["rss"]
    idle = ", ".join(f"{kib / 1024:.1f}" for kib in rss["idle"]["workers_kib"].values()) or "?"
    loaded = ", ".join(f"{kib / 1024:.1f}" for kib in rss["after_load"]["workers_kib"].values()) or "?"
    return [
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
    ]


def run_wrk_part(args: argparse.Namespace, results: dict[str, Any], gateway_cpus: set[int] | None,
                 load_cpus: set[int] | None) -> None:
    """(a)-(d): throughput, direct baseline, overhead at one connection, RSS."""
    topology = Topology.from_config(args.config)
    host, port = topology.listen
    url = f"http://{host}:{port}{CHAT_PATH}"
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
    finally:
        if gateway is not None:
            results["gateway_exit_code"] = gateway.stop()
        stop_all(mocks)


def run(args: argparse.Namespace) -> int:
    gateway_cpus, load_cpus = split_cores(args.gateway_core, args.load_core)
    raise_fd_limit(bench_streams.wanted_fd_limit(args.streams))
    pin_self(load_cpus)
    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": args.config,
                               "gateway_cpus": sorted(gateway_cpus or []), "load_cpus": sorted(load_cpus or []),
                               "duration_s": args.duration}
    rows: list[tuple[str, str, str]] = []
    if args.only in (None, "wrk"):
        if shutil.which("wrk") is None:
            print("bench_core: wrk not found on PATH; skipping (a)-(d) (apt-get install -y wrk)", file=sys.stderr)
        else:
            run_wrk_part(args, results, gateway_cpus, load_cpus)
            rows += render_wrk(results)
    if args.only in (None, "streams"):
        print(f"bench_core: (e) {args.streams:,} concurrent slow streams", file=sys.stderr)
        results["streams"] = bench_streams.run_streams(args, gateway_cpus, load_cpus)
        rows += [(f"e. {name}", value, detail) for name, value, detail in bench_streams.render_rows(results["streams"])]
    if not rows:
        return 0
    table = markdown_table(("measure", "result", "detail"), rows)
    write_report("bench-core", results, f"gridgate data-plane benchmark ({results['started']})",
                 invocation("loadtest.bench_core"), table + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_core", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=BENCH_CONFIG)
    parser.add_argument("--only", choices=("wrk", "streams"), default=None, help="run only (a)-(d) or only (e)")
    parser.add_argument("--duration", type=int, default=10, help="seconds per throughput run")
    parser.add_argument("--connections", type=int, default=32)
    bench_streams.add_arguments(parser)
    add_core_arguments(parser)
    args = parser.parse_args(argv)
    return run_bench("bench_core", run, args)


if __name__ == "__main__":
    sys.exit(main())
