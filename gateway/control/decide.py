"""Decide the routing overlay from the catalogue and what was observed. Pure.

Input: the spec, one :class:`Observation` per provider (from :mod:`gateway.control.observe`),
and the previous :class:`Hold` per provider (for ``stabilized`` admission). Output:
a :class:`Decision` holding the overlay document (docs/overlay.md#formats) and the new holds.
No clock, no I/O: the same inputs always give the same document, byte for byte
once canonicalized, hence the same semantic revision.

The algorithm, per provider, then per capability:

1. **Assess** the observation into what gets published (:class:`Assessment`):

   - unreachable or health not 2xx -> admission ``none``, ``fresh: false``,
     ``score: null``; likewise a provider that failed a required conformance check (spec
     ``conformance``), published with ``excluded_reason: nonconformant``; likewise a metrics page that counts 0 ready endpoints (llm-d's
     EPP: the pool behind a healthy picker has nothing to serve with);
   - ``noMetrics``: healthy -> ``new_and_existing``, score 0;
   - ``queueDepth`` / ``kvCachePressure``: a metric above its threshold (queue depth >
     ``queueDepthThreshold``, KV-cache > ``kvCacheThreshold``) -> ``existing_only``:
     bound sessions finish, new ones go elsewhere; otherwise ``new_and_existing``.
     The score is the strategy metric's *pressure* (value / threshold), quantized
     down to ``scoreBands`` steps and capped at 1.0, so 0.9/0.9 and 2.0/0.9 both
     score 1.0 and jitter inside a band changes nothing. ``score_breakdown`` holds
     the quantized pressure of every checked metric. A healthy provider whose
     needed gauges could not be scraped keeps its health-based admission but is
     ``fresh: false`` and, without its strategy metric, ``score: null`` (ranked after
     every measured provider of its admission).

2. **Stabilize** (``admission.mode``): ``instantaneous`` publishes each assessment at
   once. ``stabilized`` changes a provider's published assessment only after
   ``admission.observations`` consecutive rounds agree on the same new one; any
   other observation restarts the count. Admission, score band and freshness all
   move together, so neither admission nor scores flap.

3. **Group** the providers offering each capability ``(kind, model)``. Groups split
   only on what the Grid contract lets them split on: locality tier (under
   ``geographyFirst`` only), admission (``new_and_existing``, ``existing_only``,
   ``none``) and freshness (fresh before stale), in that order of precedence
   (``scoreFirst``: admission, then freshness). A score never splits otherwise
   equivalent providers: it is no traffic ratio, and a group per score band would
   send every new session to the one least-loaded provider and move all of it at
   the next load change (herding). Pressure still acts through admission: a metric
   above its threshold makes a provider ``existing_only``, which is a group of its own.

4. **Order** inside a group by score band (lower first; unmeasured last), then
   locality (``scoreFirst``: the local site breaks ties), then provider name, so
   equal inputs always give one order. Groups are numbered 0, 1, ... in file
   order, so per capability every candidate is grouped, groups start at 0, are
   contiguous and non-decreasing, and each has one admission state: exactly the
   rules of docs/overlay.md#selection-groups. The data plane walks the groups and spreads new sessions
   inside the first ``new_and_existing`` one by ``selectionPolicy.mode``; the
   score order inside it decides only who is first (``deterministic``) and stays
   visible in ``rank``, ``score`` and ``score_breakdown``.

Each candidate carries ``rank`` (its index in the capability), ``selection_group``,
``selection_tier`` (0 at ``scope.local_site``, 1 elsewhere), the default
``stable_id`` ``kind/model/site/cluster``, ``fresh``, ``score`` (lower is better) and
``score_breakdown``, plus the provider's credential reference when it has one. The document
carries ``selection_policy`` only when the spec has a ``selectionPolicy`` (docs/control-plane.md): an
omitted policy stays omitted, so the semantic revision is the one Grid would compute.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.control.spec import GEOGRAPHY_FIRST, KV_CACHE_PRESSURE, NO_METRICS, ControlSpec, Provider
from gateway.overlay.contract import ADMISSION_NONE, EXISTING_ONLY, NEW_AND_EXISTING

NONCONFORMANT = "nonconformant"  # the candidate's excluded_reason (docs/provider-conformance.md)
ADMISSION_ORDER = {NEW_AND_EXISTING: 0, EXISTING_ONLY: 1, ADMISSION_NONE: 2}
_EPSILON = 1e-9  # 0.45 / 0.9 is 0.49999999999999994 in binary; a band edge must not depend on that


@dataclass(frozen=True, slots=True)
class Observation:
    """What one probe round saw of one provider (made by :mod:`gateway.control.observe`).

    ``None`` metrics were not measured; ``error`` says why something is missing or unhealthy, and
    ``missing`` names the signals the page lacked (gateway.control.signals names).
    """

    healthy: bool
    queue_depth: float | None = None
    kv_cache_utilization: float | None = None
    error: str | None = None
    ready_endpoints: float | None = None
    missing: tuple[str, ...] = ()
    nonconformant: tuple[str, ...] = ()  # required conformance checks it failed (spec ``conformance``)


@dataclass(frozen=True, slots=True)
class Assessment:
    """One provider's published routing state. ``reason`` explains it and is not compared."""

    admission: str
    band: int  # position in the score order: 0..score_bands measured, score_bands + 1 unmeasured
    score: float | None
    breakdown: tuple[tuple[str, float], ...]
    fresh: bool
    reason: str = field(default="", compare=False)
    excluded_reason: str | None = None  # published with admission none: why (``nonconformant``)

    def describe(self) -> str:
        score = "null" if self.score is None else f"{self.score:g}"
        return f"{self.admission} score={score}{'' if self.fresh else ' stale'}"


