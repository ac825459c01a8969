"""Benchmark report helpers: percentiles, time bins, /proc readings, markdown and JSON output.

Plots are drawn by loadtest/plots.py (matplotlib); everything here is plain data.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.interpreter import interpreter_build

REPORTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reports")


# --------------------------------------------------------------------------------------------------
# Numbers


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of already sorted values (0 for none)."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(p / 100.0 * len(sorted_values)))
    return float(sorted_values[min(rank, len(sorted_values)) - 1])


def summarize(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"n": len(ordered), "p50": percentile(ordered, 50), "p95": percentile(ordered, 95),
            "p99": percentile(ordered, 99), "p999": percentile(ordered, 99.9), "max": ordered[-1] if ordered else 0.0}


@dataclass
class Bin:
    """Requests that completed in one time bin: how many, how many failed, latency percentiles."""

    start_s: float
    count: int = 0
    failures: int = 0
    latencies_ms: list[float] = field(default_factory=list)

    def percentile(self, p: float) -> float | None:
        return percentile(sorted(self.latencies_ms), p) if self.latencies_ms else None


def time_bins(samples: Sequence[tuple[float, float, bool]], start: float, end: float,
              width_s: float = 1.0) -> list[Bin]:
    """(completion time, latency ms, ok) samples grouped into bins of `width_s` from `start` to `end`.

    Latency percentiles are over successful requests only: a fast refusal must not look like speed.
    """
    bins = [Bin(round(i * width_s, 6)) for i in range(max(1, math.ceil((end - start) / width_s)))]
    for at, latency_ms, ok in samples:
        index = int((at - start) // width_s)
        if 0 <= index < len(bins):
            cell = bins[index]
            cell.count += 1
            if ok:
                cell.latencies_ms.append(latency_ms)
            else:
                cell.failures += 1
    return bins


# --------------------------------------------------------------------------------------------------
# Processes


def rss_kib(pid: int) -> int | None:
    """Resident set size of a process in KiB, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def child_pids(parent: int) -> list[int]:
    """Direct children of a process, by scanning /proc (works without CONFIG_PROC_CHILDREN)."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                # The command name may contain spaces and parentheses: split after the last ')'.
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == parent:
            children.append(int(entry))
    return sorted(children)


def cpu_times() -> dict[int, tuple[int, int]]:
    """Per core (busy, total) jiffies from /proc/stat."""
    times = {}
    with open("/proc/stat") as stat:
        for line in stat:
            name, *fields = line.split()
            if name.startswith("cpu") and name != "cpu":
                values = [int(v) for v in fields[:8]]
                idle = values[3] + values[4]  # idle + iowait
                times[int(name[3:])] = (sum(values) - idle, sum(values))
    return times


def core_busy_percent(before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]]) -> dict[int, float]:
    """Busy share of each core between two cpu_times() readings."""
    busy = {}
    for core, (busy_after, total_after) in after.items():
        busy_before, total_before = before.get(core, (0, 0))
        busy[core] = round(100.0 * (busy_after - busy_before) / max(1, total_after - total_before), 1)
    return busy


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used so far (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------------------------------
# Text output


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:,.2f}" if abs(value) >= 100 else f"{value:.3f}"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def timestamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def write_text(path: str, text: str) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as out:
        out.write(text)
    return path


def write_json(path: str, data: Any) -> str:
    return write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def invocation(module: str) -> str:
    """How this benchmark was started, for its report: ``python -m <module>`` and the arguments given."""
    return " ".join(["python -m", module, *sys.argv[1:]])


def write_report(name: str, results: Any, title: str, command: str, text: str) -> None:
    """``loadtest/reports/<name>-<time>.{json,md}``: the raw results, and the table under its title and
    the command that made it, under the interpreter the gateways ran on (also added to ``results`` when it
    is a dict); prints the table and where both went."""
    stamp = timestamp()
    # The gateways run on this interpreter, whose build moves every figure (docs/operations.md).
    build = interpreter_build()
    if isinstance(results, dict):
        results.setdefault("interpreter", build.as_dict())
    json_path = write_json(os.path.join(REPORTS_DIR, f"{name}-{stamp}.json"), results)
    md_path = write_text(os.path.join(REPORTS_DIR, f"{name}-{stamp}.md"),
                         f"# {title}\n\n`{command}`\n\nPython {build.version} ({build.executable}, {build.kind})\n\n{text}")
    print(text)
    print(f"{name.replace('-', '_')}: wrote {json_path} and {md_path}")


def run_bench(name: str, run: Callable[[Any], int], args: Any) -> int:
    """A benchmark's exit status: ``run(args)``'s, or 1 with one line naming the failure (a non-2xx
    answer, a process that did not start) instead of a traceback."""
    try:
        return run(args)
    except RuntimeError as exc:
        print(f"{name}: FAILED: {exc}", file=sys.stderr)
        return 1
