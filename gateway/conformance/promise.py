"""What the picker promises each provider of a model's serving group: the share ``--load`` measures against.

Pure: the overlay snapshot and the routing config in, shares out. The promise follows the workers' own
rules (gateway.routing.plan): the first admitting selection group with a usable member serves; inside it
``deterministic`` gives everything to the first usable member, ``roundRobin`` and ``random`` give each
slot an equal share (a candidate listed twice is two slots, so twice the share), ``routing.picker:
weighted`` gives each slot its ``routing.models[].traffic_weight``, ``least_loaded`` spreads evenly over
equal providers. ``stable_hash`` and prefix affinity send the load's one repeated request to one provider
the hash chooses: they promise no split, and the share is reported without a verdict.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from gateway.config.routing import Routing
from gateway.overlay.contract import NEW_AND_EXISTING, Candidate
from gateway.overlay.snapshot import Snapshot
from gateway.routing.eligibility import FactsTable

SAMPLING_SIGMAS = 3  # a share within this many standard errors of its promise is sampling noise


@dataclass(frozen=True, slots=True)
class Promise:
    picker: str  # the mode that picks: the overlay's, or routing.picker
    shares: dict[str, float] | None  # cluster -> promised share; None: the picker promises no split


def serving_slots(snapshot: Snapshot, model: str, usable: Collection[str]) -> tuple[Candidate, ...]:
    """The slots new requests for ``model`` go to: the first admitting group with a usable member, its
    usable members in file order (ungrouped: the first usable admitting candidate alone)."""
    capability = snapshot.capability("inference_model", model)
    if capability is None:
        return ()
    if capability.grouped:
        for group in capability.groups:
            members = tuple(c for c in group.members if c.cluster in usable)
            if group.admission == NEW_AND_EXISTING and members:
                return members
        return ()
    first = next((c for c in capability.members if c.admission == NEW_AND_EXISTING and c.cluster in usable), None)
    return () if first is None else (first,)


def promise(snapshot: Snapshot, routing: Routing, model: str, usable: Collection[str]) -> Promise:
    """The share each usable provider of ``model`` is promised."""
    picker = snapshot.mode if routing.picker == "overlay" else routing.picker
    slots = serving_slots(snapshot, model, usable)
    if picker == "stable_hash" or routing.prefix_affinity.enabled:
        return Promise("prefix" if routing.prefix_affinity.enabled else picker, None)
    if not slots:
        return Promise(picker, {})
    if picker == "deterministic" or len(slots) == 1:
        return Promise(picker, {slots[0].cluster: 1.0})
    if picker == "least_loaded":
        clusters = list(dict.fromkeys(c.cluster for c in slots))
        return Promise(picker, {cluster: 1 / len(clusters) for cluster in clusters})
    facts = FactsTable(routing.models)
    weights: dict[str, float] = {}
    for slot in slots:
        weight = facts.facts(slot.name, slot.cluster).weight if picker == "weighted" else 1
        weights[slot.cluster] = weights.get(slot.cluster, 0) + weight
    total = sum(weights.values())
    return Promise(picker, {cluster: weight / total for cluster, weight in weights.items()})


def tolerance(promised: float, requests: int, base: float) -> float:
    """How far a measured share may be from ``promised`` over ``requests``: ``base`` plus the sampling
    error of a random picker's sample of that size."""
    return base + SAMPLING_SIGMAS * math.sqrt(promised * (1 - promised) / max(1, requests))


def judge(shares: Mapping[str, float], promised: Mapping[str, float], requests: int, base: float) -> list[str]:
    """The providers whose measured share is outside the tolerance of its promise, in words (empty: pass)."""
    misses = []
    for cluster in sorted(set(shares) | set(promised)):
        measured, wanted = shares.get(cluster, 0.0), promised.get(cluster, 0.0)
        allowed = tolerance(wanted, requests, base)
        if abs(measured - wanted) > allowed:
            misses.append(f"{cluster} {measured:.1%} against {wanted:.1%} (+-{allowed:.1%})")
    return misses
