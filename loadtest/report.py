"""Benchmark report helpers: percentiles, /proc memory, markdown, JSON and SVG plots.

Plots are SVG (hand-written, no plotting library): they carry axis labels and a legend, and any
browser or GitHub renders them.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Sequence
from typing import Any
from xml.sax.saxutils import escape

REPORTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reports")
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")


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
            "p99": percentile(ordered, 99), "max": ordered[-1] if ordered else 0.0}


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


def process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


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


# --------------------------------------------------------------------------------------------------
# SVG plots


def _nice_step(span: float, ticks: int = 5) -> float:
    raw = span / max(1, ticks)
    magnitude = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    for factor in (1, 2, 2.5, 5, 10):
        if raw <= factor * magnitude:
            return factor * magnitude
    return 10 * magnitude


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1000:
        return f"{value / 1000:g}k"
    return f"{value:g}"


class _Canvas:
    """Plot area with linear axes from (0, 0) to (x_max, y_max)."""

    WIDTH, HEIGHT, LEFT, RIGHT, TOP, BOTTOM = 720, 360, 70, 150, 40, 50

    def __init__(self, title: str, x_label: str, y_label: str, x_max: float, y_max: float) -> None:
        self.x_step = _nice_step(x_max or 1.0)
        self.y_step = _nice_step(y_max or 1.0)
        self.x_max = math.ceil((x_max or 1.0) / self.x_step) * self.x_step
        self.y_max = math.ceil((y_max or 1.0) / self.y_step) * self.y_step
        self.inner_w = self.WIDTH - self.LEFT - self.RIGHT
        self.inner_h = self.HEIGHT - self.TOP - self.BOTTOM
        self.parts = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.WIDTH}" height="{self.HEIGHT}" '
            f'font-family="sans-serif" font-size="12">',
            f'<rect width="{self.WIDTH}" height="{self.HEIGHT}" fill="white"/>',
            f'<text x="{self.WIDTH / 2}" y="22" text-anchor="middle" font-size="15">{escape(title)}</text>',
            f'<text x="{self.LEFT + self.inner_w / 2}" y="{self.HEIGHT - 10}" text-anchor="middle">'
            f"{escape(x_label)}</text>",
            f'<text transform="translate(16,{self.TOP + self.inner_h / 2}) rotate(-90)" text-anchor="middle">'
            f"{escape(y_label)}</text>",
        ]
        self._axes()

    def x(self, value: float) -> float:
        return self.LEFT + value / self.x_max * self.inner_w

    def y(self, value: float) -> float:
        return self.TOP + self.inner_h - value / self.y_max * self.inner_h

    def _axes(self) -> None:
        bottom, right = self.TOP + self.inner_h, self.LEFT + self.inner_w
        for i in range(int(round(self.y_max / self.y_step)) + 1):
            value = i * self.y_step
            y = self.y(value)
            self.parts.append(f'<line x1="{self.LEFT}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" stroke="#ddd"/>')
            self.parts.append(f'<text x="{self.LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{_fmt(value)}</text>')
        for i in range(int(round(self.x_max / self.x_step)) + 1):
            value = i * self.x_step
            x = self.x(value)
            self.parts.append(f'<line x1="{x:.1f}" y1="{bottom}" x2="{x:.1f}" y2="{bottom + 4}" stroke="#333"/>')
            self.parts.append(f'<text x="{x:.1f}" y="{bottom + 18}" text-anchor="middle">{_fmt(value)}</text>')
        self.parts.append(f'<polyline points="{self.LEFT},{self.TOP} {self.LEFT},{bottom} {right},{bottom}" '
                          'fill="none" stroke="#333"/>')

    def legend(self, index: int, label: str, colour: str) -> None:
        x, y = self.LEFT + self.inner_w + 12, self.TOP + 10 + index * 18
        self.parts.append(f'<rect x="{x}" y="{y - 9}" width="12" height="10" fill="{colour}"/>')
        self.parts.append(f'<text x="{x + 18}" y="{y}">{escape(label)}</text>')

    def svg(self) -> str:
        return "\n".join(self.parts + ["</svg>"]) + "\n"


def svg_line_chart(title: str, x_label: str, y_label: str,
                   series: dict[str, Sequence[tuple[float, float]]]) -> str:
    """Lines over a shared x axis; one legend entry per series."""
    points = [p for values in series.values() for p in values]
    canvas = _Canvas(title, x_label, y_label, max((p[0] for p in points), default=1.0),
                     max((p[1] for p in points), default=1.0))
    for index, (label, values) in enumerate(series.items()):
        colour = COLOURS[index % len(COLOURS)]
        path = " ".join(f"{canvas.x(x):.1f},{canvas.y(y):.1f}" for x, y in values)
        canvas.parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        canvas.legend(index, label, colour)
    return canvas.svg()


def svg_histogram(title: str, x_label: str, values: Sequence[float], bins: int = 40,
                  clip_percentile: float = 99.5) -> str:
    """Histogram of values; the long tail beyond `clip_percentile` is folded into the last bin."""
    ordered = sorted(values)
    top = percentile(ordered, clip_percentile) or 1.0
    width = top / bins
    counts = [0] * bins
    for value in ordered:
        counts[min(bins - 1, int(value / width))] += 1
    canvas = _Canvas(title, x_label, "requests", top, max(counts, default=1))
    for index, count in enumerate(counts):
        x0, x1 = canvas.x(index * width), canvas.x((index + 1) * width)
        y = canvas.y(count)
        canvas.parts.append(f'<rect x="{x0:.1f}" y="{y:.1f}" width="{max(0.5, x1 - x0 - 1):.1f}" '
                            f'height="{canvas.y(0) - y:.1f}" fill="{COLOURS[0]}"/>')
    summary = summarize(ordered)
    for index, key in enumerate(("p50", "p95", "p99")):
        canvas.legend(index, f"{key} {summary[key]:.3f}", COLOURS[index + 1])
        x = canvas.x(min(summary[key], top))
        canvas.parts.append(f'<line x1="{x:.1f}" y1="{canvas.TOP}" x2="{x:.1f}" y2="{canvas.y(0)}" '
                            f'stroke="{COLOURS[index + 1]}" stroke-dasharray="4 3"/>')
    return canvas.svg()
