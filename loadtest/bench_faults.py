"""Faults under keep-alive load (issue 12): failed requests per worker kill, reload and worker stop, and
the share of the load a replacement worker gets.

    .venv/bin/python -m loadtest.bench_faults [--rounds 3] [--duration 10] [--connections 32] \\
        [--tree before=/path/to/an/older/checkout] [--tree after=.]

Every run starts a fresh gateway with 2 workers from one source tree (``python -m gateway run`` with
that tree as working directory, this venv), three mock providers (loadtest/mock_provider.py) and
``wrk -t1 -cN -dDs`` posting a non-streaming chat completion (loadtest/configs/wrk_chat.lua). Two
seconds in, the fault:

  none     nothing: the errors the load alone causes
  kill     SIGKILL one worker (the supervisor replaces it)
  reload   SIGHUP after a config change the workers use (a new generation replaces both)
  stop     SIGTTOU (2 -> 1 workers)

Failed requests = wrk's socket errors (connect, read, write, timeout; its timeout is 2 s) + non-2xx
answers. For kill, the replacement's share = its CPU seconds / both workers' CPU seconds from the
moment it is ready (/readyz 200 again) to 6 s after the kill (/proc/PID/stat).

The machine may be shared and noisy: each round runs every scenario once per tree, trees interleaved,
so drift hits all of them alike. Writes loadtest/reports/bench-faults-<time>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import yaml

from loadtest.bench_core import WRK_CHAT, parse_wrk
from loadtest.mock_provider import MockProviderHandle, start_mock_provider_process, terminate
from loadtest.report import REPORTS_DIR, child_pids, markdown_table, timestamp, write_json, write_text
from loadtest.topology import BENCH_CONFIG, CHAT_PATH, http_get, raise_fd_limit, stop_all

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCENARIOS = ("none", "kill", "reload", "stop")
FAULT_AT_S = 2.0
SHARE_WINDOW_S = 6.0  # the replacement's share is measured until this long after the kill
_TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime (fields 14 and 15 of stat)


class FaultGateway:
    """One gateway of one source tree on free ports, with a config file the reload scenario edits."""

    def __init__(self, tree: str, work_dir: str, mocks: list[MockProviderHandle]) -> None:
        with open(BENCH_CONFIG) as src:
            self.config: dict[str, Any] = yaml.safe_load(src)
        shutil.copy(os.path.join(os.path.dirname(BENCH_CONFIG), self.config["routing"]["overlay_file"]), work_dir)
        self.port, self.admin_port = free_port(), free_port()
        self.config.update(listen=f"127.0.0.1:{self.port}", workers=2, admin={"listen": f"127.0.0.1:{self.admin_port}"},
                           timeouts={"keepalive_idle": "75s", "graceful_shutdown": "10s"})
        for cluster, mock in zip(self.config["clusters"], mocks, strict=True):
            cluster["endpoints"] = [f"{mock.host}:{mock.port}"]
        self.path = os.path.join(work_dir, "gridgate.yaml")
        self.write_config()
        self.log = open(os.path.join(work_dir, "gateway.log"), "ab")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen([sys.executable, "-m", "gateway", "run", "-c", self.path], cwd=tree,
                                        stdout=self.log, stderr=subprocess.STDOUT)

    def write_config(self) -> None:
        with open(self.path, "w") as out:
            yaml.safe_dump(self.config, out)

    def ready(self) -> bool:
        return http_get(("127.0.0.1", self.admin_port), "/readyz", timeout=0.5)[0] == 200

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway not ready (exit {self.process.returncode}); see {self.log.name}")
            time.sleep(0.05)

    def workers(self) -> list[int]:
        return child_pids(self.process.pid)

    def stop(self) -> None:
        terminate(self.process, 30)
        self.log.close()


def inject(scenario: str, gateway: FaultGateway) -> dict[str, Any]:
    """Apply the fault; for a kill, measure the replacement's boot and its share of the load."""
    if scenario == "reload":
        gateway.config["timeouts"]["keepalive_idle"] = "76s"
        gateway.write_config()
        gateway.process.send_signal(signal.SIGHUP)
    elif scenario == "stop":
        gateway.process.send_signal(signal.SIGTTOU)
    elif scenario == "kill":
        victim, survivor = gateway.workers()[:2]
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)

        def replacement() -> int | None:
            fresh = [pid for pid in gateway.workers() if pid not in (victim, survivor)]
            return fresh[0] if fresh and gateway.ready() else None

        new = wait_for(replacement)
        if new is None:
            raise RuntimeError(f"no replacement worker ready within {SHARE_WINDOW_S}s of the kill")
        ready_at = time.monotonic()
        start = {pid: cpu_seconds(pid) for pid in (survivor, new)}
        time.sleep(max(0.0, killed_at + SHARE_WINDOW_S - time.monotonic()))
        used = {pid: cpu_seconds(pid) - start[pid] for pid in (survivor, new)}
        total = used[survivor] + used[new]
        return {"replacement_ready_s": round(ready_at - killed_at, 2),
                "survivor_cpu_s": round(used[survivor], 2), "replacement_cpu_s": round(used[new], 2),
                "replacement_share": round(used[new] / total, 3) if total else 0.0}
    return {}


