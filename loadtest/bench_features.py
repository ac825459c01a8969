"""What each feature costs on the request path, measured in one run (ratios, not absolute figures).

    python -m loadtest.bench_features [--rounds 3] [--duration 8] [--connections 32] [--variants 0,4,lease]

One gateway worker pinned to core 0; wrk, the mock providers and the embedded Valkey on core 1. The
same topology is run with the routing core only, then with active health checks and outlier
detection, session affinity, auth + token quota (embedded Valkey), everything together, and everything
with quota leases (`quota.lease`: each worker reserves a block of the budget in Valkey and admits
against it locally; `QUOTA_LEASE` below). For each: proxied req/s (32 connections), the worker's CPU
time per request and the capacity of one worker core that implies (1 / CPU per request), its ratio to
the core run, and the gateway overhead p50/p99 at one connection (``x-gridgate-overhead-ms``: request
bytes in to upstream request written).

The ratio is taken on the worker's CPU per request, not on req/s: with quota on, the load core also
runs Valkey's Lua ledger for every request and saturates first, which says nothing about the gateway.

Rounds: one run of one variant varies by about +-10 % in worker CPU per request on a shared 2-core
machine, too much to tell 80 % from 90 % in one sample. So the variants run interleaved: round 1 runs
each selected variant once in order, round 2 in reverse order, and so on. The mock providers stay up across
rounds; each variant gets its own gateway process in each round (start, 1 s settle, 2 s warm-up, the
measured run, stop). Reported per variant: the median over rounds of CPU µs per request and of req/s,
and "vs core" = the median over rounds of (core's CPU per request in that round / the variant's in
that round), with the min..max of those per-round ratios: a ratio within one round cancels the slow
drift of the machine, and the range shows the spread that is left. The overhead run at one connection
is done in the last round only: it is a latency figure (percentiles over thousands of requests of one
run), not a CPU ratio, and repeating it would add max(3, duration / 2) s per variant and round.

`--variants` runs a subset (comma-separated indexes or case-insensitive name substrings; the core
variant always runs, it is the reference of every ratio). Every variant's config is checked by the
gateway's own config parser before anything starts, so a variant the gateway does not support yet
fails at once, naming the field.

Prints a markdown table and writes loadtest/reports/bench-features-<time>.{json,md}; the JSON holds
every round's raw wrk figures and worker CPU per request.
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

from gateway.auth import hash_api_key
from gateway.config import load_config
from gateway.yaml_config import ConfigError
from loadtest.bench_core import run_wrk
from loadtest.report import (
    REPORTS_DIR,
    child_pids,
    markdown_table,
    process_cpu_s,
    timestamp,
    write_json,
    write_text,
)
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
WARM_UP_S = 2

FAST_HEALTH = {"type": "http", "path": "/health", "interval": "1s", "timeout": "500ms"}
# Worker-held token blocks for the "everything, quota leases" variant (issue 13, target 2).
QUOTA_LEASE = {"tokens": 100_000, "ttl": "1s"}


# --------------------------------------------------------------------------------------------------
# The variants: config changes to loadtest/configs/bench.yaml


Feature = Callable[[dict[str, Any], str], None]  # (config, work directory)


def _health(config: dict[str, Any], _work_dir: str) -> None:
    for cluster in config["clusters"]:
        cluster["health_check"] = dict(FAST_HEALTH)
        cluster["outlier_detection"] = {"consecutive_failures": 5, "base_ejection": "30s"}


def _affinity(config: dict[str, Any], _work_dir: str) -> None:
    config["routing"]["session_affinity"] = {"enabled": True, "header": "X-Session-Id", "ttl": "1h"}


def _quota(config: dict[str, Any], work_dir: str) -> None:
    config["auth"] = {"keys": [{"tenant": "bench", "key": hash_api_key(BENCH_KEY)}]}
    config["quota"] = {
        "backend": {"kind": "embedded", "data_dir": os.path.join(work_dir, "valkey")},
        "rules": [{"name": "bench", "match": {"tenant": "bench"},
                   "budgets": [{"window": "1m", "tokens": 10**12}, {"window": "1d", "tokens": 10**13}]}],
    }


def _lease(config: dict[str, Any], _work_dir: str) -> None:
    config["quota"]["lease"] = dict(QUOTA_LEASE)


CORE = 0  # the reference of every "vs core" ratio
VARIANTS: tuple[tuple[str, tuple[Feature, ...]], ...] = (
    ("core (auth, quota, health off)", ()),
    ("+ health checks + outlier detection", (_health,)),
    ("+ session affinity", (_affinity,)),
    ("+ auth + token quota", (_quota,)),
    ("everything", (_health, _affinity, _quota)),
    ("everything, quota leases", (_health, _affinity, _quota, _lease)),  # needs the quota.lease config key
)
VARIANT_NAMES = tuple(name for name, _ in VARIANTS)


def select_variants(spec: str | None, names: Sequence[str] = VARIANT_NAMES) -> list[int]:
    """The indexes `spec` names, in variant order and always with CORE; all of them for None.

    `spec` is comma-separated indexes or case-insensitive substrings of names ("lease", "4,affinity").
    """
    if spec is None:
        return list(range(len(names)))
    chosen = {CORE}
    for token in (part.strip() for part in spec.split(",")):
        if token.isdigit():
            if int(token) >= len(names):
                raise ValueError(f"no variant {token}: there are {len(names)} (0-{len(names) - 1})")
            chosen.add(int(token))
        elif token:
            matches = {index for index, name in enumerate(names) if token.lower() in name.lower()}
            if not matches:
                raise ValueError(f"no variant name contains {token!r}")
            chosen |= matches
    return sorted(chosen)


def derived_config(index: int, work_dir: str) -> str:
    """Write variant `index`'s config, checked by the gateway's own parser; its path."""
    name, features = VARIANTS[index]

    def change(config: dict[str, Any]) -> None:
        for feature in features:
            feature(config, work_dir)

    path = write_derived_config(BENCH_CONFIG, work_dir, f"variant-{index}", change)
    try:
        load_config(path)
    except ConfigError as exc:
        raise RuntimeError(f"variant {index} ({name}): the gateway refuses its config: {'; '.join(exc.problems)} "
                           "(run the others with --variants)") from None
    return path


# --------------------------------------------------------------------------------------------------
# Measuring


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


def measure_variant(config_path: str, args: argparse.Namespace, gateway_cpus: set[int] | None,
                    load_cpus: set[int] | None, overhead: bool) -> dict[str, Any]:
    """One round of one variant in a gateway of its own: wrk's figures plus the worker CPU µs per request,
    and the overhead run at one connection when `overhead`."""
    topology = Topology.from_config(config_path)
    url = f"http://{topology.listen[0]}:{topology.listen[1]}{CHAT_PATH}"
    gateway = GatewayProcess(topology, 1, gateway_cpus)
    try:
        gateway.wait_ready()
        pin_valkey(gateway.process.pid, load_cpus)
        time.sleep(1.0)
        run_wrk(url, WRK_FEATURES, args.connections, WARM_UP_S, load_cpus)
        workers = gateway.worker_pids()
        cpu_before = sum(process_cpu_s(pid) for pid in workers)
        throughput = run_wrk(url, WRK_FEATURES, args.connections, args.duration, load_cpus)
        cpu_s = sum(process_cpu_s(pid) for pid in workers) - cpu_before
        if not throughput.get("requests"):
            raise RuntimeError(f"no request completed in {args.duration} s ({throughput['command']}); "
                               f"see {gateway.log_path}")
        throughput["worker_cpu_us_per_request"] = cpu_s / throughput["requests"] * 1e6
        run: dict[str, Any] = {"throughput": throughput}
        if overhead:
            run["overhead_1conn"] = run_wrk(url, WRK_FEATURES, 1, max(3, args.duration // 2), load_cpus)
        run["rss_kib"] = gateway.rss()["workers_kib"]
        return run
    finally:
        gateway.stop()


# --------------------------------------------------------------------------------------------------
# Aggregating (pure)


def summarize_rounds(runs: Mapping[str, Sequence[Mapping[str, float]]], reference: str) -> dict[str, dict[str, Any]]:
    """Per variant, from its wrk figures per round (``worker_cpu_us_per_request``, ``requests_per_s``; entry r
    of every variant is round r): the medians over rounds, and "vs reference" taken within each round
    (the reference's CPU per request / the variant's, in the same round), with its median, min and max.
    Per-round ratios cancel the machine's drift between rounds, which a ratio of medians would keep."""
    reference_cpu = [run["worker_cpu_us_per_request"] for run in runs[reference]]
    summaries = {}
    for name, variant_runs in runs.items():
        cpu = [run["worker_cpu_us_per_request"] for run in variant_runs]
        ratios = [ref / own for ref, own in zip(reference_cpu, cpu, strict=True)]
        summaries[name] = {
            "cpu_us_median": statistics.median(cpu),
            "requests_per_s_median": statistics.median(run.get("requests_per_s", 0.0) for run in variant_runs),
            "vs_core_per_round": ratios,
            "vs_core_median": statistics.median(ratios),
            "vs_core_min": min(ratios),
            "vs_core_max": max(ratios),
        }
    return summaries


