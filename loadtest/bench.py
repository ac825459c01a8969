"""`make bench`: locust, headless, against a local topology, in scenarios real traffic has.

    .venv/bin/python -m loadtest.bench [--scenarios uniform,noisy-neighbour,long-streams,provider-failure]
        [--duration 60] [--out DIR] [--workers N] [--latency-ms 20] [--ttft-ms 50] [--tokens-per-s 200]
        [--tokens 32] [--locust-processes 1]

Each scenario starts one mock provider per endpoint of loadtest/configs/bench.yaml (with the given
latency and token rate), the gateway with a scenario-specific variant of that config, then locust
with loadtest/locustfile.py and the scenario's user classes:
  uniform            every user alike (25 % streams): the classic load generator's view
  noisy-neighbour    tenant `steady` sends interactive requests throughout; tenant `noisy` bursts
                     back to back in the middle third, against providers that admit 16 connections
                     each: what the burst does to the steady tenant's latency
  long-streams       interactive requests, and in the middle third long slow streams beside them
  provider-failure   uniform load; one provider is killed a third of the way in and restarted at
                     two thirds (health checks and outlier detection on): errors and latency over time
Every request is recorded by locust (time, kind, latency, outcome); the report bins them per second.

Output in DIR (default loadtest/reports/bench-<time>/): README.md (the report), report.json, and one
SVG per scenario (throughput, latency percentile bands, failures over time). The reference run in
docs/benchmarks/ was made with `--out docs/benchmarks`.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.identity.auth import hash_api_key
from loadtest.mock_provider import MockProviderHandle, start_mock_provider_process
from loadtest.report import (
    REPORTS_DIR,
    Bin,
    markdown_table,
    summarize,
    time_bins,
    timestamp,
    write_json,
    write_text,
)
from loadtest.topology import (
    BENCH_CONFIG,
    GatewayProcess,
    Topology,
    move_to_free_ports,
    raise_fd_limit,
    stop_all,
    write_derived_config,
)

LOCUSTFILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "locustfile.py")
FAILING_CLUSTER = "bench-b"
TENANT_KEYS = {"steady": "sk-steady", "noisy": "sk-noisy"}  # sent by the locust users of these tenants


# --------------------------------------------------------------------------------------------------
# Scenarios


def _tenants(config: dict[str, Any]) -> None:
    config["auth"] = {"keys": [{"tenant": tenant, "key": hash_api_key(key)} for tenant, key in TENANT_KEYS.items()]}


def _scarce_upstream(config: dict[str, Any]) -> None:
    """Providers that admit 16 connections each per worker: a burst has to queue for them."""
    _tenants(config)
    config["tenants"] = [{"tenant": "steady", "priority": "interactive"}, {"tenant": "noisy", "priority": "batch"}]
    for cluster in config["clusters"]:
        cluster["max_connections"] = 16


def _health_checked(config: dict[str, Any]) -> None:
    for cluster in config["clusters"]:
        cluster["health_check"] = {"type": "http", "path": "/health", "interval": "1s", "timeout": "500ms",
                                   "healthy_threshold": 1, "unhealthy_threshold": 2}
        cluster["outlier_detection"] = {"consecutive_failures": 3, "base_ejection": "5s"}


@dataclass(frozen=True)
class Scenario:
    name: str
    summary: str
    users: dict[str, int]  # locust user class -> fixed count
    change_config: Callable[[dict[str, Any]], None] | None = None
    env: dict[str, str] = field(default_factory=dict)
    window_labels: tuple[str, str] | None = None  # events at 1/3 and 2/3 of the run
    kill_provider: bool = False  # kill FAILING_CLUSTER's mock at 1/3, restart it at 2/3


SCENARIOS = {s.name: s for s in (
    Scenario("uniform", "50 identical users, a quarter of their requests streamed, no think time.",
             {"ChatUser": 50}),
    Scenario("noisy-neighbour",
             "Tenant `steady`: 10 interactive users (0.5 s think time) all along. Tenant `noisy`: 100 users "
             "sending back to back, only in the middle third. The providers admit 16 connections each "
             "(`max_connections: 16`), so the burst queues for upstream slots; `steady` has `priority: interactive`, "
             "`noisy` `priority: batch`.",
             {"InteractiveUser": 10, "BurstUser": 100}, _scarce_upstream, window_labels=("burst", "burst ends")),
    Scenario("long-streams",
             "10 interactive users all along; in the middle third 100 users open long streams "
             "(200 tokens at 20 tokens/s, about 10 s each) through the same worker.",
             {"InteractiveUser": 10, "LongStreamUser": 100},
             window_labels=("long streams start", "no new streams")),
    Scenario("provider-failure",
             f"30 uniform users (a quarter streaming, 50 ms think time) over three providers; `{FAILING_CLUSTER}`'s "
             "mock is killed (SIGKILL) a third of the way in and restarted at two thirds. Active health "
             "checks every 1 s (unhealthy after 2 failures) and outlier detection (3 consecutive failures, "
             "5 s ejection) are on.",
             {"ChatUser": 30}, _health_checked, env={"GRIDGATE_WAIT_S": "0.05"},
             window_labels=(f"{FAILING_CLUSTER} killed", f"{FAILING_CLUSTER} restarted"), kill_provider=True),
)}


# --------------------------------------------------------------------------------------------------
# One run


class RssSampler(threading.Thread):
    """Samples the gateway workers' RSS once a second while locust runs."""

    def __init__(self, gateway: GatewayProcess) -> None:
        super().__init__(daemon=True)
        self.gateway = gateway
        self.peak_kib: dict[str, int] = {}
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(1.0):
            for pid, kib in self.gateway.rss()["workers_kib"].items():
                self.peak_kib[pid] = max(kib, self.peak_kib.get(pid, 0))


