"""`make bench`: locust, headless, against a local topology; writes a report with plots.

    .venv/bin/python -m loadtest.bench [--users 50] [--spawn-rate 25] [--duration 30s]
        [--stream-share 0.25] [--latency-ms 20] [--ttft-ms 50] [--tokens-per-s 200] [--tokens 32]
        [--workers N] [--config loadtest/configs/bench.yaml] [--locust-processes 1] [--direct]

Topology: one mock provider per endpoint of the config (with the given latency and token rate), the
gateway (`python -m gateway run`; with a `quota` block in the config its supervisor also runs the
embedded Valkey), then locust with loadtest/locustfile.py. `--direct` skips the gateway and loads the
first mock: the baseline of the load generator itself.

Output in loadtest/reports/bench-<time>/: report.md, report.json, locust CSVs and SVG plots
(throughput.svg, first_token.svg, overhead.svg, rss.svg); locust's own statistics are
taken from its --json-file (final and complete), its --csv files are kept alongside.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any

from loadtest.bench_core import BENCH_CONFIG, GatewayProcess, Topology, raise_fd_limit, start_mocks, stop_all
from loadtest.report import (
    REPORTS_DIR,
    markdown_table,
    summarize,
    svg_histogram,
    svg_line_chart,
    timestamp,
    write_json,
    write_text,
)

LOCUSTFILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "locustfile.py")


class RssSampler(threading.Thread):
    """Samples the gateway workers' RSS once a second while locust runs."""

    def __init__(self, gateway: GatewayProcess) -> None:
        super().__init__(daemon=True)
        self.gateway = gateway
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.halt = threading.Event()
        self.started_at = time.monotonic()

    def run(self) -> None:
        while not self.halt.wait(1.0):
            self.samples.append((time.monotonic() - self.started_at, self.gateway.rss()["workers_kib"]))

    def peak_kib(self) -> dict[str, int]:
        peak: dict[str, int] = {}
        for _, workers in self.samples:
            for pid, kib in workers.items():
                peak[pid] = max(kib, peak.get(pid, 0))
        return peak


def run_locust(args: argparse.Namespace, host: str, out_dir: str, sampler: RssSampler | None) -> int:
    cmd = [sys.executable, "-m", "locust", "-f", LOCUSTFILE, "--headless", "-u", str(args.users),
           "-r", str(args.spawn_rate), "-t", args.duration, "--host", host, "--csv", os.path.join(out_dir, "locust"),
           "--json-file", os.path.join(out_dir, "locust"), "--only-summary", "--loglevel", "WARNING"]
    if args.locust_processes > 1:
        cmd += ["--processes", str(args.locust_processes)]
    env = {**os.environ, "GRIDGATE_MODEL": args.model, "GRIDGATE_STREAM_SHARE": str(args.stream_share),
           "GRIDGATE_MAX_TOKENS": str(args.tokens), "GRIDGATE_OVERHEAD_DIR": os.path.join(out_dir, "overhead")}
    print("bench: " + " ".join(cmd[2:]), file=sys.stderr)
    if sampler is not None:
        sampler.start()
    try:
        return subprocess.run(cmd, env=env, check=False, timeout=parse_seconds(args.duration) + 120).returncode
    finally:
        if sampler is not None:
            sampler.halt.set()
            sampler.join()


def parse_seconds(text: str) -> int:
    """Locust-style durations: 30s, 2m, 1h30m, or a bare number of seconds."""
    total, number = 0, ""
    for char in text:
        if char.isdigit():
            number += char
        else:
            total += int(number or 0) * {"s": 1, "m": 60, "h": 3600}[char]
            number = ""
    return total + int(number or 0)


def histogram_percentile(histogram: dict[int, int], total: int, p: float) -> float:
    """Percentile from locust's response-time histogram ({rounded ms: count})."""
    if total <= 0:
        return 0.0
    rank, seen = max(1, math.ceil(p / 100.0 * total)), 0
    for value in sorted(histogram):
        seen += histogram[value]
        if seen >= rank:
            return float(value)
    return float(max(histogram))


def entry_summary(requests: int, failures: int, seconds: float, histogram: dict[int, int]) -> dict[str, Any]:
    timed = sum(histogram.values())
    return {"requests": requests, "failures": failures, "requests_per_s": requests / max(seconds, 1e-9),
            **{f"p{p}_ms": histogram_percentile(histogram, timed, p) for p in (50, 95, 99)}}


