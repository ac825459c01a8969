"""How req/s scale with gateway workers: 1, 2, 4 ... N workers against wrk and the mock upstream.

    python -m loadtest.bench_scale [--workers 1,2,4] [--rounds 3] [--duration 8] [--connections 32]
        [--variants routing,quota]

N is this process's cores (at most 16). Every window starts a gateway of W workers (a variant of
loadtest/configs/bench.yaml), waits until it is ready, warms it up 2 s and runs wrk for ``--duration``
seconds with ``--connections`` connections per worker; variants and worker counts alternate between
rounds (``round_order``). Two variants, both with session affinity on and wrk sending 1,000 session ids:
``routing`` (auth, quota and the access log off) and ``quota`` (+ auth and a token quota with the
default worker-held blocks, the embedded Valkey), so admissions happen.

Cores (``plan_cores``), per window: with W + 2 cores or more, the gateway gets W cores of its own (the
first W), wrk half of the rest (one thread per core) and the mocks and Valkey the other half; with fewer,
nothing is pinned and everything shares every core. The report's "cores" column says which (on 2 cores
every window shares; on 16, 1-8 workers get their own and 16 share).

Reported per variant and W (medians over rounds): req/s in total and per worker, efficiency (req/s per
worker / the 1-worker figure of the same variant), the worker cores the workers kept busy (their CPU
per request x req/s) and the CPU efficiency (1 worker's CPU per request / W workers': the scaling a
machine with a core per worker and per load process would show), and the contention the gateway's own /metrics show
between a reading before and one after the window: requests the shared-memory counters counted per
second (and their ratio to what wrk completed), session-affinity bindings made and reused per second,
and admission calls to Valkey per second and per 1,000 requests (requests decided in Valkey plus
blocks granted). Writes loadtest/reports/bench-scale-<time>.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from loadtest.bench_core import run_wrk
from loadtest.bench_features import (
    WARM_UP_S,
    WRK_FEATURES,
    _affinity,
    _core,
    _quota,
    cpu_s,
    pin_valkey,
    round_order,
)
from loadtest.report import core_busy_percent, cpu_times, markdown_table, run_bench, write_report
from loadtest.topology import (
    BENCH_CONFIG,
    CHAT_PATH,
    GatewayProcess,
    Topology,
    http_get,
    raise_fd_limit,
    start_mocks,
    stop_all,
    write_derived_config,
)

MAX_WORKERS = 16
Feature = Callable[[dict[str, Any], str], None]
VARIANTS: dict[str, tuple[Feature, ...]] = {
    "routing": (_core, _affinity),
    "quota": (_core, _affinity, _quota),
}


# --------------------------------------------------------------------------------------------------
# Pure: worker counts, cores, metric deltas, efficiency


def default_workers(cores: int, cap: int = MAX_WORKERS) -> list[int]:
    """1, 2, 4 ... up to ``min(cores, cap)``, and that count itself when it is not a power of two."""
    top = max(1, min(cores, cap))
    counts, n = [], 1
    while n <= top:
        counts.append(n)
        n *= 2
    if counts[-1] != top:
        counts.append(top)
    return counts


def parse_workers(spec: str) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4] (sorted, once each); ValueError for anything but counts >= 1."""
    counts = sorted({int(part) for part in spec.split(",") if part.strip()})
    if not counts or counts[0] < 1:
        raise ValueError(f"worker counts must be integers >= 1: {spec!r}")
    return counts


