"""Routing state of one capability for one overlay revision in one worker: its admitting selection
groups, each with its options (candidate + provider + prebuilt decisions) and its picker state.

Built on the capability's first request after a revision change (or in ``Router.prepare``), so
adopting a snapshot costs nothing up front and a capability costs O(its members) once.

A group picks among the options a caller deems usable (``usable(option) -> bool``: configured,
not cooled, has a routable endpoint, not tried yet, eligible for the request). The overlay's modes:
``deterministic`` (first usable in file order), ``roundRobin`` (rotation, skipping the unusable),
``random`` (uniform over the usable). ``routing.picker`` may choose instead
(docs/routing.md#which-picker-and-balancer-when): ``weighted`` (smooth weighted round robin by
``traffic_weight``, exact over a cycle), ``stable_hash`` (rendezvous hashing of the request's key: a
key keeps its provider while the group is unchanged, and retries keep their exclusions),
``least_loaded`` (power of two choices on load x expected first-byte latency, an unmeasured or
long-idle provider expected at the group's prior: gateway.routing.providers).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import NamedTuple

import xxhash

from gateway.http.errors import ErrorReply
from gateway.overlay.contract import NEW_AND_EXISTING, Candidate
from gateway.overlay.snapshot import Capability, Snapshot
from gateway.routing.decision import AFFINITY_OUTCOMES, header_value
from gateway.routing.eligibility import UNRESTRICTED, Facts, FactsTable
from gateway.routing.prefix import PrefixEntry, PrefixTable
from gateway.routing.providers import LoadCost

DETERMINISTIC, ROUND_ROBIN, RANDOM, WEIGHTED, STABLE_HASH, LEAST_LOADED = range(6)
MODES = {"deterministic": DETERMINISTIC, "roundRobin": ROUND_ROBIN, "random": RANDOM, "weighted": WEIGHTED,
         "stable_hash": STABLE_HASH, "least_loaded": LEAST_LOADED}
_xxh3 = xxhash.xxh3_64_intdigest
PREFIX_MODE = "prefix"  # the selection mode of a pick by prefix affinity (docs/routing.md)


class RouteDecision(NamedTuple):
    """The chosen candidate, its provider and the evidence the proxy reports. Immutable.

    ``evidence`` is the prebuilt ``x-gridgate-*`` header list (provider, stable id, selection group,
    mode, overlay revision, affinity, and ``x-gridgate-filtered`` when filters removed candidates); the
    proxy adds attempts, overhead and request id. ``stable_id_header`` is the stable id as a header value
    (the provider-hop candidate header). ``selection_group`` is None for an ungrouped capability (its
    header value is ``none``). ``provider`` is the provider's index in the worker's provider table (-1:
    not configured here). ``filtered``: candidates the request's eligibility filters removed;
    ``filtered_reasons``: why (``gateway.routing.eligibility`` reason bits, or-ed).
    """

    candidate: Candidate
    cluster: str
    stable_id: str
    selection_group: int | None
    mode: str
    revision: str
    affinity: str
    outcome: int
    evidence: tuple[tuple[bytes, bytes], ...]
    provider: int
    plan: CapabilityPlan
    stable_id_header: bytes
    filtered: int = 0
    filtered_reasons: int = 0


def with_filtered(decision: RouteDecision, filtered: int, reasons: int) -> RouteDecision:
    """``decision`` for a request whose filters removed ``filtered`` candidates (for ``reasons``): the
    count travels in the decision and in its evidence (``x-gridgate-filtered``)."""
    return decision._replace(filtered=filtered, filtered_reasons=reasons,
                             evidence=(*decision.evidence, (b"x-gridgate-filtered", b"%d" % filtered)))


def route_decision(
    candidate: Candidate, provider: int, plan: CapabilityPlan, selection_group: int | None, mode: str,
    revision: str, outcome: int,
) -> RouteDecision:
    affinity = AFFINITY_OUTCOMES[outcome]
    stable_id = header_value(candidate.stable_id)
    evidence = (
        (b"x-gridgate-provider", header_value(candidate.cluster)),
        (b"x-gridgate-stable-id", stable_id),
        (b"x-gridgate-selection-group", b"none" if selection_group is None else b"%d" % selection_group),
        (b"x-gridgate-selection-mode", mode.encode()),
        (b"x-gridgate-overlay-revision", revision.encode()),
        (b"x-gridgate-affinity", affinity.encode()),
    )
    return RouteDecision(candidate, candidate.cluster, candidate.stable_id, selection_group, mode, revision, affinity,
                         outcome, evidence, provider, plan, stable_id)


class Option:
    """One candidate slot of a group: its provider index, facts and a prebuilt decision per affinity outcome."""

    __slots__ = ("candidate", "provider", "decisions", "facts", "seed", "prefix_decisions")

    def __init__(self, candidate: Candidate, provider: int, decisions: tuple[RouteDecision, ...],
                 facts: Facts, prefix_decisions: tuple[RouteDecision, ...] | None = None) -> None:
        self.candidate = candidate
        self.provider = provider  # -1: the cluster is not configured on this gateway (never selected)
        self.decisions = decisions
        self.facts = facts
        self.seed = candidate.stable_id_hash  # rendezvous hashing: the option's half of the score
        # Chosen by prefix affinity (selection mode ``prefix``); the same as ``decisions`` when it is off.
        self.prefix_decisions = decisions if prefix_decisions is None else prefix_decisions

    def __repr__(self) -> str:
        return f"Option({self.candidate.cluster}, provider={self.provider})"


Usable = Callable[[Option], bool]
Cost = LoadCost  # least_loaded: (provider, the group's prior) -> load x expected latency


class GroupPlan:
    """The options of one admitting selection group (or one ungrouped candidate) and its picker state."""

    __slots__ = ("number", "options", "mode", "turn", "_rng", "_current", "_cost", "_providers", "_prior",
                 "_prior_epoch", "last_choice")

    def __init__(self, number: int | None, options: tuple[Option, ...], mode: int, turn: int,
                 rng: random.Random, cost: Cost | None = None) -> None:
        self.number = number
        self.options = options
        self.mode = mode if len(options) > 1 else DETERMINISTIC
        self.turn = turn % len(options) if options else 0
        self._rng = rng
        self._current = [0] * len(options)  # smooth weighted round robin
        self._cost = cost
        self._providers = tuple(dict.fromkeys(o.provider for o in options))  # least_loaded's prior is theirs
        self._prior = 0.0
        self._prior_epoch = -1
        # least_loaded's latest comparison (option, score, option, score): route evidence reads it
        self.last_choice: tuple[Option, float, Option, float] | None = None

    def pick(self, usable: Usable, key: bytes = b"") -> Option | None:
        options = self.options
        mode = self.mode
        if mode > RANDOM:
            if mode == WEIGHTED:
                return self._weighted(usable)
            if mode == STABLE_HASH:
                return self._rendezvous(usable, key)
            return self._two_choices(usable)
        if mode == ROUND_ROBIN:
            count = len(options)
            turn = self.turn
            for step in range(count):
                index = turn + step
                if index >= count:
                    index -= count
                option = options[index]
                if usable(option):
                    self.turn = index + 1 if index + 1 < count else 0
                    return option
            return None
        if mode == RANDOM:
            option = options[self._rng.randrange(len(options))]
            if usable(option):
                return option
            remaining = [o for o in options if usable(o)]
            return self._rng.choice(remaining) if remaining else None
        for option in options:
            if usable(option):
                return option
        return None

    def prefix_pick(self, usable: Usable, entry: PrefixEntry, table: PrefixTable) -> Option | None:
        """Prefix affinity (gateway.routing.prefix): the usable options ranked for the prefix by
        rendezvous hashing, and the table's place (or spill) in that ranking."""
        key = entry.key
        ranked = sorted((option for option in self.options if usable(option)),
                        key=lambda option: _xxh3(key, option.seed), reverse=True)
        if not ranked:
            return None
        return ranked[table.place(entry, ranked)]

    def _weighted(self, usable: Usable) -> Option | None:
        """Smooth weighted round robin (nginx): exact shares over every cycle of the usable options."""
        current = self._current
        best = -1
        total = 0
        for index, option in enumerate(self.options):
            if usable(option):
                weight = option.facts.weight
                current[index] += weight
                total += weight
                if best < 0 or current[index] > current[best]:
                    best = index
        if best < 0:
            return None
        current[best] -= total
        return self.options[best]

    def _rendezvous(self, usable: Usable, key: bytes) -> Option | None:
        """Highest random weight: the key's winner only changes when that option leaves."""
        best: Option | None = None
        top = -1
        for option in self.options:
            if usable(option):
                score = _xxh3(key, option.seed)
                if score > top:
                    best, top = option, score
        return best

    def _two_choices(self, usable: Usable) -> Option | None:
        """Power of two choices on cost. An unmeasured provider is expected at the group's prior (its
        median measured member), so it gets its share of new requests, not all of them."""
        candidates = [option for option in self.options if usable(option)]
        if len(candidates) <= 1:
            return candidates[0] if candidates else None
        first, second = self._rng.sample(candidates, 2)
        cost = self._cost
        if cost is None:
            return first
        if self._prior_epoch != cost.epoch:  # the view was refreshed: at most a few times a second
            self._prior = cost.prior_of(self._providers)
            self._prior_epoch = cost.epoch
        prior = self._prior
        first_cost, second_cost = cost(first.provider, prior), cost(second.provider, prior)
        self.last_choice = (first, first_cost, second, second_cost)
        return first if first_cost <= second_cost else second