@dataclass(frozen=True, slots=True)
class Hold:
    """Stabilization memory: what is published, and the streak of a different assessment."""

    published: Assessment
    pending: Assessment | None = None
    streak: int = 0


@dataclass(frozen=True)
class Decision:
    document: dict[str, Any]  # the overlay document, without timestamps
    holds: dict[str, Hold]  # per provider name; pass back into the next decide()

    @property
    def published(self) -> dict[str, Assessment]:
        """What is published per provider name."""
        return {name: hold.published for name, hold in self.holds.items()}


# --------------------------------------------------------------------------- 1. assess


def _quantized_pressure(value: float, threshold: float, bands: int) -> int:
    """The band of value/threshold: 0..bands, bands meaning at or above the threshold."""
    return max(0, min(bands, math.floor(value / threshold * bands + _EPSILON)))


def assess(spec: ControlSpec, observation: Observation | None) -> Assessment:
    """What to publish for one provider given one observation (None: not observed)."""
    scoring = spec.scoring_policy
    bands = scoring.score_bands
    unmeasured = bands + 1
    if observation is None:
        return Assessment(ADMISSION_NONE, unmeasured, None, (), False, "not observed")
    if not observation.healthy:
        return Assessment(ADMISSION_NONE, unmeasured, None, (), False, observation.error or "unhealthy")
    if observation.nonconformant:
        return Assessment(ADMISSION_NONE, unmeasured, None, (), False,
                          "nonconformant: failed " + ", ".join(observation.nonconformant), NONCONFORMANT)
    if scoring.strategy == NO_METRICS:
        return Assessment(NEW_AND_EXISTING, 0, 0.0, (), True, "healthy")
    if observation.ready_endpoints is not None and observation.ready_endpoints < 1:
        return Assessment(ADMISSION_NONE, unmeasured, None, (), False, "0 ready endpoints")

    checks = (
        ("queue_depth", observation.queue_depth, scoring.effective_queue_depth_threshold()),
        ("kv_cache", observation.kv_cache_utilization, scoring.effective_kv_cache_threshold()),
    )
    breakdown: list[tuple[str, float]] = []
    pressure: list[str] = []
    fresh = True
    strategy_metric = "kv_cache" if scoring.strategy == KV_CACHE_PRESSURE else "queue_depth"
    strategy_band: int | None = None
    for metric, value, threshold in checks:
        if threshold is None:
            continue
        if value is None:
            fresh = False
            continue
        band = _quantized_pressure(value, threshold, bands)
        breakdown.append((f"{metric}_pressure", round(band / bands, 6)))
        if value > threshold:
            pressure.append(f"{metric.replace('_', ' ')} {value:g} > {threshold:g}")
        if metric == strategy_metric:
            strategy_band = band
    admission = EXISTING_ONLY if pressure else NEW_AND_EXISTING
    reason = "; ".join(pressure) or observation.error or "healthy"
    if strategy_band is None:
        return Assessment(admission, unmeasured, None, tuple(breakdown), False, reason)
    return Assessment(admission, strategy_band, round(strategy_band / bands, 6), tuple(breakdown), fresh, reason)