class ProviderKiller(threading.Thread):
    """Kills one mock at the first moment and starts it again, same port, at the second."""

    def __init__(self, mocks: list[MockProviderHandle], name: str, at_s: tuple[float, float],
                 options: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.mocks, self.name, self.at_s, self.options = mocks, name, at_s, options
        self.halt = threading.Event()
        self.started_at = time.time()

    def run(self) -> None:
        index = next(i for i, mock in enumerate(self.mocks) if mock.name == self.name)
        victim = self.mocks[index]
        if self.halt.wait(max(0.0, self.started_at + self.at_s[0] - time.time())):
            return
        victim.process.kill()
        victim.stop()
        if self.halt.wait(max(0.0, self.started_at + self.at_s[1] - time.time())):
            return
        self.mocks[index] = start_mock_provider_process(victim.port, victim.name, host=victim.host, **self.options)
        # The mock gets SIGTERM when the thread that started it ends (PR_SET_PDEATHSIG is per thread).
        self.halt.wait()


def mock_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"latency_ms": args.latency_ms, "ttft_ms": args.ttft_ms, "tokens_per_s": args.tokens_per_s,
            "tokens": args.tokens, "models": args.model}


def run_locust(args: argparse.Namespace, scenario: Scenario, host: str, out_dir: str, started: float) -> int:
    users = sum(scenario.users.values())
    third = args.duration / 3
    cmd = [sys.executable, "-m", "locust", "-f", LOCUSTFILE, "--headless", "-u", str(users), "-r", str(min(users, 100)),
           "-t", f"{args.duration}s", "--host", host, "--only-summary", "--loglevel", "WARNING",
           *scenario.users]
    if args.locust_processes > 1:
        cmd += ["--processes", str(args.locust_processes)]
    env = {**os.environ, "GRIDGATE_MODEL": args.model, "GRIDGATE_MAX_TOKENS": str(args.tokens),
           "GRIDGATE_SAMPLES_DIR": out_dir, "GRIDGATE_RUN_START": f"{started:.3f}",
           "GRIDGATE_WINDOW": f"{third:.1f},{2 * third:.1f}",
           "GRIDGATE_TENANT_KEYS": ",".join(f"{tenant}={key}" for tenant, key in TENANT_KEYS.items()), **scenario.env}
    for user_class, count in scenario.users.items():
        env[f"GRIDGATE_{class_env_name(user_class)}_USERS"] = str(count)
    print(f"bench: {scenario.name}: locust {' '.join(cmd[5:])}", file=sys.stderr)
    return subprocess.run(cmd, env=env, check=False, timeout=args.duration + 120).returncode


def class_env_name(user_class: str) -> str:
    """InteractiveUser -> INTERACTIVE, LongStreamUser -> LONG_STREAM."""
    words, word = [], ""
    for char in user_class.removesuffix("User"):
        if char.isupper() and word:
            words.append(word)
            word = ""
        word += char
    return "_".join([*words, word]).upper()


def collect_samples(sample_dir: str) -> tuple[list[list[Any]], dict[str, int]]:
    rows: list[list[Any]] = []
    failures: dict[str, int] = {}
    for path in glob.glob(os.path.join(sample_dir, "samples-*.json")):
        with open(path) as src:
            data = json.load(src)
        rows += data["samples"]
        for key, count in data["failures"].items():
            failures[key] = failures.get(key, 0) + count
    return rows, failures


