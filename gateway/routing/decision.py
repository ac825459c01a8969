"""What routing decides for one request: the chosen candidate and the evidence headers (CONTRACT §5).

Decisions are immutable and prebuilt per overlay revision, one per candidate option and affinity
outcome, so routing a request allocates nothing on the success path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple
from urllib.parse import quote

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
    mode, overlay revision, affinity); the proxy adds attempts, overhead and request id.
    ``selection_group`` is None for an ungrouped capability (its header value is ``none``).
    ``provider`` is the provider's index in the worker's provider table (-1: not configured here).
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


def route_decision(
    candidate: Candidate, provider: int, plan: CapabilityPlan, selection_group: int | None, mode: str,
    revision: str, outcome: int,
) -> RouteDecision:
    affinity = AFFINITY_OUTCOMES[outcome]
    evidence = (
        (b"x-gridgate-provider", header_value(candidate.cluster)),
        (b"x-gridgate-stable-id", header_value(candidate.stable_id)),
        (b"x-gridgate-selection-group", b"none" if selection_group is None else b"%d" % selection_group),
        (b"x-gridgate-selection-mode", mode.encode()),
        (b"x-gridgate-overlay-revision", revision.encode()),
        (b"x-gridgate-affinity", affinity.encode()),
    )
    return RouteDecision(candidate, candidate.cluster, candidate.stable_id, selection_group, mode, revision, affinity,
                         outcome, evidence, provider, plan)
