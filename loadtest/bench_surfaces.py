"""What a Responses or Messages request costs a worker against a chat completion (issue 25, item 6).

    python -m loadtest.bench_surfaces [--rounds 4] [--duration 6] [--connections 32] [--no-stream]

One gateway worker pinned to core 0; wrk, the mock providers (loadtest/mock_provider.py, which answer
all three APIs, streams without pacing) and the embedded Valkey on core 1. The gateway is set up as in
production: auth, a token quota with the default worker-held leases, the access log to a file (a
variant of loadtest/configs/bench.yaml on free ports). It runs once for the whole bench; each round
runs every surface (chat, Responses, Messages; plain JSON and streamed) for a warm-up and a measured wrk
run, in order in odd rounds and reversed in even ones. Reported per surface: the worker's CPU µs per
request (utime + stime over the measured run / requests wrk completed) and its ratio to chat of the
same mode (plain or streamed) within the same round: the machine is shared, so only ratios taken
within a round mean much. Medians over rounds, with the ratios' min..max.

Prints a markdown table and writes loadtest/reports/bench-surfaces-<time>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from loadtest.bench_core import run_wrk
from loadtest.bench_features import BENCH_KEY, _access_log, _quota, cpu_s, pin_valkey, round_order
from loadtest.report import markdown_table, run_bench, write_report
from loadtest.topology import (
    BENCH_CONFIG,
    GatewayProcess,
    Topology,
    move_to_free_ports,
    pin_self,
    raise_fd_limit,
    split_cores,
    start_mocks,
    stop_all,
    write_derived_config,
)

WARM_UP_S = 2
MODEL = "demo-model"
PROMPT = "Say hello in five words."
ANTHROPIC_VERSION = "2023-06-01"


@dataclass(frozen=True)
class Surface:
    name: str
    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    reference: str  # the chat surface of the same mode: the ratio's denominator


def surfaces(streamed: bool) -> list[Surface]:
    bearer = {"Content-Type": "application/json", "Authorization": f"Bearer {BENCH_KEY}"}
    anthropic = {"Content-Type": "application/json", "x-api-key": BENCH_KEY, "anthropic-version": ANTHROPIC_VERSION}
    messages = [{"role": "user", "content": PROMPT}]
    modes = [False, True] if streamed else [False]
    listed = []
    for stream in modes:
        suffix = ", streamed" if stream else ""
        extra = {"stream": True} if stream else {}
        chat = f"chat{suffix}"
        listed += [
            Surface(chat, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 16, **extra},
                    bearer, chat),
            Surface(f"responses{suffix}", "/v1/responses",
                    {"model": MODEL, "input": PROMPT, "max_output_tokens": 16, **extra}, bearer, chat),
            Surface(f"messages{suffix}", "/v1/messages",
                    {"model": MODEL, "messages": messages, "max_tokens": 16, **extra}, anthropic, chat),
        ]
    return listed


def wrk_script(surface: Surface, work_dir: str) -> str:
    """A wrk Lua script sending `surface`'s request; its path."""
    lua = (f"wrk.method = \"POST\"\nwrk.path = {json.dumps(surface.path)}\n"
           f"wrk.body = {json.dumps(json.dumps(surface.body, separators=(',', ':')))}\n"
           + "".join(f"wrk.headers[{json.dumps(k)}] = {json.dumps(v)}\n" for k, v in surface.headers.items()))
    path = os.path.join(work_dir, f"wrk-{surface.name.replace(', ', '-')}.lua")
    with open(path, "w") as out:
        out.write(lua)
    return path


def production_config(work_dir: str) -> str:
    def change(config: dict[str, Any]) -> None:
        move_to_free_ports(config)
        _quota(config, work_dir)
        _access_log(config, work_dir)
    return write_derived_config(BENCH_CONFIG, work_dir, "surfaces", change)