def collect_locust(out_dir: str) -> dict[str, Any]:
    """Totals, percentiles and per-second counts from locust's --json-file (its final statistics)."""
    path = os.path.join(out_dir, "locust.json")
    if not os.path.exists(path):
        return {"per_name": {}, "per_second": []}
    with open(path) as src:
        entries = json.load(src)
    per_name: dict[str, Any] = {}
    total_hist: Counter[int] = Counter()
    per_second: Counter[int] = Counter()
    fails_per_second: Counter[int] = Counter()
    first, last, requests, failures = float("inf"), 0.0, 0, 0
    for entry in entries:
        histogram = {int(float(k)): v for k, v in entry["response_times"].items()}
        seconds = entry["last_request_timestamp"] - entry["start_time"]
        per_name[entry["name"]] = entry_summary(entry["num_requests"], entry["num_failures"], seconds, histogram)
        total_hist.update(histogram)
        per_second.update({int(k): v for k, v in entry["num_reqs_per_sec"].items()})
        fails_per_second.update({int(k): v for k, v in entry["num_fail_per_sec"].items()})
        first, last = min(first, entry["start_time"]), max(last, entry["last_request_timestamp"])
        requests, failures = requests + entry["num_requests"], failures + entry["num_failures"]
    if entries:
        per_name["Aggregated"] = entry_summary(requests, failures, last - first, dict(total_hist))
    seconds = sorted(per_second)
    timeline = [(t - seconds[0], per_second[t], fails_per_second.get(t, 0)) for t in seconds]
    # The last second is partial (the run stopped inside it): leave it out of the plot.
    return {"per_name": per_name, "per_second": timeline[:-1] if len(timeline) > 1 else timeline}


def collect_client_samples(out_dir: str) -> dict[str, Any]:
    overhead: list[float] = []
    first_token: list[float] = []
    failures: Counter[str] = Counter()
    missing = 0
    for path in glob.glob(os.path.join(out_dir, "overhead", "overhead-*.json")):
        with open(path) as src:
            data = json.load(src)
        overhead += data["overhead_ms"]
        first_token += data["first_token_ms"]
        failures.update(data["failures"])
        missing += data["missing"]
    return {"overhead_ms": overhead, "first_token_ms": first_token, "missing_overhead_header": missing,
            "failures": dict(failures.most_common())}


def write_plots(out_dir: str, locust: dict[str, Any], samples: dict[str, Any], sampler: RssSampler | None) -> list[str]:
    paths = []
    if timeline := locust["per_second"]:
        throughput = {"requests/s": [(t, n) for t, n, _ in timeline], "failures/s": [(t, f) for t, _, f in timeline]}
        paths.append(write_text(os.path.join(out_dir, "throughput.svg"),
                                svg_line_chart("Throughput", "seconds", "per second", throughput)))
    if samples["first_token_ms"]:
        paths.append(write_text(os.path.join(out_dir, "first_token.svg"),
                                svg_histogram("Stream time to first token (client side)", "ms",
                                              samples["first_token_ms"])))
    if samples["overhead_ms"]:
        paths.append(write_text(os.path.join(out_dir, "overhead.svg"),
                                svg_histogram("Gateway overhead (x-gridgate-overhead-ms)", "ms",
                                              samples["overhead_ms"])))
    if sampler is not None and sampler.samples:
        pids = sorted({pid for _, workers in sampler.samples for pid in workers})
        series = {f"worker {pid}": [(t, workers[pid] / 1024) for t, workers in sampler.samples if pid in workers]
                  for pid in pids}
        paths.append(write_text(os.path.join(out_dir, "rss.svg"),
                                svg_line_chart("Worker RSS", "seconds", "MiB", series)))
    return paths


