"""Routing state of one capability for one overlay revision in one worker: its admitting selection
groups, each with its options (candidate + provider + prebuilt decisions) and its picker state.

Built on the capability's first request after a revision change (or in ``Router.prepare``), so
adopting a snapshot costs nothing up front and a capability costs O(its members) once.

A group picks among the options a caller deems usable (``usable(option) -> bool``: configured,
not cooled, has a routable endpoint, not tried yet, eligible for the request). Pickers:
``deterministic`` (first usable in file order), ``roundRobin`` (rotation, skipping the unusable),
``random`` (uniform over the usable).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping

from gateway.http.errors import ErrorReply
from gateway.overlay.contract import NEW_AND_EXISTING, Candidate
from gateway.overlay.snapshot import Capability, Snapshot
from gateway.routing.decision import AFFINITY_OUTCOMES, RouteDecision, route_decision

DETERMINISTIC, ROUND_ROBIN, RANDOM = range(3)
_MODES = {"deterministic": DETERMINISTIC, "roundRobin": ROUND_ROBIN, "random": RANDOM}


class Option:
    """One candidate slot of a group: its provider index and a prebuilt decision per affinity outcome."""

    __slots__ = ("candidate", "provider", "decisions")

    def __init__(self, candidate: Candidate, provider: int, decisions: tuple[RouteDecision, ...]) -> None:
        self.candidate = candidate
        self.provider = provider  # -1: the cluster is not configured on this gateway (never selected)
        self.decisions = decisions

    def __repr__(self) -> str:
        return f"Option({self.candidate.cluster}, provider={self.provider})"


Usable = Callable[[Option], bool]


class GroupPlan:
    """The options of one admitting selection group (or one ungrouped candidate) and its picker turn."""

    __slots__ = ("number", "options", "mode", "turn", "_rng")

    def __init__(self, number: int | None, options: tuple[Option, ...], mode: int, turn: int,
                 rng: random.Random) -> None:
        self.number = number
        self.options = options
        self.mode = mode if len(options) > 1 else DETERMINISTIC
        self.turn = turn % len(options) if options else 0
        self._rng = rng

    def pick(self, usable: Usable) -> Option | None:
        options = self.options
        mode = self.mode
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


class CapabilityPlan:
    """Everything selection needs for one capability in one revision."""

    __slots__ = ("groups", "reusable", "capability_hash", "accepts_any_binding", "unavailable", "unconfigured",
                 "provider_count")

    def __init__(self, cap: Capability, snapshot: Snapshot, worker_index: int, rng: random.Random,
                 provider_index: Mapping[str, int] | None) -> None:
        mode, revision = snapshot.mode, snapshot.revision
        picker = _MODES[mode]

        def option(candidate: Candidate, group: int | None) -> Option:
            provider = provider_index.get(candidate.cluster, -1) if provider_index is not None else 0
            decisions = tuple(
                route_decision(candidate, provider, self, group, mode, revision, outcome)
                for outcome in range(len(AFFINITY_OUTCOMES))
            )
            return Option(candidate, provider, decisions)

        groups: list[GroupPlan] = []
        if cap.grouped:
            for group in cap.groups:
                if group.admission == NEW_AND_EXISTING:
                    options = tuple(option(c, group.number) for c in group.members)
                    # Each worker starts its rotation at its own offset so N workers spread evenly.
                    groups.append(GroupPlan(group.number, options, picker, worker_index, rng))
        else:
            # Ungrouped: the first new_and_existing candidate in file order, then the next ones (failover).
            for candidate in cap.members:
                if candidate.admission == NEW_AND_EXISTING:
                    groups.append(GroupPlan(None, (option(candidate, None),), DETERMINISTIC, 0, rng))
        self.groups = tuple(groups)
        # Distinct configured providers new requests can reach: failover needs at least two.
        self.provider_count = len({o.provider for g in groups for o in g.options if o.provider >= 0})
        # Options a bound session may keep (admission other than none), by stable-id hash.
        self.reusable: dict[int, Option] = {}
        for candidate in cap.members:
            if candidate.admission != "none" and candidate.stable_id_hash not in self.reusable:
                self.reusable[candidate.stable_id_hash] = option(candidate, candidate.selection_group)
        self.capability_hash = cap.hash
        self.accepts_any_binding = cap.accepts_any_binding
        self.unavailable = ErrorReply(
            503, "no_admissible", f"No provider currently admits new requests for the {label(cap.kind, cap.name)}."
        )
        # Candidates naming a cluster this gateway does not have (never selected; reported once).
        self.unconfigured = sorted({c.cluster for c in cap.members if provider_index is not None
                                    and c.cluster not in provider_index})


def label(kind: str, name: str) -> str:
    if not name:
        return "MCP session (no tool named)"
    return f"model `{name}`" if kind == "inference_model" else f"MCP tool `{name}`"


def model_not_found(kind: str, name: str) -> ErrorReply:
    if not name:
        return ErrorReply(404, "model_not_found", "The serving routing overlay has no MCP tool.")
    return ErrorReply(404, "model_not_found", f"The {label(kind, name)} is not in the serving routing overlay.")
