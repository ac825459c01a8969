"""bench_features' figures, aggregated and rendered (pure): medians over rounds, per-round ratios to
the core variant, and the markdown table."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

from loadtest.report import markdown_table


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


Figures = Mapping[str, float]


def summarize_paired(windows: Mapping[str, Sequence[tuple[Figures, Figures]]], reference: str) -> dict[str, dict[str, Any]]:
    """`summarize_rounds` for paired windows: per variant, its (reference's figures, variant's figures) of each
    round's window, the two measured at the same time. Each ratio is taken within its window; the
    reference's own row is over all its windows (every ratio 1)."""
    summaries = {name: summarize_rounds({reference: [ref for ref, _ in pairs], name: [own for _, own in pairs]},
                                        reference)[name]
                 for name, pairs in windows.items()}
    every_reference_run = [ref for pairs in windows.values() for ref, _ in pairs]
    summaries[reference] = summarize_rounds({reference: every_reference_run}, reference)[reference]
    return summaries


def errors(runs: Sequence[Mapping[str, Any]]) -> int:
    """Non-2xx responses and socket errors over all rounds."""
    return sum(run["throughput"].get("non_2xx", 0) + run["throughput"].get("socket_errors", 0) for run in runs)


def overhead_ms(entry: Mapping[str, Any]) -> dict[str, float]:
    """The overhead run's percentiles: from the run alone after the rounds (paired) or the last round."""
    return (entry.get("alone") or entry["runs"][-1]).get("overhead_1conn", {}).get("overhead_ms", {})


SEQUENTIAL_HEADERS = ("variant (1 worker core)", "req/s, median", "worker CPU µs/req, median", "req/s per worker core",
                      "vs core, median of rounds", "vs core, range", "CPU µs/req per round",
                      "overhead p50 ms (last round)", "overhead p99 ms (last round)", "errors")
PAIRED_HEADERS = ("variant (beside the core on 1 worker core)", "vs core, median of rounds", "vs core, range",
                  "vs core per round", "worker CPU µs/req, median (2 gateways per core)",
                  "req/s, median (2 gateways per core)", "overhead p50 ms (alone)", "overhead p99 ms (alone)", "errors")


def sequential_row(entry: Mapping[str, Any]) -> tuple[str, ...]:
    s, over = entry["summary"], overhead_ms(entry)
    per_round = ", ".join(f"{run['throughput']['worker_cpu_us_per_request']:.0f}" for run in entry["runs"])
    return (f"{entry['index']}. {entry['variant']}", f"{s['requests_per_s_median']:,.0f}", f"{s['cpu_us_median']:.0f}",
            f"{1e6 / s['cpu_us_median']:,.0f}", f"{s['vs_core_median']:.1%}",
            f"{s['vs_core_min']:.1%}..{s['vs_core_max']:.1%}", per_round,
            f"{over.get('p50', 0):.3f}", f"{over.get('p99', 0):.3f}", str(errors(entry["runs"])))


def paired_row(entry: Mapping[str, Any], core: int) -> tuple[str, ...]:
    s, over = entry["summary"], overhead_ms(entry)
    reference = entry["index"] == core
    return (f"{entry['index']}. {entry['variant']}", f"{s['vs_core_median']:.1%}",
            "-" if reference else f"{s['vs_core_min']:.1%}..{s['vs_core_max']:.1%}",
            "-" if reference else ", ".join(f"{ratio:.1%}" for ratio in s["vs_core_per_round"]),
            f"{s['cpu_us_median']:.0f}", f"{s['requests_per_s_median']:,.0f}",
            f"{over.get('p50', 0):.3f}", f"{over.get('p99', 0):.3f}", str(errors(entry["runs"])))


def render(results: dict[str, Any], core: int) -> str:
    """The markdown table (one row per variant; ``core`` is the reference's index) and a warning if
    any run had errors."""
    wrk = f"wrk -t1 -c{results['connections']} for {results['duration_s']} s"
    if results["method"] == "paired":
        headers, row = PAIRED_HEADERS, partial(paired_row, core=core)
        intro = (f"{results['rounds']} rounds; in each, every variant ran at the same time as the core variant: two "
                 f"gateways of one worker each sharing cores {results['gateway_cpus'] or 'any'}, each under its own "
                 f"{wrk}, started together (wrk, mocks and Valkey on {results['load_cpus'] or 'any'}), and the "
                 "ratio is taken within that window. CPU µs/req and req/s are two-gateways-per-core figures "
                 "(higher than alone): only the ratio compares. The overhead at one connection is measured with "
                 "each gateway alone after the rounds; the core's errors count all its windows.")
    else:
        headers, row = SEQUENTIAL_HEADERS, sequential_row
        intro = (f"{results['rounds']} interleaved rounds of {wrk} per variant; worker pinned to cores "
                 f"{results['gateway_cpus'] or 'any'}, wrk, mocks and Valkey to {results['load_cpus'] or 'any'}.")
    text = f"{intro}\n\n{markdown_table(headers, [row(entry) for entry in results['variants']])}\n"
    failed = [entry["variant"] for entry in results["variants"] if errors(entry["runs"])]
    if failed:
        text += (f"\n**Errors in: {', '.join(failed)}.** Their CPU per request includes failed requests and is not "
                 "comparable.\n")
    return text
