"""Route evidence: why a request's route went where it did (docs/operations.md, "Access log";
docs/routing.md, "Usable providers").

Computed for sampled requests only (``access_log.evidence_sample``, and every traced request), right
after the router decided, from what the router saw: the capability's candidates that new requests may
get, which of them were left out and why, and for ``least_loaded`` the two candidates the power of two
choices compared, with their scores. Pure: it reads the plan, the provider view and the request's needs.

Each left-out candidate is counted under one reason, the first that applies:

- ``not_configured``: its cluster is not configured on this gateway;
- ``not_allowed``: the request's route is allowed only on other clusters (docs/security.md);
- ``filtered``: the eligibility filters removed it (``routing.models``, tenant regions);
- ``nonconformant``: its provider failed a required conformance check (``routing.conformance``);
- ``unhealthy``: no endpoint of its provider is routable (health checks, outlier detection);
- ``cooled``: its provider is cooling after a 429/503.

Candidates the overlay itself excluded with a reason (``excluded_reason``, e.g. ``nonconformant`` from
``gridgate control``'s conformance checks) are counted under that reason too.

A request prefix affinity placed (selection mode ``prefix``) also carries ``prefix``: its prompt
prefix's hash, how far misses have moved it, how far it spilled.
"""

from __future__ import annotations

import msgspec

from gateway.routing.decision import REUSED
from gateway.routing.eligibility import Needs
from gateway.routing.plan import LEAST_LOADED, GroupPlan, RouteDecision
from gateway.routing.prefix import Placement
from gateway.routing.providers import ProviderView


class PickerInput(msgspec.Struct, gc=False):
    """One candidate ``least_loaded`` compared: its provider and its score, (in flight + 1) x expected
    first-byte latency in seconds; the lower one won."""

    provider: str
    score: float


class PrefixEvidence(msgspec.Struct, gc=False):
    """Prefix affinity's pick (docs/routing.md, "Prefix affinity"): the prompt prefix's hash, how many
    places misses and slow first tokens have moved it along its ranking, and how far this request spilled
    past its place (0: it went to the prefix's place)."""

    hash: str
    moved: int
    spilled: int


class RouteEvidence(msgspec.Struct, gc=False):
    site: str  # the chosen candidate's site (overlay)
    admission_state: str  # its admission state (new_and_existing, existing_only, ...)
    candidates: int  # the capability's candidates new requests may get
    excluded: dict[str, int]  # left-out candidates by reason (only reasons with a count)
    picker_inputs: list[PickerInput] | None  # least_loaded: the two compared (None for other pickers)
    prefix: PrefixEvidence | None = None  # prefix affinity placed it (None: another picker chose)


def route_evidence(decision: RouteDecision, view: ProviderView, needs: Needs | None,
                   barred: frozenset[int] | None) -> RouteEvidence:
    """The evidence of ``decision``, just made by the router with this ``view`` (same event-loop step)."""
    plan = decision.plan
    excluded: dict[str, int] = {}
    usable, down, failed = view.usable, view.down, view.nonconformant
    check_needs = needs is not None and (plan.restricts or needs.regions is not None)
    for option in plan.options:
        provider = option.provider
        if provider < 0:
            reason = "not_configured"
        elif barred and provider in barred:
            reason = "not_allowed"
        elif check_needs and needs.reasons(option.facts):  # type: ignore[union-attr]
            reason = "filtered"
        elif provider < len(failed) and failed[provider]:
            reason = "nonconformant"
        elif provider < len(down) and down[provider]:
            reason = "unhealthy"
        elif provider < len(usable) and not usable[provider]:
            reason = "cooled"
        else:
            continue
        excluded[reason] = excluded.get(reason, 0) + 1
    for reason, count in plan.overlay_excluded.items():
        excluded[reason] = excluded.get(reason, 0) + count
    candidate = decision.candidate
    return RouteEvidence(candidate.site, candidate.admission, len(plan.options), excluded,
                         picker_inputs(decision, view))


def prefix_evidence(placement: Placement) -> PrefixEvidence:
    """What the route evidence says about a request prefix affinity placed."""
    entry = placement.entry
    return PrefixEvidence(entry.key.hex(), entry.offset, placement.spilled)


def picker_inputs(decision: RouteDecision, view: ProviderView) -> list[PickerInput] | None:
    """least_loaded's two compared candidates, when the decision is that pick (not a reused session, a
    fallback or a pin)."""
    if decision.outcome == REUSED or decision.mode != "least_loaded":
        return None
    for group in decision.plan.groups:
        if group.number == decision.selection_group and group.mode == LEAST_LOADED:
            return _compared(group, decision)
    return None


def _compared(group: GroupPlan, decision: RouteDecision) -> list[PickerInput] | None:
    choice = group.last_choice
    if choice is None:
        return None
    first, first_score, second, second_score = choice
    if decision.candidate is not first.candidate and decision.candidate is not second.candidate:
        return None  # the group's latest pick is not this decision's (it came from elsewhere)
    return [PickerInput(first.candidate.cluster, _micros(first_score)),
            PickerInput(second.candidate.cluster, _micros(second_score))]


def _micros(seconds: float) -> float:
    return int(seconds * 1e6 + 0.5) / 1e6