def run_scenario(args: argparse.Namespace, scenario: Scenario, out_dir: str) -> dict[str, Any]:
    raise_fd_limit()
    work_dir = tempfile.mkdtemp(prefix=f"gridgate-bench-{scenario.name}-")

    def change(config: dict[str, Any]) -> None:
        move_to_free_ports(config)
        if scenario.change_config is not None:
            scenario.change_config(config)

    config = write_derived_config(args.config, work_dir, scenario.name, change)
    topology = Topology.from_config(config)
    options = mock_options(args)
    mocks = [start_mock_provider_process(port, name, host=host, **options) for name, host, port in topology.endpoints]
    gateway = GatewayProcess(topology, args.workers, None)
    sample_dir = os.path.join(work_dir, "samples")
    result: dict[str, Any] = {"name": scenario.name, "summary": scenario.summary, "users": scenario.users}
    killer: ProviderKiller | None = None
    try:
        gateway.wait_ready()
        time.sleep(1.0)
        result["rss_idle_kib"] = gateway.rss()["workers_kib"]
        sampler = RssSampler(gateway)
        sampler.start()
        started = time.time()
        if scenario.kill_provider:
            killer = ProviderKiller(mocks, FAILING_CLUSTER, (args.duration / 3, 2 * args.duration / 3), options)
            killer.start()
        host = f"http://{topology.listen[0]}:{topology.listen[1]}"
        result["locust_exit_code"] = run_locust(args, scenario, host, sample_dir, started)
        result["load_average"] = os.getloadavg()  # other work on the host shows in the percentiles
        sampler.halt.set()
        result["rss_peak_kib"] = sampler.peak_kib
    finally:
        if killer is not None:
            killer.halt.set()
            killer.join()
        result["gateway_exit_code"] = gateway.stop()
        stop_all(mocks)
    samples, failures = collect_samples(sample_dir)
    result.update(started=started, duration_s=args.duration, samples=samples, failures=failures)
    return result


# --------------------------------------------------------------------------------------------------
# The report


def phases(duration_s: float, scenario: Scenario) -> list[tuple[str, float, float]]:
    if scenario.window_labels is None:
        return [("whole run", 0.0, duration_s)]
    third = duration_s / 3
    return [("first third", 0.0, third), (f"middle third ({scenario.window_labels[0]})", third, 2 * third),
            ("last third", 2 * third, duration_s)]


def phase_table(result: dict[str, Any], scenario: Scenario) -> str:
    """Per request kind and phase: requests, failures, latency percentiles of the successes."""
    rows = []
    kinds = sorted({row[1] for row in result["samples"]})
    for kind in kinds:
        for label, begin, end in phases(result["duration_s"], scenario):
            mine = [row for row in result["samples"]
                    if row[1] == kind and begin <= row[0] - result["started"] < end]
            if not mine:
                continue
            ok = summarize([row[2] for row in mine if row[3]])
            first_token = summarize([row[4] for row in mine if row[3] and row[4] >= 0])
            rows.append((kind, label, len(mine), sum(1 for row in mine if not row[3]),
                         f"{ok['p50']:.0f} / {ok['p95']:.0f} / {ok['p99']:.0f}" if ok["n"] else "-",
                         f"{first_token['p50']:.0f} / {first_token['p99']:.0f}" if first_token["n"] else "-"))
    return markdown_table(("request", "phase", "requests", "failures", "latency p50 / p95 / p99 ms",
                           "first token p50 / p99 ms"), rows)


def overhead_line(result: dict[str, Any]) -> str:
    overhead = summarize([row[5] for row in result["samples"] if row[5] >= 0])
    missing = sum(1 for row in result["samples"] if row[3] and row[5] < 0)
    return (f"Gateway overhead (`x-gridgate-overhead-ms`) p50 / p95 / p99: {overhead['p50']:.3f} / "
            f"{overhead['p95']:.3f} / {overhead['p99']:.3f} ms (n={overhead['n']}, successes without the "
            f"header {missing}).")


def rss_line(result: dict[str, Any]) -> str:
    parts = [f"{int(pid)}: {kib / 1024:.1f} → {result.get('rss_peak_kib', {}).get(pid, 0) / 1024:.1f} MiB"
             for pid, kib in result.get("rss_idle_kib", {}).items()]
    load = result.get("load_average")
    host = f" Host load average (1 / 5 min) at the end: {load[0]:.1f} / {load[1]:.1f} on {os.cpu_count()} cores." \
        if load else ""
    return "Worker RSS idle → peak: " + (", ".join(parts) or "?") + "." + host


