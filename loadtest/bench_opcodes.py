"""Opcodes per request of bench_features' variants: a deterministic stand-in for their CPU cost.

    python -m loadtest.bench_opcodes [--variants 0,7] [--warm 2500] [--requests 1500] [--idle 4] [--top 40]

Each selected variant of loadtest/bench_features.py (same configs, mocks and wrk script) runs as a gateway
of one worker whose process counts the CPython opcodes it executes per function (loadtest/opcount.py,
installed by loadtest/opcount_site/ on PYTHONPATH, for this gateway only), under wrk: after ``--warm``
requests (the warm-up: each of the script's 1,000 sessions bound and seen again, blocks held), over the next
``--requests`` (requests = calls of ``Outcomes.close``), less what the worker runs in as long without load
(timers: ``--idle`` seconds measure it). Tracing makes the worker about 20x slower, so 4 connections suffice.

Reported: opcodes per request of each variant and "vs core" = core's / the variant's (what the wall-clock
bench's CPU ratio would read if every opcode cost the same, and nothing else did: it does not. On
2026-12-02 the production variant read 86.9 % here and 86-87 % in bench_features; 320 opcodes fewer per
request then read 89.7 % here and moved bench_features by about one point, not three: most of what
production adds is not Python opcodes), and for each non-core variant the functions that add the most
over the core. The same run gives the same figures on any machine, so a change of a few opcodes per request
is visible where the wall-clock bench spreads by +-1.5 %. Blind to C work (h11's regexes, msgspec,
syscalls): it ranks Python-level changes; the wall-clock bench remains the measure.

Writes loadtest/reports/bench-opcodes-<time>.{json,md}.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from loadtest.bench_features import (
    CORE,
    VARIANT_NAMES,
    derived_config,
    gateway_url,
    select_variants,
    wrk_script_for,
)
from loadtest.opcount import difference, per_request
from loadtest.report import invocation, run_bench, write_report
from loadtest.topology import (
    BENCH_CONFIG,
    GatewayProcess,
    Topology,
    child_setup,
    pin_self,
    raise_fd_limit,
    split_cores,
    start_mocks,
    stop_all,
)

HERE = os.path.dirname(os.path.abspath(__file__))
SITE_DIR = os.path.join(HERE, "opcount_site")
WRK_CONNECTIONS = 4
WINDOW_TIMEOUT_S = 600.0  # the warm-up and the window, traced (about 100 requests a second)


def measure(index: int, work_dir: str, args: argparse.Namespace, gateway_cpus: set[int] | None,
            load_cpus: set[int] | None) -> tuple[int, dict[str, float]]:
    """(requests, opcodes per request of each function) of variant ``index``'s worker."""
    out = os.path.join(work_dir, f"opcodes-{index}")
    env = {"GRIDGATE_OPCOUNT": out, "GRIDGATE_OPCOUNT_WARM": str(args.warm),
           "GRIDGATE_OPCOUNT_REQUESTS": str(args.requests), "GRIDGATE_OPCOUNT_IDLE": str(args.idle),
           "PYTHONPATH": os.pathsep.join(filter(None, (SITE_DIR, os.environ.get("PYTHONPATH"))))}
    config_path = derived_config(index, work_dir)
    gateway = GatewayProcess(Topology.from_config(config_path), 1, gateway_cpus,
                             log_name=f"gateway-opcodes-{index}.log", env=env)
    try:
        gateway.wait_ready(timeout=60.0)
        script = wrk_script_for(gateway, config_path)
        wrk = subprocess.Popen(["wrk", "-t1", f"-c{WRK_CONNECTIONS}", f"-d{int(WINDOW_TIMEOUT_S)}s", "-s", script,
                                gateway_url(gateway)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               preexec_fn=child_setup(load_cpus))
        try:
            wait_for(out + ".*.loaded", WINDOW_TIMEOUT_S, gateway)
        finally:
            wrk.terminate()
            wrk.wait()
        found = wait_for(out + ".*.json", args.idle + 30.0, gateway)
    finally:
        gateway.stop()
    with open(found) as file:
        snapshot = json.load(file)
    try:
        return per_request(snapshot)
    except ValueError as exc:
        raise RuntimeError(f"variant {index}: {exc}") from None


def wait_for(pattern: str, timeout_s: float, gateway: GatewayProcess) -> str:
    """The first file matching ``pattern`` (the worker writes it), waiting up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = glob.glob(pattern)
        if found:
            return found[0]
        if gateway.process.poll() is not None:
            break
        time.sleep(0.2)
    raise RuntimeError(f"the worker wrote no {os.path.basename(pattern)} within {timeout_s:.0f} s; see {gateway.log_path}")


def render(results: dict[int, tuple[int, dict[str, float]]], top: int) -> str:
    core = sum(results[CORE][1].values())
    lines = ["| variant | requests counted | opcodes/request | vs core |", "|---|---|---|---|"]
    for index, (requests, functions) in results.items():
        total = sum(functions.values())
        lines.append(f"| {index}. {VARIANT_NAMES[index]} | {requests:,} | {total:,.0f} | {core / total * 100:.1f}% |")
    for index, (_, functions) in results.items():
        if index == CORE:
            continue
        lines += ["", f"What variant {index} adds over the core (opcodes per request):", "",
                  "| function | core | variant | added |", "|---|---|---|---|"]
        lines += [f"| {name} | {base:.1f} | {other:.1f} | {added:+.1f} |"
                  for name, base, other, added in difference(results[CORE][1], functions, top)]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    gateway_cpus, load_cpus = split_cores()
    raise_fd_limit()
    pin_self(load_cpus)
    work_dir = tempfile.mkdtemp(prefix="gridgate-opcodes-")
    results: dict[int, tuple[int, dict[str, float]]] = {}
    mocks = start_mocks(Topology.from_config(BENCH_CONFIG), load_cpus, tokens=16, models="demo-model")
    try:
        for index in args.variants:
            print(f"bench_opcodes: variant {index} ({VARIANT_NAMES[index]})", file=sys.stderr, flush=True)
            results[index] = measure(index, work_dir, args, gateway_cpus, load_cpus)
    finally:
        stop_all(mocks)
    command = invocation("loadtest.bench_opcodes")
    raw: dict[str, Any] = {"args": {"warm": args.warm, "requests": args.requests, "idle": args.idle},
                           "variants": {str(index): {"name": VARIANT_NAMES[index], "requests": requests,
                                                     "opcodes_per_request": functions}
                                        for index, (requests, functions) in results.items()}}
    write_report("bench-opcodes", raw, "Opcodes per request of each variant", command, render(results, args.top))
    return 0


def main(argv: list[str] | None = None) -> int:
    listing = "; ".join(f"{index} = {name}" for index, name in enumerate(VARIANT_NAMES))
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_opcodes", description=__doc__.split("\n")[0])
    parser.add_argument("--variants", metavar="LIST", default="0,7",
                        help=f"comma-separated indexes or name substrings ({CORE} always runs): {listing}".replace("%", "%%"))
    parser.add_argument("--warm", type=int, default=2500, help="requests before counting (the warm-up)")
    parser.add_argument("--requests", type=int, default=1500, help="requests counted")
    parser.add_argument("--idle", type=float, default=4.0, help="seconds without load, for the timers' share")
    parser.add_argument("--top", type=int, default=40, help="functions listed per variant")
    args = parser.parse_args(argv)
    if args.warm < 0 or args.requests < 1 or args.idle <= 0 or args.top < 1:
        parser.error("--warm must be >= 0, --requests and --top >= 1, --idle > 0")
    try:
        args.variants = select_variants(args.variants)
    except ValueError as exc:
        parser.error(f"--variants: {exc}; the variants are {listing}")
    return run_bench("bench_opcodes", run, args)


if __name__ == "__main__":
    sys.exit(main())
