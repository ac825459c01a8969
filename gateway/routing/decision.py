"""What routing decides for one request: the chosen candidate and the evidence headers
(docs/overlay.md, "Route evidence").

Decisions are immutable and prebuilt per overlay revision, one per candidate option and affinity
outcome, so routing a request allocates nothing on the success path. A request whose eligibility
filters removed candidates gets a copy that says how many and why (``with_filtered``); a request they
left without any candidate gets a ``RouteRefusal``, which says the same beside the error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple
from urllib.parse import quote

from gateway.http.errors import ErrorReply
from gateway.overlay.contract import Candidate

if TYPE_CHECKING:
    from gateway.routing.plan import CapabilityPlan

AFFINITY_NONE = "none"
AFFINITY_NEW = "new"
AFFINITY_REUSED = "reused"
AFFINITY_FAILOVER = "failover"
# Index of each affinity outcome in an option's prebuilt decisions.
NONE, NEW, FAILOVER, REUSED = range(4)
AFFINITY_OUTCOMES = (AFFINITY_NONE, AFFINITY_NEW, AFFINITY_FAILOVER, AFFINITY_REUSED)

_HEADER_SAFE = "!#$&'()*+,-./:;<=>?@[]^_`{|}~"


def header_value(text: str) -> bytes:
    """Header-safe bytes: visible ASCII as is, anything else percent-encoded."""
    if text.isascii() and all(33 <= ord(c) <= 126 for c in text):
        return text.encode("ascii")
    return quote(text, safe=_HEADER_SAFE).encode("ascii")


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


class RouteRefusal(ErrorReply):
    """No candidate is left for the request: the error, and what the filters removed (the access log)."""

    __slots__ = ("filtered", "filtered_reasons")

    def __init__(self, reply: ErrorReply, filtered: int, filtered_reasons: int) -> None:
        super().__init__(reply.status, reply.code, reply.message, reply.headers, error_type=reply.error_type,
                         close=reply.close)
        self.filtered = filtered
        self.filtered_reasons = filtered_reasons


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
