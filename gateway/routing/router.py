"""The intelligent route: affinity -> selection groups -> picker, and failover to the next provider
(CONTRACT §4.2, §4.4, §11).

One ``Router`` per worker process, pure apart from the affinity table it is given (shared memory) and
the random source; clocks come in as arguments. A selection walks the capability's admitting groups
in order and lets the group's picker choose among the *usable* options: configured here, not cooled,
with a routable endpoint, not tried yet by this request. When no option is usable anywhere, the
least recently cooled provider is used (a cooled one with routable endpoints before one whose
endpoints are all down: endpoint panic mode applies only then).
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

from gateway.http.errors import ErrorReply
from gateway.overlay.snapshot import Capability, Snapshot
from gateway.routing.decision import FAILOVER, NEW, NONE, REUSED, RouteDecision
from gateway.routing.plan import CapabilityPlan, Option, model_not_found
from gateway.routing.providers import ProviderView

if TYPE_CHECKING:
    from shm.affinity import AffinityTable


class Router:
    """Chooses a candidate per request. One per worker; not thread-safe (one event loop).

    ``worker_index`` offsets every round-robin counter so N workers start on different members and
    spread evenly. ``affinity`` (shared table) and ``affinity_ttl_s`` enable session affinity;
    without a table, keys are ignored. ``provider_index`` maps configured cluster names to indexes
    into ``providers`` (without it, every cluster is configured and usable: pure tests).
    """

    __slots__ = ("_worker_index", "_rng", "_affinity", "_ttl", "_revision", "_plans", "_provider_index",
                 "providers", "_usable_any")

    def __init__(
        self,
        worker_index: int = 0,
        rng: random.Random | None = None,
        affinity: AffinityTable | None = None,
        affinity_ttl_s: float = 3600.0,
        provider_index: Mapping[str, int] | None = None,
        providers: ProviderView | None = None,
    ) -> None:
        self._worker_index = worker_index
        self._rng = rng if rng is not None else random.Random()
        self._affinity = affinity
        self._ttl = affinity_ttl_s
        self._revision: str | None = None
        self._plans: list[CapabilityPlan | None] = []
        self._provider_index = provider_index
        self.providers = providers if providers is not None else ProviderView(max(1, len(provider_index or ())))
        usable = self.providers.usable  # updated in place, so this closure stays current
        self._usable_any = lambda option: option.provider >= 0 and usable[option.provider]

    @property
    def revision(self) -> str | None:
        """Revision whose picker state this router holds."""
        return self._revision

    def _adopt(self, snapshot: Snapshot) -> None:
        # Same revision => same candidates and policy => same capability indexes, so the state is kept
        # (route() only calls this on a change). A new revision starts fresh.
        self._plans = [None] * len(snapshot.capabilities)
        self._revision = snapshot.revision

    def _plan(self, snapshot: Snapshot, cap: Capability) -> CapabilityPlan:
        plan = self._plans[cap.index]
        if plan is None:
            plan = self._plans[cap.index] = CapabilityPlan(cap, snapshot, self._worker_index, self._rng,
                                                           self._provider_index)
        return plan

    def prepare(self, snapshot: Snapshot) -> list[str]:
        """Build every capability's plan now (after a reload) instead of lazily on each capability's
        first request; keeps the state of an unchanged revision. Returns the clusters the overlay
        names that this gateway does not have (never selected)."""
        if snapshot.revision != self._revision:
            self._adopt(snapshot)
        unconfigured: set[str] = set()
        for cap in snapshot.capabilities.values():
            unconfigured.update(self._plan(snapshot, cap).unconfigured)
        return sorted(unconfigured)

    # -- selection --------------------------------------------------------------------------------
    def _select(self, plan: CapabilityPlan, outcome: int, excluded: Collection[int] | None) -> RouteDecision | None:
        if excluded:
            usable = self.providers.usable

            def eligible(option: Option) -> bool:
                return option.provider >= 0 and usable[option.provider] and option.provider not in excluded
        else:
            eligible = self._usable_any
        for group in plan.groups:
            option = group.pick(eligible)
            if option is not None:
                return option.decisions[outcome]
        return self._fallback(plan, outcome, excluded)

    def _fallback(self, plan: CapabilityPlan, outcome: int, excluded: Collection[int] | None) -> RouteDecision | None:
        """Nothing usable: the least recently cooled provider (endpoint panic mode if all are down)."""
        best: Option | None = None
        rank = self.providers.fallback_rank
        for group in plan.groups:
            for option in group.options:
                provider = option.provider
                if provider < 0 or (excluded and provider in excluded):
                    continue
                if best is None or rank(provider) < rank(best.provider):
                    best = option
        return None if best is None else best.decisions[outcome]

    def route(
        self,
        snapshot: Snapshot,
        kind: str,
        name: str,
        session_key: bytes | None = None,
        now: float = 0.0,
    ) -> RouteDecision | ErrorReply:
        """Route one request for capability ``(kind, name)``.

        ``session_key`` is the affinity key (see ``gateway.capability.session_key``) and ``now`` the
        shared clock (``time.monotonic()`` is system-wide on Linux, so every worker agrees on expiries).
        """
        cap = snapshot.capabilities.get((kind, name))
        if cap is None:
            return model_not_found(kind, name)
        if snapshot.revision != self._revision:
            self._adopt(snapshot)
        plan = self._plans[cap.index] or self._plan(snapshot, cap)
        table = self._affinity
        if session_key is None or table is None:
            return self._select(plan, NONE, None) or plan.unavailable

        bound = table.lookup(session_key, now)
        outcome = NEW
        if bound is not None:
            if bound.capability_hash == plan.capability_hash or plan.accepts_any_binding:
                option = plan.reusable.get(bound.stable_id_hash)
                # Reuse keeps the original expiry: it is absolute from binding time.
                if option is not None and option.provider >= 0 and self.providers.usable[option.provider]:
                    return option.decisions[REUSED]
            outcome = FAILOVER
        decision = self._select(plan, outcome, None)
        if decision is None:
            return plan.unavailable
        table.bind(session_key, decision.candidate.stable_id_hash, plan.capability_hash, now + self._ttl)
        return decision

    def failover(self, first: RouteDecision, tried: Collection[int]) -> RouteDecision | None:
        """The next provider after ``tried`` failed: the same group first (by its picker), then the next
        groups in order. None when no other provider is left."""
        outcome = NONE if first.outcome == NONE else FAILOVER
        return self._select(first.plan, outcome, tried)

    def rebind(self, session_key: bytes, served: RouteDecision, now: float) -> None:
        """The session's request was served by another provider than it was bound to: move the binding."""
        if self._affinity is not None:
            self._affinity.bind(session_key, served.candidate.stable_id_hash, served.plan.capability_hash,
                                now + self._ttl)
