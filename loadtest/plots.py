"""Benchmark plots with matplotlib, written as SVG (text kept as text, stable ids: diff-friendly).

One figure per scenario, three panels over a shared time axis: throughput per request kind, latency
percentile bands (p50 line, p50-p90 and p90-p99 bands; log scale when they span a decade), and failures per second; scenario
events (a burst starting, a provider killed) are dashed vertical lines across all panels.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")  # no display: files only

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullFormatter, ScalarFormatter  # noqa: E402

from loadtest.report import Bin  # noqa: E402

SVG_STYLE = {
    "svg.fonttype": "none",  # real text in the SVG: smaller, searchable, crisp
    "svg.hashsalt": "gridgate",  # stable element ids from run to run
    "font.size": 9,
    "axes.grid": True,
    "grid.alpha": 0.3,
}
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")


def _series(bins: Sequence[Bin], p: float) -> list[float]:
    """The percentile per bin; NaN where no request succeeded (a gap in the line, not a zero)."""
    values = []
    for cell in bins:
        value = cell.percentile(p)
        values.append(float("nan") if value is None else max(value, 0.001))
    return values


def _latency_scale(axis: plt.Axes, values: Sequence[float]) -> None:
    """Log scale when the latencies span more than a decade (long streams beside short requests)."""
    finite = [v for v in values if v == v]  # NaN marks bins without a success
    if finite and max(finite) / min(finite) > 10:
        axis.set_yscale("log")
        axis.yaxis.set_major_formatter(ScalarFormatter())
        axis.yaxis.set_minor_formatter(NullFormatter())
        axis.set_ylabel("latency ms (log scale)")
    else:
        axis.set_ylim(bottom=0)
        axis.set_ylabel("latency ms")


def timeline_svg(path: str, title: str, kinds: dict[str, Sequence[Bin]],
                 events: Sequence[tuple[float, str]] = (), width_s: float = 1.0) -> str:
    """Throughput, latency bands and failures over time for each request kind; the path written."""
    with plt.rc_context(SVG_STYLE):
        figure, (rate, latency, errors) = plt.subplots(3, 1, sharex=True, figsize=(9, 7.5),
                                                       gridspec_kw={"height_ratios": [1, 1.6, 0.8]})
        plotted: list[float] = []
        for index, (name, bins) in enumerate(kinds.items()):
            colour = COLOURS[index % len(COLOURS)]
            x = [cell.start_s + width_s / 2 for cell in bins]
            rate.plot(x, [cell.count / width_s for cell in bins], color=colour, lw=1.4, label=name)
            p50, p90, p99 = _series(bins, 50), _series(bins, 90), _series(bins, 99)
            plotted += p50 + p99
            latency.fill_between(x, p50, p90, color=colour, alpha=0.25, lw=0)
            latency.fill_between(x, p90, p99, color=colour, alpha=0.1, lw=0)
            latency.plot(x, p50, color=colour, lw=1.4, marker=".", ms=3, label=f"{name} p50 (bands to p90, p99)")
            latency.plot(x, p99, color=colour, lw=0.6, ls=":")
            errors.plot(x, [cell.failures / width_s for cell in bins], color=colour, lw=1.4, label=name)
        rate.set_ylabel("completed requests/s")
        rate.set_ylim(bottom=0)
        _latency_scale(latency, plotted)
        errors.set_ylabel("failures/s")
        errors.set_ylim(bottom=0, top=max(1.0, errors.get_ylim()[1]))
        errors.set_xlabel("seconds since the load started")
        for axis in (rate, latency, errors):
            for at, _ in events:
                axis.axvline(at, color="#555", ls="--", lw=0.9)
        for at, label in events:
            rate.annotate(label, (at, 1.0), xycoords=("data", "axes fraction"), xytext=(3, -10),
                          textcoords="offset points", fontsize=8, color="#333",
                          bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.8})
        rate.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
        latency.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
        rate.set_title(title)
        figure.tight_layout()
        figure.savefig(path, format="svg", metadata={"Date": None})
        plt.close(figure)
    return path