def wait_for(predicate: Callable[[], Any], timeout: float = SHARE_WINDOW_S) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.02)
    return None


def run_once(tree: str, scenario: str, mocks: list[MockProviderHandle], args: argparse.Namespace) -> dict[str, Any]:
    work_dir = tempfile.mkdtemp(prefix="gridgate-faults-")
    gateway = FaultGateway(tree, work_dir, mocks)
    try:
        gateway.wait_ready()
        time.sleep(0.5)
        url = f"http://127.0.0.1:{gateway.port}{CHAT_PATH}"
        command = ["wrk", "-t1", f"-c{args.connections}", f"-d{args.duration}s", "--latency", "-s", WRK_CHAT, url]
        wrk = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(FAULT_AT_S)
        fault = inject(scenario, gateway)
        output, errors = wrk.communicate(timeout=args.duration + 30)
        if wrk.returncode != 0:
            raise RuntimeError(f"wrk failed ({wrk.returncode}): {errors.strip()}")
    finally:
        gateway.stop()
        shutil.rmtree(work_dir, ignore_errors=True)
    result = parse_wrk(output)
    breakdown = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output)
    result["socket_error_kinds"] = dict(zip(("connect", "read", "write", "timeout"),
                                            map(int, breakdown.groups()), strict=True)) if breakdown else {}
    result["failed"] = result["socket_errors"] + result["non_2xx"]
    result["command"] = " ".join(command)
    return {"tree": tree, "scenario": scenario, **result, **fault}


def render(runs: list[dict[str, Any]], trees: list[tuple[str, str]]) -> str:
    rows = []
    for scenario in SCENARIOS:
        for label, tree in trees:
            mine = [r for r in runs if r["scenario"] == scenario and r["tree"] == tree]
            if not mine:
                continue
            failed = [r["failed"] for r in mine]
            detail = ", ".join(f"{kind} {sum(r['socket_error_kinds'].get(kind, 0) for r in mine)}"
                               for kind in ("connect", "read", "write", "timeout"))
            detail += f", non-2xx {sum(r['non_2xx'] for r in mine)}"
            share = "-"
            if scenario == "kill":
                share = f"{statistics.mean(r['replacement_share'] for r in mine):.0%} (" + ", ".join(
                    f"{r['replacement_cpu_s']}/{r['survivor_cpu_s']}" for r in mine) + ")"
            rows.append((scenario, label, f"{statistics.mean(failed):.1f}", " ".join(map(str, failed)),
                         f"{statistics.mean(r.get('requests_per_s', 0) for r in mine):,.0f}",
                         f"{max(r.get('latency_p99_ms', 0) for r in mine):.1f}", share, detail))
    return markdown_table(("fault", "tree", "failed / fault (mean)", "per run", "req/s", "p99 ms (worst run)",
                           "replacement share (repl/survivor CPU-s)", "error kinds (all runs)"), rows)


def run(args: argparse.Namespace) -> int:
    if shutil.which("wrk") is None:
        print("bench_faults: wrk not found on PATH; skipping (apt-get install -y wrk)")
        return 0
    trees = [(label, os.path.abspath(path)) for label, _, path in (t.partition("=") for t in args.tree)]
    raise_fd_limit()
    mocks = [start_mock_provider_process(0, f"bench-{name}", tokens=16, models="demo-model") for name in "abc"]
    runs: list[dict[str, Any]] = []
    try:
        for round_number in range(1, args.rounds + 1):
            for scenario in args.scenarios:
                for label, tree in trees:
                    print(f"bench_faults: round {round_number} {scenario} {label}", file=sys.stderr)
                    runs.append({"round": round_number, **run_once(tree, scenario, mocks, args)})
                    print(f"  failed {runs[-1]['failed']} {json.dumps(runs[-1].get('socket_error_kinds'))}",
                          file=sys.stderr)
    finally:
        stop_all(mocks)
    table = render(runs, trees)
    command = "python -m loadtest.bench_faults " + " ".join(sys.argv[1:])
    stamp = timestamp()
    write_json(os.path.join(REPORTS_DIR, f"bench-faults-{stamp}.json"), {"command": command, "runs": runs})
    md_path = write_text(os.path.join(REPORTS_DIR, f"bench-faults-{stamp}.md"),
                         f"# Faults under keep-alive load\n\n`{command}`\n\n{table}\n")
    print(table)
    print(f"\nbench_faults: wrote {md_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_faults", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=int, default=10, help="seconds per wrk run (the fault comes at 2 s)")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--tree", action="append", metavar="LABEL=PATH",
                        help="a source tree to run the gateway from (repeatable; default: after=this checkout)")
    args = parser.parse_args(argv)
    args.tree = args.tree or [f"after={ROOT}"]
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
