"""What one failed provider attempt adds to a request's latency (failover, docs/routing.md#failover).

    .venv/bin/python -m loadtest.bench_failover [--duration 8]

One gateway worker, one mock provider. Two overlays, measured in one run, one connection (wrk -c1):
`direct` routes to the mock alone; `failover` puts a provider whose port refuses connections first
(deterministic picker), so every request is refused there, then served by the mock. The added latency
(p50/p99 of failover minus direct) is the cost of one failed attempt: the refused connect, the
backoff before the next provider (full jitter up to `routing.retry.backoff.base` for the first retry;
run once with the default 10ms and once with `base: 1ms`), and the second selection. Cooling does not
apply (a refused connect is not a 429/503), so every request pays it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from typing import Any

import yaml

from loadtest.bench_core import run_wrk
from loadtest.mock_provider import start_mock_provider_process
from loadtest.report import markdown_table
from loadtest.topology import CHAT_PATH, GatewayProcess, Topology, free_port, pin_self, split_cores

HERE = os.path.dirname(os.path.abspath(__file__))
WRK_CHAT = os.path.join(HERE, "configs", "wrk_chat.lua")


def _write_config(work_dir: str, name: str, mock: str, first: str | None, backoff_base: str) -> str:
    clusters = [{"name": "good", "endpoints": [mock]}]
    candidates = [{"kind": "inference_model", "name": "demo-model", "site": "a", "cluster": "good",
                   "selection_group": 0}]
    if first is not None:
        clusters.insert(0, {"name": "refusing", "endpoints": [first]})
        candidates.insert(0, {**candidates[0], "cluster": "refusing"})
    overlay = os.path.join(work_dir, f"{name}-overlay.json")
    with open(overlay, "w") as out:
        json.dump({"local_site": "a", "selection_policy": {"mode": "deterministic"}, "candidates": candidates}, out)
    config: dict[str, Any] = {
        "listen": f"127.0.0.1:{free_port()}", "workers": 1, "admin": {"listen": f"127.0.0.1:{free_port()}"},
        "clusters": clusters, "access_log": {"enabled": False},
        "routing": {"overlay_file": overlay, "retry": {"backoff": {"base": backoff_base, "max": "500ms"}}},
    }
    path = os.path.join(work_dir, f"{name}.yaml")
    with open(path, "w") as out:
        yaml.safe_dump(config, out)
    return path


def run(args: argparse.Namespace) -> int:
    if shutil.which("wrk") is None:
        print("bench_failover: wrk not found on PATH; skipping (apt-get install -y wrk)")
        return 0
    gateway_cpus, load_cpus = split_cores()
    pin_self(load_cpus)
    work_dir = tempfile.mkdtemp(prefix="gridgate-failover-")
    mock = start_mock_provider_process(0, "good", cpus=load_cpus)
    refusing = f"127.0.0.1:{free_port()}"  # nothing listens: connect() is refused at once
    results = {}
    try:
        for name, first, base in (("direct", None, "10ms"), ("failover, backoff base 10ms", refusing, "10ms"),
                                  ("failover, backoff base 1ms", refusing, "1ms")):
            topology = Topology.from_config(_write_config(work_dir, name.split(",")[0] + base, mock.address, first,
                                                          base))
            gateway = GatewayProcess(topology, 1, gateway_cpus)
            try:
                gateway.wait_ready()
                url = f"http://{topology.listen[0]}:{topology.listen[1]}{CHAT_PATH}"
                run_wrk(url, WRK_CHAT, 1, 2, load_cpus)  # warm-up
                results[name] = run_wrk(url, WRK_CHAT, 1, args.duration, load_cpus)
            finally:
                gateway.stop()
    finally:
        mock.stop()
        shutil.rmtree(work_dir, ignore_errors=True)
    direct = results["direct"]
    rows = []
    for name, result in results.items():
        rows.append((name, f"{result['latency_p50_ms']:.3f}", f"{result['latency_p99_ms']:.3f}",
                     "" if result is direct else f"+{result['latency_p50_ms'] - direct['latency_p50_ms']:.3f} / "
                     f"+{result['latency_p99_ms'] - direct['latency_p99_ms']:.3f}",
                     str(result.get("non_2xx", 0) + result.get("socket_errors", 0))))
    print(markdown_table(("overlay (wrk -c1)", "p50 ms", "p99 ms", "added by one failed attempt p50 / p99", "errors"),
                         rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_failover", description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=int, default=8)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