def render(results: dict[str, Any]) -> str:
    total = results["locust"]["per_name"].get("Aggregated", {})
    overhead, first_token, rss = results["overhead_ms"], results["first_token_ms"], results.get("rss", {})
    rows = [
        ("requests/s", f"{total.get('requests_per_s', 0):,.1f}"),
        ("requests / failures", f"{total.get('requests', 0)} / {total.get('failures', 0)}"),
        ("response time p50 / p95 / p99 (ms)",
         f"{total.get('p50_ms', 0):.0f} / {total.get('p95_ms', 0):.0f} / {total.get('p99_ms', 0):.0f}"),
        ("gateway overhead p50 / p95 / p99 (ms)",
         f"{overhead['p50']:.3f} / {overhead['p95']:.3f} / {overhead['p99']:.3f} (n={overhead['n']}, "
         f"missing header {results['missing_overhead_header']})"),
        ("stream first token p50 / p95 / p99 (ms)",
         f"{first_token['p50']:.1f} / {first_token['p95']:.1f} / {first_token['p99']:.1f} (n={first_token['n']})"),
    ]
    for pid, kib in rss.get("idle_kib", {}).items():
        peak = rss.get("peak_kib", {}).get(pid, 0)
        rows.append((f"worker {pid} RSS idle / peak (MiB)", f"{kib / 1024:.1f} / {peak / 1024:.1f}"))
    names = [(name, s) for name, s in results["locust"]["per_name"].items() if name != "Aggregated"]
    per_name = markdown_table(("request", "count", "failures", "req/s", "p50 ms", "p95 ms", "p99 ms"),
                              [(n, s["requests"], s["failures"], s["requests_per_s"], s["p50_ms"], s["p95_ms"],
                                s["p99_ms"]) for n, s in names])
    failures = markdown_table(("request: error", "count"), list(results["failures"].items()))
    params = ", ".join(f"{k}={v}" for k, v in results["parameters"].items())
    plots = "\n".join(f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in results["plots"])
    return (f"# gridgate locust benchmark ({results['started']})\n\n{params}\n\n"
            f"{markdown_table(('measure', 'value'), rows)}\n\n## Per request type\n\n{per_name}\n\n"
            f"## Failures\n\n{failures if results['failures'] else 'none'}\n\n## Plots\n\n{plots}\n")


def run(args: argparse.Namespace) -> int:
    raise_fd_limit()
    topology = Topology.from_config(args.config)
    out_dir = os.path.join(REPORTS_DIR, f"bench-{timestamp()}")
    os.makedirs(out_dir, exist_ok=True)
    parameters = {k: getattr(args, k) for k in ("users", "spawn_rate", "duration", "stream_share", "latency_ms",
                                                "ttft_ms", "tokens_per_s", "tokens", "workers", "direct")}
    if parameters["workers"] is None:
        parameters["workers"] = "from config"
    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "parameters": parameters,
                               "config": args.config}
    mocks = start_mocks(topology, None, latency_ms=args.latency_ms, ttft_ms=args.ttft_ms,
                        tokens_per_s=args.tokens_per_s, tokens=args.tokens, models=args.model)
    gateway: GatewayProcess | None = None
    sampler: RssSampler | None = None
    try:
        if args.direct:
            host = mocks[0].base_url
        else:
            gateway = GatewayProcess(topology, args.workers, None)
            gateway.wait_ready()
            time.sleep(1.0)
            results["rss"] = {"idle_kib": gateway.rss()["workers_kib"]}
            sampler = RssSampler(gateway)
            host = f"http://{topology.listen[0]}:{topology.listen[1]}"
        results["locust_exit_code"] = run_locust(args, host, out_dir, sampler)
    finally:
        if gateway is not None:
            results["gateway_exit_code"] = gateway.stop()
        stop_all(mocks)
    if sampler is not None:
        results["rss"]["peak_kib"] = sampler.peak_kib()
        results["rss"]["samples"] = sampler.samples
    locust = collect_locust(out_dir)
    samples = collect_client_samples(out_dir)
    results["locust"] = locust
    results["failures"] = samples["failures"]
    results["overhead_ms"] = summarize(samples["overhead_ms"])
    results["first_token_ms"] = summarize(samples["first_token_ms"])
    results["missing_overhead_header"] = samples["missing_overhead_header"]
    results["plots"] = write_plots(out_dir, locust, samples, sampler)
    report = render(results)
    write_json(os.path.join(out_dir, "report.json"), results)
    write_text(os.path.join(out_dir, "report.md"), report)
    print(report)
    print(f"bench: wrote {out_dir}/report.md, report.json and {len(results['plots'])} SVG plots")
    if not locust["per_name"]:
        print("bench: locust produced no statistics; see its output above", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=BENCH_CONFIG)
    parser.add_argument("--workers", type=int, default=None, help="gateway workers (default: the config's)")
    parser.add_argument("--users", type=int, default=50)
    parser.add_argument("--spawn-rate", type=float, default=25)
    parser.add_argument("--duration", default="30s")
    parser.add_argument("--stream-share", type=float, default=0.25)
    parser.add_argument("--model", default="demo-model")
    parser.add_argument("--latency-ms", type=float, default=20)
    parser.add_argument("--ttft-ms", type=float, default=50)
    parser.add_argument("--tokens-per-s", type=float, default=200)
    parser.add_argument("--tokens", type=int, default=32, help="output tokens per response (also max_tokens)")
    parser.add_argument("--locust-processes", type=int, default=1)
    parser.add_argument("--direct", action="store_true", help="load the first mock directly, no gateway")
    args = parser.parse_args(argv)
    try:
        return run(args)
    except RuntimeError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