def errors(runs: Sequence[Mapping[str, Any]]) -> int:
    """Non-2xx responses and socket errors over all rounds."""
    return sum(run["throughput"].get("non_2xx", 0) + run["throughput"].get("socket_errors", 0) for run in runs)


def render(results: dict[str, Any]) -> str:
    """The markdown table (one row per variant) and a warning if any run had errors."""
    rows = []
    for entry in results["variants"]:
        s = entry["summary"]
        over = entry["runs"][-1].get("overhead_1conn", {}).get("overhead_ms", {})
        per_round = ", ".join(f"{run['throughput']['worker_cpu_us_per_request']:.0f}" for run in entry["runs"])
        rows.append((f"{entry['index']}. {entry['variant']}", f"{s['requests_per_s_median']:,.0f}",
                     f"{s['cpu_us_median']:.0f}", f"{1e6 / s['cpu_us_median']:,.0f}", f"{s['vs_core_median']:.1%}",
                     f"{s['vs_core_min']:.1%}..{s['vs_core_max']:.1%}", per_round,
                     f"{over.get('p50', 0):.3f}", f"{over.get('p99', 0):.3f}", str(errors(entry["runs"]))))
    table = markdown_table(("variant (1 worker core)", "req/s, median", "worker CPU µs/req, median",
                            "req/s per worker core", "vs core, median of rounds", "vs core, range",
                            "CPU µs/req per round", "overhead p50 ms (last round)", "overhead p99 ms (last round)",
                            "errors"), rows)
    text = (f"{results['rounds']} interleaved rounds of wrk -t1 -c{results['connections']} for "
            f"{results['duration_s']} s per variant; worker pinned to cores {results['gateway_cpus'] or 'any'}, "
            f"wrk, mocks and Valkey to {results['load_cpus'] or 'any'}.\n\n{table}\n")
    failed = [entry["variant"] for entry in results["variants"] if errors(entry["runs"])]
    if failed:
        text += (f"\n**Errors in: {', '.join(failed)}.** Their CPU per request includes failed requests and is not "
                 "comparable.\n")
    return text