def timeline(result: dict[str, Any]) -> dict[str, list[Bin]]:
    """Per request kind, the requests binned by the second they completed in."""
    started, duration = result["started"], result["duration_s"]
    kinds = sorted({row[1] for row in result["samples"]})
    return {kind: time_bins([(row[0], row[2], row[3]) for row in result["samples"] if row[1] == kind],
                            started, started + duration) for kind in kinds}


def timeline_json(bins: dict[str, list[Bin]]) -> dict[str, list[list[Any]]]:
    """[second, requests, failures, p50 ms, p99 ms] rows per kind, for report.json."""
    return {kind: [[cell.start_s, cell.count, cell.failures, cell.percentile(50), cell.percentile(99)]
                   for cell in cells] for kind, cells in bins.items()}


def plot(result: dict[str, Any], scenario: Scenario, bins: dict[str, list[Bin]], out_dir: str) -> str:
    from loadtest.plots import timeline_svg  # matplotlib only when drawing

    duration = result["duration_s"]
    events = []
    if scenario.window_labels:
        events = [(duration / 3, scenario.window_labels[0]), (2 * duration / 3, scenario.window_labels[1])]
    path = os.path.join(out_dir, f"{scenario.name}.svg")
    return timeline_svg(path, f"{scenario.name}: throughput, latency and failures per second", bins, events)


def render(results: list[dict[str, Any]], parameters: dict[str, Any]) -> str:
    params = ", ".join(f"{k}={v}" for k, v in parameters.items())
    parts = [
        "# gridgate benchmark report",
        "",
        f"Run {parameters['started']} on {platform.node()} ({os.cpu_count()} cores, {platform.platform()}) "
        f"with `python -m loadtest.bench {parameters['command']}`. Everything runs on this one machine "
        "(gateway, mock providers, locust), so absolute figures are modest; compare within a run.",
        "",
        f"Parameters: {params}.",
        "",
        "Each figure bins the requests by the second they completed: completed requests per second per "
        "kind, latency of the successful ones (p50 line, shaded to p90 and p99; log scale when they span "
        "more than a decade) and failures per second. Dashed lines mark the scenario's events. A table "
        "row covers the requests that completed in that phase.",
    ]
    for result in results:
        scenario = SCENARIOS[result["name"]]
        failures = markdown_table(("request: error", "count"), sorted(result["failures"].items(),
                                                                      key=lambda item: -item[1]))
        parts += ["", f"## {scenario.name}", "", scenario.summary, "", phase_table(result, scenario), "",
                  overhead_line(result) + " " + rss_line(result), "",
                  f"![{scenario.name}]({os.path.basename(result['plot'])})", "",
                  "Failures: " + ("none." if not result["failures"] else "\n\n" + failures)]
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, in order")
    parser.add_argument("--duration", type=int, default=60, help="seconds of load per scenario")
    parser.add_argument("--out", default=None, help="report directory (default loadtest/reports/bench-<time>)")
    parser.add_argument("--config", default=BENCH_CONFIG)
    parser.add_argument("--workers", type=int, default=None, help="gateway workers (default: the config's)")
    parser.add_argument("--model", default="demo-model")
    parser.add_argument("--latency-ms", type=float, default=20)
    parser.add_argument("--ttft-ms", type=float, default=50)
    parser.add_argument("--tokens-per-s", type=float, default=200)
    parser.add_argument("--tokens", type=int, default=32, help="output tokens per short response (also max_tokens)")
    parser.add_argument("--locust-processes", type=int, default=1)
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.scenarios.split(",") if name.strip()]
    unknown = [name for name in names if name not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}")
    out_dir = args.out or os.path.join(REPORTS_DIR, f"bench-{timestamp()}")
    os.makedirs(out_dir, exist_ok=True)
    parameters = {"started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "command": " ".join(argv or sys.argv[1:]),
                  "duration_s": args.duration, "latency_ms": args.latency_ms, "ttft_ms": args.ttft_ms,
                  "tokens_per_s": args.tokens_per_s, "tokens": args.tokens,
                  "workers": args.workers or "from config (1)"}
    results = []
    try:
        for name in names:
            result = run_scenario(args, SCENARIOS[name], out_dir)
            bins = timeline(result)
            result["timeline"] = timeline_json(bins)
            result["plot"] = plot(result, SCENARIOS[name], bins, out_dir)
            results.append(result)
    except RuntimeError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 1
    report = render(results, parameters)
    write_text(os.path.join(out_dir, "README.md"), report)
    write_json(os.path.join(out_dir, "report.json"),
               {"parameters": parameters, "scenarios": [{k: v for k, v in r.items() if k != "samples"}
                                                        for r in results]})
    print(report)
    print(f"bench: wrote {out_dir}/README.md, report.json and {len(results)} SVG plots")
    return 0 if all(r["samples"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
