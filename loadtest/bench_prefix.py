"""Prefix affinity against round robin, over three mock providers with prompt caches (docs/routing.md,
"Prefix affinity"; the figures: docs/benchmarks/prefix-affinity.md).

    python -m loadtest.bench_prefix [--requests 1200] [--concurrency 12] [--prompts 20] [--users 400]
        [--cache 8] [--prefill-ms 120] [--workers 2] [--plot docs/benchmarks/prefix-affinity.svg]

The scenario: ``--prompts`` system prompts of about 1,500 tokens each (a support desk per product), used
by ``--users`` users (user u by prompt u mod prompts); each request is one user's new question under its
system prompt, the users drawn at random (seeded), ``--concurrency`` of them in flight. Three mock
providers (loadtest/mock_prefix_cache.py) each keep ``--cache`` prompt prefixes in an LRU, as a
provider's KV cache holds far fewer prefixes than all the traffic's, and answer a cached prompt's first
token in 30 % of the ``--prefill-ms`` a cold one takes (by its cached share). For each picker (the
overlay's roundRobin, then roundRobin with ``routing.prefix_affinity``) the mocks start cold and a real
gateway (``--workers`` workers) serves the same request sequence. Measured:

- cached-input share: cached prompt tokens / prompt tokens, from the usage the providers reported;
- cost per 1,000 requests at gpt-4o's prices (input $2.50, cached input $1.25, output $10.00 per million
  tokens), from the usage each answer reported; beside it the gateway's own figure (its access lines'
  ``cost_nusd``), where the gateway read the usage: without a quota it reads a chat answer's usage only
  with prefix affinity on, so for roundRobin it has none;
- first-token latency: time from sending the request to its answer (the mock's tokens come at once
  after the first, so this is the first token's time), p50 and p95;
- requests per provider.

Writes loadtest/reports/bench-prefix-<time>.json, prints a markdown table, and with ``--plot`` draws the
three figures side by side (matplotlib).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import yaml

from loadtest.report import REPORTS_DIR
from loadtest.topology import (
    BENCH_CONFIG,
    GatewayProcess,
    Topology,
    move_to_free_ports,
    start_mocks,
    stop_all,
    upstream_in_flight,
    write_derived_config,
)

GPT_4O = {"input": "2.50", "cached_input": "1.25", "output": "10.00"}  # USD per million tokens
PICKERS = (("roundRobin", False), ("prefix affinity", True))
OUTPUT_TOKENS = 40


def system_prompt(number: int) -> str:
    """About 1,500 tokens, different from its first words on (as real system prompts are)."""
    rules = " ".join(f"Rule {n}: answer questions about product {number} politely, cite the manual "
                     f"section {number}.{n}, and never promise a delivery date." for n in range(60))
    return f"You are the support assistant of product {number}. {rules}"


def request_body(prompt: int, user: int, question: int) -> bytes:
    return json.dumps({
        "model": "demo-model", "max_tokens": OUTPUT_TOKENS,
        "messages": [{"role": "system", "content": system_prompt(prompt)},
                     {"role": "user", "content": f"User {user} asks question {question}: where is my order?"}],
    }).encode()


def sequence(requests: int, users: int, prompts: int, seed: int = 43) -> list[tuple[int, int]]:
    """The (prompt, user) of each request, the same for every picker."""
    rng = random.Random(seed)
    return [(user % prompts, user) for user in (rng.randrange(users) for _ in range(requests))]


def bench_config(work_dir: str, name: str, prefix: bool, workers: int) -> str:
    def change(config: dict[str, Any]) -> None:
        move_to_free_ports(config)
        config["workers"] = workers
        config["access_log"] = {"enabled": True, "path": os.path.join(work_dir, f"{name}-access.log"),
                                "evidence_sample": 0.0}
        config["pricing"] = {"overrides": {"demo-model": dict(GPT_4O)}}
        if prefix:
            config["routing"]["prefix_affinity"] = {"enabled": True}
    return write_derived_config(BENCH_CONFIG, work_dir, name, change)


class Client:
    """``concurrency`` threads, each on its own keep-alive connection, taking requests off one list."""

    def __init__(self, address: tuple[str, int], bodies: list[bytes], concurrency: int) -> None:
        self.address = address
        self.bodies = bodies
        self.concurrency = concurrency
        self.next = 0
        self.lock = threading.Lock()
        self.results: list[dict[str, Any]] = []

    def _take(self) -> int | None:
        with self.lock:
            index = self.next
            if index >= len(self.bodies):
                return None
            self.next += 1
            return index

    def _run(self, _: int) -> list[dict[str, Any]]:
        connection = http.client.HTTPConnection(*self.address, timeout=30)
        done = []
        while (index := self._take()) is not None:
            started = time.perf_counter()
            connection.request("POST", "/v1/chat/completions", self.bodies[index],
                               {"Content-Type": "application/json"})
            response = connection.getresponse()
            payload = response.read()
            elapsed = time.perf_counter() - started
            usage = json.loads(payload).get("usage") or {} if response.status == 200 else {}
            done.append({"status": response.status, "provider": response.getheader("x-gridgate-provider"),
                         "mode": response.getheader("x-gridgate-selection-mode"), "seconds": elapsed,
                         "prompt": usage.get("prompt_tokens", 0), "completion": usage.get("completion_tokens", 0),
                         "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)})
        connection.close()
        return done

    def run(self) -> list[dict[str, Any]]:
        with ThreadPoolExecutor(self.concurrency) as pool:
            return [result for part in pool.map(self._run, range(self.concurrency)) for result in part]


def usd(result: dict[str, Any]) -> float:
    """A request's cost at GPT_4O's prices, from the usage it reported."""
    prompt, cached = result["prompt"], result["cached"]
    per_million = ((prompt - cached) * float(GPT_4O["input"]) + cached * float(GPT_4O["cached_input"])
                   + result["completion"] * float(GPT_4O["output"]))
    return per_million / 1e6


def access_costs(path: str) -> list[int]:
    costs = []
    with open(path) as lines:
        for line in lines:
            entry = json.loads(line)
            if entry.get("path") == "/v1/chat/completions" and entry.get("cost_nusd") is not None:
                costs.append(entry["cost_nusd"])
    return costs


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def run_picker(name: str, prefix: bool, bodies: list[bytes], args: argparse.Namespace,
               work_dir: str) -> dict[str, Any]:
    config_path = bench_config(work_dir, name.replace(" ", "-"), prefix, args.workers)
    topology = Topology.from_config(config_path)
    mocks = start_mocks(topology, None, prefix_cache=args.cache, latency_ms=args.prefill_ms,
                        prefix_hit_factor=0.3, tokens=OUTPUT_TOKENS)
    gateway = GatewayProcess(topology, args.workers, None, log_name=f"gateway-bench-prefix-{prefix}.log")
    try:
        gateway.wait_ready()
        started = time.monotonic()
        results = Client(topology.listen, bodies, args.concurrency).run()
        wall = time.monotonic() - started
        while upstream_in_flight(mocks):
            time.sleep(0.05)
    finally:
        gateway.stop()
        stop_all(mocks)
    with open(config_path) as src:
        log_path = yaml.safe_load(src)["access_log"]["path"]
    return summary(name, results, access_costs(log_path), wall)


def summary(name: str, results: list[dict[str, Any]], costs: list[int], wall: float) -> dict[str, Any]:
    served = [r for r in results if r["status"] == 200]
    prompt = sum(r["prompt"] for r in served)
    cached = sum(r["cached"] for r in served)
    latencies = [r["seconds"] * 1000 for r in served]
    return {
        "picker": name, "requests": len(results), "errors": len(results) - len(served),
        "cached_share": cached / prompt if prompt else 0.0,
        "usd_per_1000": sum(usd(r) for r in served) * 1000 / max(1, len(served)),
        "gateway_usd_per_1000": sum(costs) / 1e9 * 1000 / len(costs) if costs else None, "priced": len(costs),
        "first_token_p50_ms": statistics.median(latencies), "first_token_p95_ms": percentile(latencies, 0.95),
        "per_provider": dict(sorted(Counter(r["provider"] for r in served).items())),
        "modes": dict(Counter(r["mode"] for r in served)), "req_per_s": len(results) / wall,
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| picker | cached-input share | USD per 1,000 requests | first token p50 | p95 | req/s | "
             "requests per provider |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['picker']} | {row['cached_share']:.1%} | ${row['usd_per_1000']:.3f} | "
                     f"{row['first_token_p50_ms']:.0f} ms | {row['first_token_p95_ms']:.0f} ms | "
                     f"{row['req_per_s']:.0f} | {', '.join(map(str, row['per_provider'].values()))} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [row["picker"] for row in rows]
    colors = ["#999999", "#1f77b4"]
    figure, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    panels = (("cached-input share (%)", [100 * row["cached_share"] for row in rows]),
              ("USD per 1,000 requests", [row["usd_per_1000"] for row in rows]),
              ("first-token latency p50 (ms)", [row["first_token_p50_ms"] for row in rows]))
    for axis, (title, values) in zip(axes, panels, strict=True):
        bars = axis.bar(names, values, color=colors)
        axis.bar_label(bars, fmt="%.3g")
        axis.set_title(title, fontsize=10)
        axis.spines[["top", "right"]].set_visible(False)
    figure.suptitle("20 system prompts x 400 users over three providers with prompt caches", fontsize=10)
    figure.tight_layout()
    figure.savefig(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_prefix", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1200)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--users", type=int, default=400)
    parser.add_argument("--cache", type=int, default=8, help="prompt prefixes each mock provider keeps")
    parser.add_argument("--prefill-ms", type=float, default=120.0, help="a cold prompt's first-token delay")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--plot", default=None, help="write the figure here (svg or png)")
    args = parser.parse_args(argv)
    order = sequence(args.requests, args.users, args.prompts)
    bodies = [request_body(prompt, user, n) for n, (prompt, user) in enumerate(order)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-prefix-") as work_dir:
        for name, prefix in PICKERS:
            rows.append(run_picker(name, prefix, bodies, args, work_dir))
            print(f"{name}: done", file=sys.stderr)
    print(table(rows))
    os.makedirs(REPORTS_DIR, exist_ok=True)
    report = os.path.join(REPORTS_DIR, f"bench-prefix-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(report, "w") as out:
        json.dump({"args": vars(args), "results": rows}, out, indent=2)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