def plan_cores(cores: Sequence[int], workers: int) -> dict[str, Any]:
    """Where a window of ``workers`` workers runs: {"gateway", "load", "upstream"} (sorted core lists, or
    None: not pinned) and "shared". Own cores when there are ``workers`` + 2 or more: the gateway the first
    ``workers``, wrk half of the rest (at least one), the mocks and Valkey the others; else all share all."""
    cores = sorted(cores)
    if len(cores) < workers + 2:
        return {"gateway": None, "load": None, "upstream": None, "shared": True}
    rest = cores[workers:]
    load = rest[:max(1, len(rest) // 2)]
    return {"gateway": cores[:workers], "load": load, "upstream": rest[len(load):], "shared": False}


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name with its labels sorted, e.g. ``gridgate_affinity_total{outcome="new"}``: value}."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{key}="{value}"' for key, value in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def metric_sum(samples: Mapping[str, float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    total = 0.0
    for sample, value in samples.items():
        base, _, rest = sample.partition("{")
        if base == name and all(label in rest.rstrip("}").split(",") for label in wanted):
            total += value
    return total


def window_contention(before: Mapping[str, float], after: Mapping[str, float], seconds: float,
                      wrk_requests: int) -> dict[str, float]:
    """What the gateway's counters saw over a window of ``seconds``: per second, the requests the shared
    counters counted (and their share of wrk's), affinity bindings made and reused, and admission calls to
    Valkey (requests decided there, admitted or refused, plus blocks granted; also per 1,000 requests)."""
    def delta(name: str, **labels: str) -> float:
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    seconds = max(seconds, 1e-9)
    counted = delta("gridgate_requests_total")
    decided = delta("gridgate_quota_decisions_total", reason="admitted") + delta(
        "gridgate_quota_decisions_total", reason="denied")
    valkey_calls = decided - delta("gridgate_quota_leases_total", event="admitted") + delta(
        "gridgate_quota_leases_total", event="granted")
    return {
        "counted_per_s": counted / seconds,
        "counted_vs_wrk": counted / wrk_requests if wrk_requests else 0.0,
        "affinity_new_per_s": delta("gridgate_affinity_total", outcome="new") / seconds,
        "affinity_reused_per_s": delta("gridgate_affinity_total", outcome="reused") / seconds,
        "affinity_failover_per_s": delta("gridgate_affinity_total", outcome="failover") / seconds,
        "quota_decided_per_s": decided / seconds,
        "valkey_admission_calls_per_s": valkey_calls / seconds,
        "valkey_calls_per_1k_requests": 1000.0 * valkey_calls / counted if counted else 0.0,
        "quota_backend_errors": delta("gridgate_quota_backend_errors_total"),
    }


def scaling_rows(req_per_s: Mapping[int, float],
                 cpu_us_per_request: Mapping[int, float] | None = None) -> list[dict[str, float | None]]:
    """Per worker count (ascending): req/s total, per worker, and efficiency = per worker / 1 worker's
    (None without a 1-worker figure). With the workers' CPU µs per request: the worker cores they kept
    busy (CPU per request x req/s) and the CPU efficiency = 1 worker's CPU per request / theirs, what
    scaling would be if each worker had a core of its own."""
    base = req_per_s.get(1)
    cpu = cpu_us_per_request or {}
    rows: list[dict[str, float | None]] = []
    for workers in sorted(req_per_s):
        per_worker = req_per_s[workers] / workers
        row: dict[str, float | None] = {"workers": workers, "total": req_per_s[workers], "per_worker": per_worker,
                                        "efficiency": per_worker / base if base else None}
        if workers in cpu:
            row["worker_cores"] = cpu[workers] * req_per_s[workers] / 1e6
            row["cpu_efficiency"] = cpu[1] / cpu[workers] if cpu.get(1) and cpu[workers] else None
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------------
# Measuring


def log(message: str) -> None:
    print(f"bench_scale: {message}", file=sys.stderr)


def read_metrics(gateway: GatewayProcess) -> dict[str, float]:
    status, body = http_get(gateway.topology.admin, "/metrics", timeout=5)
    if status != 200:
        raise RuntimeError(f"/metrics on {gateway.topology.admin} answered {status}; see {gateway.log_path}")
    return parse_metrics(body.decode())


def measure_window(config_path: str, workers: int, layout: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Start a gateway of ``workers`` workers, warm it up, and measure one wrk window with the metrics read
    before and after it."""
    gateway_cpus, load_cpus = layout["gateway"] and set(layout["gateway"]), layout["load"] and set(layout["load"])
    threads = len(load_cpus) if load_cpus else 1
    connections = max(args.connections * workers, threads)
    gateway = GatewayProcess(Topology.from_config(config_path), workers, gateway_cpus,
                             log_name=f"gateway-bench-scale-{workers}.log")
    try:
        gateway.wait_ready()
        pin_valkey(gateway.process.pid, layout["upstream"] and set(layout["upstream"]))
        time.sleep(1.0)
        host, port = gateway.topology.listen
        url = f"http://{host}:{port}{CHAT_PATH}"
        run_wrk(url, WRK_FEATURES, connections, WARM_UP_S, load_cpus, threads)
        pids = gateway.worker_pids()
        cpu_before, busy_before, metrics_before = cpu_s(pids), cpu_times(), read_metrics(gateway)
        started = time.monotonic()
        run = run_wrk(url, WRK_FEATURES, connections, args.duration, load_cpus, threads)
        seconds = time.monotonic() - started
        metrics_after = read_metrics(gateway)
        run["core_busy_percent"] = core_busy_percent(busy_before, cpu_times())
        run["worker_cpu_s"] = {str(pid): round(cpu_s([pid]), 3) for pid in pids}
        if not run.get("requests"):
            raise RuntimeError(f"no request completed ({run['command']}); see {gateway.log_path}")
        run["worker_cpu_us_per_request"] = (cpu_s(pids) - cpu_before) / run["requests"] * 1e6
        run["workers_seen"] = len(pids)
        run["contention"] = window_contention(metrics_before, metrics_after, seconds, run["requests"])
        return run
    finally:
        gateway.stop()


# --------------------------------------------------------------------------------------------------
# The report


def summarize(runs: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Medians over a (variant, workers) cell's rounds."""
    fields = ("valkey_admission_calls_per_s", "valkey_calls_per_1k_requests", "counted_vs_wrk",
              "affinity_new_per_s", "affinity_reused_per_s")
    summary = {"requests_per_s": statistics.median(run["requests_per_s"] for run in runs),
               "worker_cpu_us_per_request": statistics.median(run["worker_cpu_us_per_request"] for run in runs),
               "errors": sum(run.get("non_2xx", 0) + run.get("socket_errors", 0) for run in runs)}
    summary |= {name: statistics.median(run["contention"][name] for run in runs) for name in fields}
    return summary


def render(results: Mapping[str, Any]) -> str:
    headers = ("variant", "workers", "req/s total", "req/s per worker", "efficiency vs 1", "req/s per round",
               "worker CPU µs/req", "worker cores busy", "CPU efficiency vs 1", "shm counted / wrk", "affinity new / reused per s",
               "Valkey admission calls/s (per 1k req)", "errors")
    rows = []
    for variant, cells in results["variants"].items():
        medians = {int(workers): cell["summary"]["requests_per_s"] for workers, cell in cells.items()}
        cpu = {int(workers): cell["summary"]["worker_cpu_us_per_request"] for workers, cell in cells.items()}
        for row in scaling_rows(medians, cpu):
            cell = cells[str(row["workers"])]
            summary = cell["summary"]
            efficiency = "-" if row["efficiency"] is None else f"{row['efficiency']:.2f}"
            rows.append((variant, row["workers"], f"{row['total']:,.0f}", f"{row['per_worker']:,.0f}", efficiency,
                         " ".join(f"{run['requests_per_s']:,.0f}" for run in cell["runs"]),
                         f"{summary['worker_cpu_us_per_request']:.0f}", f"{row['worker_cores']:.2f}",
                         "-" if row["cpu_efficiency"] is None else f"{row['cpu_efficiency']:.2f}",
                         f"{summary['counted_vs_wrk']:.3f}",
                         f"{summary['affinity_new_per_s']:,.1f} / {summary['affinity_reused_per_s']:,.0f}",
                         f"{summary['valkey_admission_calls_per_s']:,.1f} ({summary['valkey_calls_per_1k_requests']:.2f})",
                         summary["errors"]))
    layouts = results["layouts"]
    where = "; ".join(
        f"{workers} worker(s): " + ("shared, nothing pinned (fewer than W + 2 cores)" if layout["shared"] else
                                    f"gateway {layout['gateway']}, wrk {layout['load']}, mocks and Valkey {layout['upstream']}")
        for workers, layout in layouts.items())
    return (f"Cores ({results['cores']}): {where}. wrk: {results['connections_per_worker']} connections per worker, "
            f"{results['duration_s']} s windows, {results['rounds']} rounds (medians).\n\n"
            + markdown_table(headers, rows) + "\n")


# --------------------------------------------------------------------------------------------------
# The run


def run(args: argparse.Namespace) -> int:
    if shutil.which("wrk") is None:
        print("bench_scale: wrk not found on PATH; skipping (apt-get install -y wrk)")
        return 0
    cores = sorted(os.sched_getaffinity(0))
    raise_fd_limit()
    layouts = {workers: plan_cores(cores, workers) for workers in args.workers}
    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cores": len(cores),
                               "workers": args.workers, "rounds": args.rounds, "duration_s": args.duration,
                               "warm_up_s": WARM_UP_S, "connections_per_worker": args.connections,
                               "layouts": {str(workers): layout for workers, layout in layouts.items()},
                               "variants": {}}
    shared = [workers for workers, layout in layouts.items() if layout["shared"]]
    if shared:
        log(f"{len(cores)} cores: with {', '.join(map(str, shared))} worker(s), wrk, the upstream, Valkey and the "
            "workers share them (nothing pinned)")
    work_dir = tempfile.mkdtemp(prefix="gridgate-bench-scale-")
    cells = [(variant, workers) for variant in args.variants for workers in args.workers]
    try:
        configs = {}
        for variant in args.variants:
            def change(config: dict[str, Any], features: tuple[Feature, ...] = VARIANTS[variant]) -> None:
                for feature in features:
                    feature(config, work_dir)
            configs[variant] = write_derived_config(BENCH_CONFIG, work_dir, f"scale-{variant}", change)
        # The mocks live through every window: on the upstream cores of the largest count that has its own
        # (the last cores; a smaller count's upstream cores include them, and its wrk cores never do).
        upstream = next((layout["upstream"] for _, layout in sorted(layouts.items(), reverse=True)
                         if not layout["shared"]), None)
        mocks = start_mocks(Topology.from_config(BENCH_CONFIG), upstream and set(upstream),
                            tokens=16, models="demo-model", processes=len(upstream) if upstream else 1)
        try:
            for round_number in range(1, args.rounds + 1):
                for variant, workers in round_order(round_number, cells):
                    log(f"round {round_number}/{args.rounds}: {variant}, {workers} worker(s)")
                    layout = layouts[workers]
                    measured = measure_window(configs[variant], workers, layout, args)
                    cell = results["variants"].setdefault(variant, {}).setdefault(str(workers), {"runs": []})
                    cell["runs"].append({"round": round_number, "layout": layout, **measured})
        finally:
            stop_all(mocks)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    for variant_cells in results["variants"].values():
        for cell in variant_cells.values():
            cell["summary"] = summarize(cell["runs"])
    command = (f"python -m loadtest.bench_scale --workers {','.join(map(str, args.workers))} --rounds {args.rounds} "
               f"--duration {args.duration} --connections {args.connections} --variants {','.join(args.variants)}")
    write_report("bench-scale", results, f"How req/s scale with gateway workers ({results['started']})",
                 command, render(results))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_scale", description=__doc__.split("\n")[0])
    cores = len(os.sched_getaffinity(0))
    parser.add_argument("--workers", default=",".join(map(str, default_workers(cores))),
                        help=f"comma-separated worker counts (default: 1, 2, 4 ... this machine's {cores} cores, "
                             f"at most {MAX_WORKERS})")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repetitions; medians are reported")
    parser.add_argument("--duration", type=int, default=8, help="seconds per measured wrk run")
    parser.add_argument("--connections", type=int, default=32, help="wrk connections per gateway worker")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    args = parser.parse_args(argv)
    if min(args.rounds, args.duration, args.connections) < 1:
        parser.error("--rounds, --duration and --connections must be at least 1")
    try:
        args.workers = parse_workers(args.workers)
    except ValueError as exc:
        parser.error(f"--workers: {exc}")
    args.variants = [name.strip() for name in args.variants.split(",") if name.strip()]
    unknown = [name for name in args.variants if name not in VARIANTS]
    if unknown or not args.variants:
        parser.error(f"--variants: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(VARIANTS)}")
    return run_bench("bench_scale", run, args)


if __name__ == "__main__":
    sys.exit(main())