class CapabilityPlan:
    """Everything selection needs for one capability in one revision."""

    __slots__ = ("groups", "reusable", "capability_hash", "accepts_any_binding", "unavailable", "unconfigured",
                 "provider_count", "label", "restricts", "options", "pinnable", "overlay_excluded")

    def __init__(self, cap: Capability, snapshot: Snapshot, worker_index: int, rng: random.Random,
                 provider_index: Mapping[str, int] | None, picker: str = "overlay",
                 facts: FactsTable | None = None, cost: Cost | None = None, prefix: bool = False) -> None:
        revision = snapshot.revision
        mode = snapshot.mode if picker == "overlay" else picker
        picker_mode = MODES[mode]

        def option(candidate: Candidate, group: int | None) -> Option:
            provider = provider_index.get(candidate.cluster, -1) if provider_index is not None else 0
            decisions = tuple(
                route_decision(candidate, provider, self, group, mode, revision, outcome)
                for outcome in range(len(AFFINITY_OUTCOMES))
            )
            option_facts = facts.facts(candidate.name, candidate.cluster) if facts else UNRESTRICTED
            by_prefix = None
            if prefix:  # prefix affinity is configured: its picks say so (selection mode ``prefix``)
                by_prefix = tuple(route_decision(candidate, provider, self, group, PREFIX_MODE, revision, outcome)
                                  for outcome in range(len(AFFINITY_OUTCOMES)))
            return Option(candidate, provider, decisions, option_facts, by_prefix)

        groups = _admitting_groups(cap, option, picker_mode, worker_index, rng, cost)
        self.groups = tuple(groups)
        self.options = tuple(o for g in groups for o in g.options)  # every option new requests may get
        # Distinct configured providers new requests can reach: failover needs at least two.
        self.provider_count = len({o.provider for o in self.options if o.provider >= 0})
        self.restricts = any(o.facts.restricts for o in self.options)  # request facts must be checked
        # A pinned route may name any candidate with an admission other than none, by cluster or stable id.
        self.pinnable: dict[str, Candidate] = {}
        for candidate in cap.members:
            if candidate.admission != "none":
                self.pinnable.setdefault(candidate.stable_id, candidate)
                self.pinnable.setdefault(candidate.cluster, candidate)
        self.label = label(cap.kind, cap.name)
        # Options a bound session may keep (admission other than none), by stable-id hash.
        self.reusable: dict[int, Option] = {}
        for candidate in cap.members:
            if candidate.admission != "none" and candidate.stable_id_hash not in self.reusable:
                self.reusable[candidate.stable_id_hash] = option(candidate, candidate.selection_group)
        self.capability_hash = cap.hash
        self.accepts_any_binding = cap.accepts_any_binding
        self.overlay_excluded = _overlay_excluded(cap)
        self.unavailable = ErrorReply(
            503, "no_admissible", f"No provider currently admits new requests for the {self.label}."
        )
        # Candidates naming a cluster this gateway does not have (never selected; reported once).
        self.unconfigured = sorted({c.cluster for c in cap.members if provider_index is not None
                                    and c.cluster not in provider_index})