# --------------------------------------------------------------------------- 2. stabilize


def stabilize(observed: Assessment, hold: Hold | None, required: int) -> Hold:
    """Publish ``observed`` once it was seen ``required`` rounds in a row (the first round: at once)."""
    if hold is None or observed == hold.published:
        return Hold(observed)  # equal to what is published, maybe with a fresher reason
    streak = hold.streak + 1 if observed == hold.pending else 1
    if streak >= required:
        return Hold(observed)
    return Hold(hold.published, observed, streak)


# --------------------------------------------------------------------------- 3-4. group and order


def locality_tier(spec: ControlSpec, provider: Provider) -> int:
    return 0 if provider.site == spec.scope.local_site else 1


def group_key(spec: ControlSpec, provider: Provider, assessment: Assessment) -> tuple[int, ...]:
    """Providers of one capability with equal keys share a selection group. No score in here."""
    admission = ADMISSION_ORDER[assessment.admission]
    stale = 0 if assessment.fresh else 1
    if spec.routing_policy == GEOGRAPHY_FIRST:
        return (locality_tier(spec, provider), admission, stale)
    return (admission, stale)


def _order_key(spec: ControlSpec, provider: Provider, assessment: Assessment) -> tuple[Any, ...]:
    return (*group_key(spec, provider, assessment), assessment.band, locality_tier(spec, provider), provider.name)


def _candidate(spec: ControlSpec, provider: Provider, model: str, assessment: Assessment,
               rank: int, group: int) -> dict[str, Any]:
    candidate: dict[str, Any] = {
        "kind": provider.kind,
        "name": model,
        "site": provider.site,
        "cluster": provider.cluster_name,
        "fresh": assessment.fresh,
        "admission_state": assessment.admission,
        "rank": rank,
        "selection_group": group,
        "selection_tier": locality_tier(spec, provider),
        "stable_id": provider.stable_id(model),
        "score": assessment.score,
        "score_breakdown": dict(assessment.breakdown),
    }
    if provider.credential is not None:
        candidate["credential"] = provider.credential.as_dict()
    if assessment.excluded_reason is not None:
        candidate["excluded_reason"] = assessment.excluded_reason  # additive: overlay-v1 readers ignore it
    return candidate


def render_document(spec: ControlSpec, published: Mapping[str, Assessment]) -> dict[str, Any]:
    """The overlay document for these per-provider assessments (capabilities sorted by kind, name)."""
    offering: dict[tuple[str, str], list[Provider]] = {}
    for provider in spec.providers:
        for model in dict.fromkeys(provider.models):
            offering.setdefault((provider.kind, model), []).append(provider)
    candidates: list[dict[str, Any]] = []
    for (_, model), providers in sorted(offering.items()):
        ordered = sorted(providers, key=lambda p: _order_key(spec, p, published[p.name]))
        group, previous = -1, None
        for rank, provider in enumerate(ordered):
            key = group_key(spec, provider, published[provider.name])
            if key != previous:
                group, previous = group + 1, key
            candidates.append(_candidate(spec, provider, model, published[provider.name], rank, group))
    document: dict[str, Any] = {"network": spec.scope.network, "local_site": spec.scope.local_site}
    if spec.selection_policy is not None:
        document["selection_policy"] = {"mode": spec.selection_policy.mode}
    document["candidates"] = candidates
    return document


# --------------------------------------------------------------------------- entry points


def decide(spec: ControlSpec, observations: Mapping[str, Observation],
           holds: Mapping[str, Hold] | None = None) -> Decision:
    """One round: assess, stabilize against ``holds``, render. A provider missing from
    ``observations`` is ``none``."""
    previous = holds or {}
    required = spec.admission.required_observations()
    new_holds = {
        p.name: stabilize(assess(spec, observations.get(p.name)), previous.get(p.name), required)
        for p in spec.providers
    }
    published = {name: hold.published for name, hold in new_holds.items()}
    return Decision(render_document(spec, published), new_holds)


def describe_changes(before: Mapping[str, Assessment], after: Mapping[str, Assessment]) -> list[str]:
    """One ``provider: old -> new (reason)`` line per provider whose published state changed."""
    lines = []
    for name, new in after.items():
        old = before.get(name)
        if old != new:
            was = "unknown" if old is None else old.describe()
            lines.append(f"{name}: {was} -> {new.describe()} ({new.reason})")
    return lines