def measure(gateway: GatewayProcess, script: str, args: argparse.Namespace, load_cpus: set[int] | None) -> dict[str, Any]:
    host, port = gateway.topology.listen
    url = f"http://{host}:{port}"
    run_wrk(url, script, args.connections, WARM_UP_S, load_cpus)
    workers = gateway.worker_pids()
    before = cpu_s(workers)
    run = run_wrk(url, script, args.connections, args.duration, load_cpus)
    used = cpu_s(workers) - before
    if not run.get("requests") or run.get("non_2xx") or run.get("socket_errors"):
        raise RuntimeError(f"{script}: requests {run.get('requests')}, non-2xx {run.get('non_2xx')}, "
                           f"socket errors {run.get('socket_errors')}; see {gateway.log_path}")
    run["worker_cpu_us_per_request"] = used / run["requests"] * 1e6
    return run


def summarize(listed: list[Surface], runs: dict[str, list[dict[str, Any]]]) -> list[list[Any]]:
    rows = []
    for surface in listed:
        cpu = [run["worker_cpu_us_per_request"] for run in runs[surface.name]]
        ref = [run["worker_cpu_us_per_request"] for run in runs[surface.reference]]
        ratios = [own / base for own, base in zip(cpu, ref, strict=True)]
        rows.append([surface.name, f"{statistics.median(cpu):.1f}",
                     f"{statistics.median(run['requests_per_s'] for run in runs[surface.name]):,.0f}",
                     f"{statistics.median(ratios):.3f}", f"{min(ratios):.3f}..{max(ratios):.3f}",
                     " ".join(f"{r:.3f}" for r in ratios)])
    return rows


def run(args: argparse.Namespace) -> int:
    if shutil.which("wrk") is None:
        print("bench_surfaces: wrk not found on PATH; skipping (apt-get install -y wrk)")
        return 0
    gateway_cpus, load_cpus = split_cores()
    raise_fd_limit()
    pin_self(load_cpus)
    listed = surfaces(args.stream)
    runs: dict[str, list[dict[str, Any]]] = {surface.name: [] for surface in listed}
    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rounds": args.rounds,
                               "duration_s": args.duration, "warm_up_s": WARM_UP_S,
                               "connections": args.connections, "gateway_cpus": sorted(gateway_cpus or []),
                               "load_cpus": sorted(load_cpus or []), "runs": runs}
    work_dir = tempfile.mkdtemp(prefix="gridgate-bench-surfaces-")
    try:
        config = production_config(work_dir)
        topology = Topology.from_config(config)
        scripts = {surface.name: wrk_script(surface, work_dir) for surface in listed}
        mocks = start_mocks(topology, load_cpus, tokens=16, models=MODEL)
        gateway = GatewayProcess(topology, 1, gateway_cpus, log_name="gateway-bench-surfaces.log")
        try:
            gateway.wait_ready()
            pin_valkey(gateway.process.pid, load_cpus)
            time.sleep(1.0)
            for round_number in range(1, args.rounds + 1):
                for surface in round_order(round_number, listed):
                    print(f"bench_surfaces: round {round_number}/{args.rounds}: {surface.name}", file=sys.stderr)
                    runs[surface.name].append(measure(gateway, scripts[surface.name], args, load_cpus))
        finally:
            results["gateway_exit_code"] = gateway.stop()
            stop_all(mocks)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    headers = ["surface", "worker CPU µs/request (median)", "req/s (median)", "vs chat, same round (median)",
               "vs chat min..max", "vs chat per round"]
    text = markdown_table(headers, summarize(listed, runs))
    command = (f"python -m loadtest.bench_surfaces --rounds {args.rounds} --duration {args.duration} "
               f"--connections {args.connections}" + ("" if args.stream else " --no-stream"))
    write_report("bench-surfaces", results, f"What each API surface costs a worker ({results['started']})",
                 command, text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_surfaces", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4, help="interleaved repetitions; medians are reported")
    parser.add_argument("--duration", type=int, default=6, help="seconds per measured wrk run")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--no-stream", dest="stream", action="store_false", help="plain JSON requests only")
    args = parser.parse_args(argv)
    if min(args.rounds, args.duration, args.connections) < 1:
        parser.error("--rounds, --duration and --connections must be at least 1")
    return run_bench("bench_surfaces", run, args)


if __name__ == "__main__":
    sys.exit(main())
