"""The intelligent route: affinity -> selection groups -> picker, and failover to the next provider
(docs/overlay.md, "Selecting a provider" and "Session affinity"; docs/routing.md, "Failover").

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
from gateway.routing.decision import (
    FAILOVER,
    NEW,
    NONE,
    REUSED,
    RouteRefusal,
)
from gateway.routing.eligibility import Facts, FactsTable, Needs, no_eligible_provider
from gateway.routing.plan import (
    CapabilityPlan,
    Option,
    RouteDecision,
    model_not_found,
    route_decision,
    with_filtered,
)
from gateway.routing.prefix import PrefixEntry, PrefixTable
from gateway.routing.providers import ProviderView

if TYPE_CHECKING:
    from shm.affinity import AffinityTable

# The options a request's filters rule out, and why (or-ed reason bits).
_Blocked = tuple[set[Option], int]


class Router:
    """Chooses a candidate per request. One per worker; not thread-safe (one event loop).

    ``worker_index`` offsets every round-robin counter so N workers start on different members and
    spread evenly. ``affinity`` (shared table) and ``affinity_ttl_s`` enable session affinity;
    without a table, keys are ignored. ``provider_index`` maps configured cluster names to indexes
    into ``providers`` (without it, every cluster is configured and usable: pure tests).
    """

    __slots__ = ("_worker_index", "_rng", "_affinity", "_ttl", "_revision", "_plans", "_provider_index",
                 "providers", "_usable_any", "_picker", "_facts", "prefixes")

    def __init__(
        self,
        worker_index: int = 0,
        rng: random.Random | None = None,
        affinity: AffinityTable | None = None,
        affinity_ttl_s: float = 3600.0,
        provider_index: Mapping[str, int] | None = None,
        providers: ProviderView | None = None,
        picker: str = "overlay",
        facts: FactsTable | None = None,
        prefixes: PrefixTable | None = None,
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
        self._picker = picker
        self._facts = facts
        self.prefixes = prefixes  # prefix affinity's placements (None: off; gateway.routing.prefix)

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
            plan = self._plans[cap.index] = CapabilityPlan(
                cap, snapshot, self._worker_index, self._rng, self._provider_index, self._picker, self._facts,
                self.providers.cost, self.prefixes is not None,
            )
        return plan

    def _plan_for(self, snapshot: Snapshot, kind: str, name: str) -> CapabilityPlan | ErrorReply:
        """The capability's plan in ``snapshot`` (adopting a new revision first), or 404 when unknown."""
        cap = snapshot.capabilities.get((kind, name))
        if cap is None:
            return model_not_found(kind, name)
        if snapshot.revision != self._revision:
            self._adopt(snapshot)
        return self._plans[cap.index] or self._plan(snapshot, cap)

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
    def _select(self, plan: CapabilityPlan, outcome: int, excluded: Collection[int] | None,
                blocked: set[Option] | None = None, key: bytes = b"",
                prefix: PrefixEntry | None = None) -> RouteDecision | None:
        if excluded or blocked:
            usable = self.providers.usable
            skip = excluded or ()
            barred = blocked or ()

            def eligible(option: Option) -> bool:
                return (option.provider >= 0 and usable[option.provider] and option.provider not in skip
                        and option not in barred)
        else:
            eligible = self._usable_any
        for group in plan.groups:
            if prefix is not None and len(group.options) > 1:  # prefix affinity chooses in the group
                option = group.prefix_pick(eligible, prefix, self.prefixes)  # type: ignore[arg-type]
                if option is not None:
                    return option.prefix_decisions[outcome]
                continue
            option = group.pick(eligible, key)
            if option is not None:
                return option.decisions[outcome]
        return self._fallback(plan, outcome, excluded, blocked)

    def _fallback(self, plan: CapabilityPlan, outcome: int, excluded: Collection[int] | None,
                  blocked: set[Option] | None) -> RouteDecision | None:
        """Nothing usable: the least recently cooled provider (endpoint panic mode if all are down)."""
        best: Option | None = None
        rank = self.providers.fallback_rank
        for option in plan.options:
            provider = option.provider
            if provider < 0 or (excluded and provider in excluded) or (blocked and option in blocked):
                continue
            if best is None or rank(provider) < rank(best.provider):
                best = option
        return None if best is None else best.decisions[outcome]

    def _blocked(self, plan: CapabilityPlan, needs: Needs | None) -> _Blocked | RouteRefusal | None:
        """The options the request's needs rule out, how many and why (None: none are); a ``RouteRefusal``
        when none is left."""
        if needs is None or not (plan.restricts or needs.regions is not None) or not plan.options:
            return None
        blocked: set[Option] = set()
        filtered: list[tuple[int, Facts]] = []
        why = 0
        for option in plan.options:
            reasons = needs.reasons(option.facts)
            if reasons:
                blocked.add(option)
                filtered.append((reasons, option.facts))
                why |= reasons
        if not blocked:
            return None
        if len(blocked) == len(plan.options):
            return RouteRefusal(no_eligible_provider(plan.label, needs, filtered), len(filtered), why)
        return blocked, why

    def route(
        self,
        snapshot: Snapshot,
        kind: str,
        name: str,
        session_key: bytes | None = None,
        now: float = 0.0,
        needs: Needs | None = None,
        key: bytes = b"",
        barred: frozenset[int] | None = None,
        prefix: PrefixEntry | None = None,
    ) -> RouteDecision | ErrorReply:
        """Route one request for capability ``(kind, name)``.

        ``session_key`` is the affinity key (see ``gateway.request.capability.session_key``) and ``now`` the
        shared clock (``time.monotonic()`` is system-wide on Linux, so every worker agrees on expiries).
        ``needs`` (request facts and tenant regions) filters candidates; the decision says how many it
        removed and why (``RouteDecision.filtered``), and so does the ``RouteRefusal`` when none is left.
        ``key`` feeds the stable_hash picker. ``barred``: providers that may not serve the request at
        all (its route is allowed only on other clusters, docs/security.md). ``prefix``: the request's
        prompt-prefix entry, when prefix affinity is on (its pick is ``self.prefixes.placed``).
        """
        plan = self._plan_for(snapshot, kind, name)
        if type(plan) is ErrorReply:
            return plan
        blocked = self._blocked(plan, needs)
        options = None
        if blocked is not None:
            if type(blocked) is RouteRefusal:
                return blocked
            options = blocked[0]  # type: ignore[index]
        table = self._affinity
        if session_key is None or table is None:
            decision = self._select(plan, NONE, barred or None, options, key, prefix) or plan.unavailable
        else:
            decision = self._affine(table, plan, session_key, now, needs, key, barred or None, options, prefix)
        if options is not None and type(decision) is RouteDecision:
            decision = with_filtered(decision, len(options), blocked[1])  # type: ignore[index]
        return decision

    def _affine(self, table: AffinityTable, plan: CapabilityPlan, session_key: bytes, now: float,
                needs: Needs | None, key: bytes, excluded: frozenset[int] | None,
                blocked: set[Option] | None, prefix: PrefixEntry | None = None) -> RouteDecision | ErrorReply:
        """The session's bound candidate while it is usable (docs/routing.md), else a selection that
        (re)binds the session."""
        # table.lookup written out: the common case (the session asks again, its record unchanged since
        # this process read it) is one dict get and one word read, without a call per request.
        seen = table.seen.get(session_key)
        if seen is not None:
            record, sequence, bound = seen
            if table.words[record] != sequence:
                bound = table.read(session_key, now)
            elif not bound.expires_at > now:  # (not <=: the same answer for a NaN as lookup gives)
                bound = None
        else:
            bound = table.read(session_key, now)
        if bound is None:
            outcome = NEW
        else:
            if bound.capability_hash == plan.capability_hash or plan.accepts_any_binding:
                option = plan.reusable.get(bound.stable_id_hash)
                # Reuse keeps the original expiry: it is absolute from binding time.
                if option is not None:
                    provider = option.provider
                    if (provider >= 0 and self.providers.usable[provider]
                            and (needs is None or not needs.reasons(option.facts))
                            and (excluded is None or provider not in excluded)):
                        return option.decisions[REUSED]
            outcome = FAILOVER
        decision = self._select(plan, outcome, excluded, blocked, key, prefix)
        if decision is None:
            return plan.unavailable
        if excluded is None or outcome == NEW:  # a barred request never moves a session's binding
            table.bind(session_key, decision.candidate.stable_id_hash, plan.capability_hash, now + self._ttl)
        return decision

    def failover(self, first: RouteDecision, tried: Collection[int], needs: Needs | None = None,
                 key: bytes = b"", barred: frozenset[int] | None = None) -> RouteDecision | None:
        """The next provider after ``tried`` failed: the same group first (by its picker), then the next
        groups in order, with the same filters and bars. None when no other provider is left."""
        outcome = NONE if first.outcome == NONE else FAILOVER
        blocked = self._blocked(first.plan, needs)
        if type(blocked) is RouteRefusal:
            return None
        excluded = barred.union(tried) if barred else tried
        if blocked is None:
            return self._select(first.plan, outcome, excluded, None, key)
        options, why = blocked  # type: ignore[misc]
        decision = self._select(first.plan, outcome, excluded, options, key)
        return None if decision is None else with_filtered(decision, len(options), why)

    def pinned(self, snapshot: Snapshot, kind: str, name: str, pin: str) -> RouteDecision | ErrorReply:
        """A pinned route (diagnosis, rollback): the candidate named by cluster or stable id, whatever its
        group, with any admission but none, no failover (docs/routing.md, "Request-aware selection")."""
        plan = self._plan_for(snapshot, kind, name)
        if type(plan) is ErrorReply:
            return plan
        candidate = plan.pinnable.get(pin)
        if candidate is None:
            return ErrorReply(404, "pinned_candidate_not_found",
                              f"The pin {pin!r} names no admissible candidate of the {plan.label}.")
        provider = self._provider_index.get(candidate.cluster, -1) if self._provider_index is not None else 0
        if provider < 0:
            return ErrorReply(503, "no_provider_available",
                              f"The pinned provider {candidate.cluster!r} is not configured on this gateway.")
        return route_decision(candidate, provider, plan, candidate.selection_group, "pinned", snapshot.revision, NONE)

    def rebind(self, session_key: bytes, served: RouteDecision, now: float) -> None:
        """The session's request was served by another provider than it was bound to: move the binding."""
        if self._affinity is not None:
            self._affinity.bind(session_key, served.candidate.stable_id_hash, served.plan.capability_hash,
                                now + self._ttl)
