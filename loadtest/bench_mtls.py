"""What mTLS (``server_tls.client_auth``) costs one worker core, beside plain HTTPS.

    .venv/bin/python -m loadtest.bench_mtls [--duration 5] [--rounds 3] [--connections 32] [--gateway-core 0 --load-core 1]

The loadtest/bench_tls.py topology (one gateway worker on the gateway core; the load client and the
mock providers on the load core). wrk cannot present a client certificate, so every variant is driven
by loadtest/tls_load.py (uvloop, the same request wrk sends), and compared only with each other:
  a. keep-alive HTTPS, no client certificates            (the baseline)
  b. keep-alive mTLS: client_auth required, tenant from the subject CN
  c. HTTPS, a new connection (full handshake) per request
  d. mTLS, a new connection (full handshake + client certificate verification) per request
"req/s per core" is 1 / (the worker's own CPU time per request, from /proc), so the figures hold on
a machine whose cores other processes share; the measured req/s (limited by the Python client) is
shown beside it. Needs the openssl CLI (certificates are made in a temporary directory). Prints a
markdown table and writes loadtest/reports/bench-mtls-<time>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from loadtest.bench_core import (
    CHAT_PATH,
    GatewayProcess,
    Topology,
    pin_self,
    raise_fd_limit,
    start_mocks,
    stop_all,
)
from loadtest.bench_tls import cpu_seconds, make_certificate, write_config
from loadtest.mock_provider import child_setup
from loadtest.report import invocation, markdown_table, run_bench, write_report
from loadtest.topology import add_core_arguments, split_cores

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]


def make_client_pki(directory: str) -> dict[str, str]:
    """A CA and one client certificate it signed (ECDSA P-256), as files."""
    paths = {name: os.path.join(directory, name) for name in ("ca.crt", "ca.key", "client.csr", "client.crt",
                                                               "client.key")}
    subprocess.run(["openssl", "req", "-x509", *_EC, "-days", "1", "-subj", "/CN=bench-clients",
                    "-keyout", paths["ca.key"], "-out", paths["ca.crt"]], check=True, capture_output=True)
    subprocess.run(["openssl", "req", *_EC, "-subj", "/CN=bench-client", "-keyout", paths["client.key"],
                    "-out", paths["client.csr"]], check=True, capture_output=True)
    subprocess.run(["openssl", "x509", "-req", "-in", paths["client.csr"], "-CA", paths["ca.crt"], "-CAkey",
                    paths["ca.key"], "-CAcreateserial", "-days", "1", "-out", paths["client.crt"]],
                   check=True, capture_output=True)
    return paths


def load(url: str, args: argparse.Namespace, duration: float, cpus: set[int] | None, close: bool,
         cert: tuple[str, str] | None) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "loadtest.tls_load", url, "--connections", str(args.connections),
           "--duration", str(duration)] + (["--close"] if close else [])
    if cert is not None:
        cmd += ["--cert", cert[0], "--key", cert[1]]
    done = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=child_setup(cpus),
                          timeout=duration + 60, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"tls_load failed ({done.returncode}): {done.stderr.strip()}")
    result = json.loads(done.stdout)
    result["command"] = " ".join(cmd[1:])
    return result


def measure(topology: Topology, args: argparse.Namespace, gateway_cpus: set[int] | None,
            load_cpus: set[int] | None, close: bool, cert: tuple[str, str] | None) -> dict[str, Any]:
    host, port = topology.listen
    url = f"https://{host}:{port}{CHAT_PATH}"
    gateway = GatewayProcess(topology, 1, gateway_cpus)
    try:
        gateway.wait_ready()
        load(url, args, 1.0, load_cpus, close, cert)  # warm-up: pools, caches
        workers = gateway.worker_pids()
        before = cpu_seconds(workers)
        result = load(url, args, args.duration, load_cpus, close, cert)
        used = cpu_seconds(workers) - before
        result["cpu_us_per_request"] = round(used * 1e6 / max(1, result["requests"]), 1)
        return result
    finally:
        gateway.stop()


def run(args: argparse.Namespace) -> int:
    if shutil.which("openssl") is None:
        print("bench_mtls: openssl not found on PATH; skipping")
        return 0
    gateway_cpus, load_cpus = split_cores(args.gateway_core, args.load_core)
    raise_fd_limit()
    pin_self(load_cpus)
    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "duration_s": args.duration,
                               "connections": args.connections}
    with tempfile.TemporaryDirectory() as directory:
        off = {"enabled": False}
        mock_ports: dict[str, int] = {}
        server = make_certificate(directory, "ecdsa-p256")
        pki = make_client_pki(directory)
        https = write_config(directory, "https", mock_ports, access_log=off, server_tls=server)
        mtls = write_config(directory, "mtls", mock_ports, access_log=off, server_tls={
            **server, "client_auth": {"ca_file": pki["ca.crt"], "mode": "required", "tenant_from": "subject_cn"}})
        client = (pki["client.crt"], pki["client.key"])
        mocks = start_mocks(https, load_cpus, tokens=16, models="demo-model")
        try:
            runs = [
                ("a", "keep-alive HTTPS", https, False, None),
                ("b", "keep-alive mTLS (client certificate, tenant from its CN)", mtls, False, client),
                ("c", "HTTPS, a full handshake per request", https, True, None),
                ("d", "mTLS, a full handshake and certificate verification per request", mtls, True, client),
            ]
            for round_number in range(args.rounds):  # interleaved, so a noisy minute hits every variant
                for key, label, topology, close, cert in runs:
                    print(f"bench_mtls: round {round_number + 1}/{args.rounds} ({key}) {label}", file=sys.stderr)
                    result = measure(topology, args, gateway_cpus, load_cpus, close, cert)
                    results.setdefault(key, {"label": label, "runs": []})["runs"].append(result)
        finally:
            stop_all(mocks)
    table = _table(results, args)
    write_report("bench-mtls", results, f"mTLS cost ({results['started']})",
                 invocation("loadtest.bench_mtls"), table + "\n")
    return 0


def _table(results: dict[str, Any], args: argparse.Namespace) -> str:
    rows = []
    entries = {key: entry for key, entry in results.items() if isinstance(entry, dict) and "runs" in entry}
    for entry in entries.values():
        entry["cpu_us_per_request"] = statistics.median(r["cpu_us_per_request"] for r in entry["runs"])
        entry["requests_per_s"] = statistics.median(r["requests_per_s"] for r in entry["runs"])
    for key, entry in entries.items():
        base = entries["c" if key in ("c", "d") else "a"]["cpu_us_per_request"] or 1
        cpu_us = entry["cpu_us_per_request"]
        spread = ", ".join(f"{r['cpu_us_per_request']:.0f}" for r in entry["runs"])
        failed = sum(r["errors"] + sum(n for s, n in r["statuses"].items() if s != "200") for r in entry["runs"])
        rows.append((f"{key}. {entry['label']}", f"{cpu_us:.0f}", f"{1e6 / max(cpu_us, 1):,.0f}",
                     f"{cpu_us / base:.2f}", f"{entry['requests_per_s']:,.0f}",
                     f"CPU µs/request per round: {spread}; errors + non-200 {failed}"))
    return markdown_table((f"1 worker, tls_load -c{args.connections}, median of {args.rounds}",
                           "worker CPU µs/request", "req/s per core", "CPU vs its HTTPS row", "req/s measured",
                           "detail"), rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_mtls", description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per run")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repetitions; medians are reported")
    add_core_arguments(parser)
    args = parser.parse_args(argv)
    return run_bench("bench_mtls", run, args)


if __name__ == "__main__":
    sys.exit(main())