# --------------------------------------------------------------------------------------------------
# The run


def run(args: argparse.Namespace) -> int:
    if shutil.which("wrk") is None:
        print("bench_features: wrk not found on PATH; skipping (apt-get install -y wrk)")
        return 0
    gateway_cpus, load_cpus = split_cores()
    raise_fd_limit()
    pin_self(load_cpus)
    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rounds": args.rounds,
                               "duration_s": args.duration, "warm_up_s": WARM_UP_S, "connections": args.connections,
                               "gateway_cpus": sorted(gateway_cpus or []), "load_cpus": sorted(load_cpus or []),
                               "quota_lease": QUOTA_LEASE, "variants": []}
    work_dir = tempfile.mkdtemp(prefix="gridgate-bench-")
    try:
        configs = {index: derived_config(index, work_dir) for index in args.variants}
        entries = {index: {"index": index, "variant": VARIANTS[index][0], "runs": []} for index in args.variants}
        mocks = start_mocks(Topology.from_config(BENCH_CONFIG), load_cpus, tokens=16, models="demo-model")
        try:
            for round_number in range(1, args.rounds + 1):
                last = round_number == args.rounds
                # Even rounds run in reverse: a variant's place in the round (the first after the
                # mocks idled, the last before the next round) then weighs on every variant alike.
                order = args.variants if round_number % 2 else list(reversed(args.variants))
                for index in order:
                    print(f"bench_features: round {round_number}/{args.rounds}: {VARIANTS[index][0]}",
                          file=sys.stderr)
                    measured = measure_variant(configs[index], args, gateway_cpus, load_cpus, overhead=last)
                    entries[index]["runs"].append({"round": round_number, **measured})
        finally:
            stop_all(mocks)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    summaries = summarize_rounds({entry["variant"]: [run["throughput"] for run in entry["runs"]]
                                  for entry in entries.values()}, VARIANTS[CORE][0])
    for entry in entries.values():
        entry["summary"] = summaries[entry["variant"]]
        results["variants"].append(entry)
    text = render(results)
    stamp = timestamp()
    json_path = write_json(os.path.join(REPORTS_DIR, f"bench-features-{stamp}.json"), results)
    command = (f"python -m loadtest.bench_features --rounds {args.rounds} --duration {args.duration} "
               f"--connections {args.connections} --variants {','.join(map(str, args.variants))}")
    title = f"# What each feature costs on the request path ({results['started']})"
    md_path = write_text(os.path.join(REPORTS_DIR, f"bench-features-{stamp}.md"), f"{title}\n\n`{command}`\n\n{text}")
    print(text)
    print(f"bench_features: wrote {json_path} and {md_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    listing = "; ".join(f"{index} = {name}" for index, name in enumerate(VARIANT_NAMES))
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_features", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4, help="interleaved repetitions; medians are reported")
    parser.add_argument("--duration", type=int, default=8, help="seconds per measured wrk run")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--variants", metavar="LIST",
                        help=f"comma-separated indexes or name substrings (default: all; {CORE} always runs): {listing}")
    args = parser.parse_args(argv)
    if min(args.rounds, args.duration, args.connections) < 1:
        parser.error("--rounds, --duration and --connections must be at least 1")
    try:
        args.variants = select_variants(args.variants)
    except ValueError as exc:
        parser.error(f"--variants: {exc}; the variants are {listing}")
    try:
        return run(args)
    except RuntimeError as exc:
        print(f"bench_features: FAILED: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
