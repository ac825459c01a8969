"""Observe providers: probe each health URL and scrape each Prometheus metrics URL.

This is the control plane's only network I/O. It returns plain data (one
:class:`~gateway.control.decide.Observation` per provider) for the pure
:mod:`gateway.control.decide`, and never raises for a provider that misbehaves: an
unreachable, slow or garbled provider is ``healthy=False`` with an ``error`` saying why.

HTTP goes through the one small probe client (gateway.health.probe), shared with
the gateway's endpoint health checks. Which gauges a page is read for, and how, is the
provider's signal plan (:mod:`gateway.control.signals`: presets, names and label filters
from the spec); a page that lacks a needed gauge is reported in ``Observation.missing``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

from gateway.control.decide import Observation  # the pure side owns the type it consumes
from gateway.control.signals import (
    KV_CACHE,
    QUEUE_DEPTH,
    READY_ENDPOINTS,
    SIGNAL_WORDS,
    SignalPlan,
    read_signals,
)
from gateway.control.spec import ControlSpec, Provider
from gateway.health.probe import ProbeError, http_get

# --------------------------------------------------------------------------- probes


async def probe_health(url: str, timeout_s: float) -> str | None:
    """None when ``GET url`` answers 2xx in time, else why not."""
    try:
        status, _ = await http_get(url, timeout_s)
    except ProbeError as exc:
        return f"health: {exc}"
    return None if 200 <= status < 300 else f"health: HTTP {status}"


def observation_from_page(text: str, plan: SignalPlan) -> Observation:
    """A healthy provider's observation from its metrics page (pure: the recorded-page tests use it)."""
    reading = read_signals(text, plan)
    missing = tuple(f"{SIGNAL_WORDS[signal]}: {why}" for signal, why in reading.missing)
    error = f"metrics: {'; '.join(missing)}" if missing else None
    return Observation(True, reading.value(QUEUE_DEPTH), reading.value(KV_CACHE), error,
                       ready_endpoints=reading.value(READY_ENDPOINTS),
                       missing=tuple(signal for signal, _ in reading.missing))


async def scrape_metrics(url: str, timeout_s: float, plan: SignalPlan) -> Observation:
    """The page at ``url`` read by ``plan``; an unreadable page is healthy with every signal missing."""
    try:
        status, body = await http_get(url, timeout_s)
    except ProbeError as exc:
        return _unreadable(plan, f"metrics: {exc}")
    if status != 200:
        return _unreadable(plan, f"metrics: HTTP {status}")
    return observation_from_page(body.decode("utf-8", "replace"), plan)


def _unreadable(plan: SignalPlan, error: str) -> Observation:
    return Observation(True, error=error, missing=tuple(signal for signal, _ in plan.signals))


async def observe_provider(provider: Provider, timeout_s: float, plan: SignalPlan | None) -> Observation:
    """Health and (with a plan) metrics of one provider, concurrently."""
    try:
        if plan is None or not provider.metrics_url:
            error = await probe_health(provider.health_url, timeout_s)
            return Observation(healthy=error is None, error=error)
        health_error, scraped = await asyncio.gather(
            probe_health(provider.health_url, timeout_s), scrape_metrics(provider.metrics_url, timeout_s, plan)
        )
    except Exception as exc:  # noqa: BLE001 - a probe bug must mark one provider down, not stop the loop
        return Observation(healthy=False, error=f"probe failed: {type(exc).__name__}: {exc}")
    if health_error is not None:
        return Observation(healthy=False, error=health_error)
    return scraped


def signal_plans(spec: ControlSpec) -> dict[str, SignalPlan]:
    """Each provider's signal plan, by name; none when the scoring policy reads no metrics."""
    if not spec.scoring_policy.uses_metrics():
        return {}
    return {provider.name: spec.signal_plan(provider) for provider in spec.providers}


async def observe_all(providers: Sequence[Provider], timeout_s: float,
                      plans: Mapping[str, SignalPlan]) -> dict[str, Observation]:
    """One observation per provider name, all probed concurrently (metrics only for providers with a plan)."""
    results = await asyncio.gather(*(observe_provider(p, timeout_s, plans.get(p.name)) for p in providers))
    return {provider.name: result for provider, result in zip(providers, results, strict=True)}