def _admitting_groups(cap: Capability, option: Callable[[Candidate, int | None], Option], picker_mode: int,
                      worker_index: int, rng: random.Random, cost: Cost | None) -> list[GroupPlan]:
    """The groups new requests may be sent to, in file order: each ``new_and_existing`` selection group, or,
    ungrouped, each ``new_and_existing`` candidate alone."""
    groups: list[GroupPlan] = []
    if cap.grouped:
        for group in cap.groups:
            if group.admission == NEW_AND_EXISTING:
                options = tuple(option(c, group.number) for c in group.members)
                # Each worker starts its rotation at its own offset so N workers spread evenly.
                groups.append(GroupPlan(group.number, options, picker_mode, worker_index, rng, cost))
    else:
        # Ungrouped: the first new_and_existing candidate in file order, then the next ones (failover).
        for candidate in cap.members:
            if candidate.admission == NEW_AND_EXISTING:
                groups.append(GroupPlan(None, (option(candidate, None),), DETERMINISTIC, 0, rng))
    return groups


def _overlay_excluded(cap: Capability) -> dict[str, int]:
    """Candidates the overlay's producer excluded, by its reason (route evidence reports them)."""
    counts: dict[str, int] = {}
    for candidate in {c.stable_id: c for c in cap.members if c.excluded_reason}.values():
        reason = candidate.excluded_reason or ""
        counts[reason] = counts.get(reason, 0) + 1
    return counts


def label(kind: str, name: str) -> str:
    if not name:
        return "MCP session (no tool named)"
    return f"model `{name}`" if kind == "inference_model" else f"MCP tool `{name}`"


def model_not_found(kind: str, name: str) -> ErrorReply:
    if not name:
        return ErrorReply(404, "model_not_found", "The serving routing overlay has no MCP tool.")
    return ErrorReply(404, "model_not_found", f"The {label(kind, name)} is not in the serving routing overlay.")
