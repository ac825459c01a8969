"""Observe providers: probe each health URL and scrape each Prometheus metrics URL.

This is the control plane's only network I/O. It returns plain data (one
:class:`~gateway.control.decide.Observation` per provider) for the pure
:mod:`gateway.control.decide`, and never raises for a provider that misbehaves: an
unreachable, slow or garbled provider is ``healthy=False`` with an ``error`` saying why.

HTTP goes through the one small probe client (gateway.health.probe), shared with
the gateway's endpoint health checks.
Metrics pages are read with ``prometheus_client``'s text parser, for the gauges needed,
under the mock provider's names and vLLM's:

- queue depth: ``mock_queue_depth``, else ``vllm:num_requests_running`` +
  ``vllm:num_requests_waiting`` (summed over all series, e.g. one per model);
- KV-cache utilisation (0..1): ``mock_kv_cache_utilization``, else
  ``vllm:gpu_cache_usage_perc`` or ``vllm:kv_cache_usage_perc`` (the highest series).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable, Sequence

from prometheus_client.parser import text_string_to_metric_families

from gateway.control.decide import Observation  # the pure side owns the type it consumes
from gateway.control.spec import Provider
from gateway.health.probe import ProbeError, http_get

MOCK_QUEUE_DEPTH = "mock_queue_depth"
VLLM_QUEUE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
KV_CACHE_GAUGES = ("mock_kv_cache_utilization", "vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc")
_WANTED = frozenset((MOCK_QUEUE_DEPTH, *VLLM_QUEUE_GAUGES, *KV_CACHE_GAUGES))


# --------------------------------------------------------------------------- Prometheus text


def parse_gauges(text: str, names: Iterable[str] = _WANTED) -> dict[str, list[float]]:
    """Every finite sample of the named metrics, in page order (one value per label set).

    Parsed by ``prometheus_client``'s parser, line by line over the lines that can hold a wanted
    sample: one garbled line elsewhere on a provider's page (or among them) costs only that line,
    not the page, and a large page (vLLM's histograms) is not parsed whole for a few gauges.
    """
    wanted = frozenset(names)
    prefixes = tuple(wanted)
    found: dict[str, list[float]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line.startswith(prefixes):
            continue
        try:
            families = list(text_string_to_metric_families(line + "\n"))
        except ValueError:
            continue
        for family in families:
            for sample in family.samples:
                if sample.name in wanted and math.isfinite(sample.value):
                    found.setdefault(sample.name, []).append(float(sample.value))
    return found


def queue_depth_from(gauges: dict[str, list[float]]) -> float | None:
    if MOCK_QUEUE_DEPTH in gauges:
        return sum(gauges[MOCK_QUEUE_DEPTH])
    present = [name for name in VLLM_QUEUE_GAUGES if name in gauges]
    return sum(sum(gauges[name]) for name in present) if present else None


def kv_cache_from(gauges: dict[str, list[float]]) -> float | None:
    for name in KV_CACHE_GAUGES:
        if name in gauges:
            return max(gauges[name])
    return None


# --------------------------------------------------------------------------- probes


async def probe_health(url: str, timeout_s: float) -> str | None:
    """None when ``GET url`` answers 2xx in time, else why not."""
    try:
        status, _ = await http_get(url, timeout_s)
    except ProbeError as exc:
        return f"health: {exc}"
    return None if 200 <= status < 300 else f"health: HTTP {status}"


async def scrape_metrics(url: str, timeout_s: float) -> tuple[float | None, float | None, str | None]:
    """(queue depth, KV-cache utilisation, error); a gauge the page lacks is None."""
    try:
        status, body = await http_get(url, timeout_s)
    except ProbeError as exc:
        return None, None, f"metrics: {exc}"
    if status != 200:
        return None, None, f"metrics: HTTP {status}"
    gauges = parse_gauges(body.decode("utf-8", "replace"))
    queue_depth, kv_cache = queue_depth_from(gauges), kv_cache_from(gauges)
    missing = [label for label, value in (("queue-depth", queue_depth), ("KV-cache", kv_cache)) if value is None]
    error = f"metrics: no {' or '.join(missing)} gauge" if missing else None
    return queue_depth, kv_cache, error


async def observe_provider(provider: Provider, timeout_s: float, with_metrics: bool) -> Observation:
    """Health and (optionally) metrics of one provider, concurrently."""
    try:
        if not (with_metrics and provider.metrics_url):
            error = await probe_health(provider.health_url, timeout_s)
            return Observation(healthy=error is None, error=error)
        health_error, (queue_depth, kv_cache, metrics_error) = await asyncio.gather(
            probe_health(provider.health_url, timeout_s), scrape_metrics(provider.metrics_url, timeout_s)
        )
    except Exception as exc:  # noqa: BLE001 - a probe bug must mark one provider down, not stop the loop
        return Observation(healthy=False, error=f"probe failed: {type(exc).__name__}: {exc}")
    if health_error is not None:
        return Observation(healthy=False, error=health_error)
    return Observation(True, queue_depth, kv_cache, metrics_error)


async def observe_all(providers: Sequence[Provider], timeout_s: float, with_metrics: bool) -> dict[str, Observation]:
    """One observation per provider name, all probed concurrently."""
    results = await asyncio.gather(*(observe_provider(p, timeout_s, with_metrics) for p in providers))
    return {provider.name: result for provider, result in zip(providers, results, strict=True)}
