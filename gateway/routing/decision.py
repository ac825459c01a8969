"""The words of a routing decision: affinity outcomes, evidence header values, and the refusal of a
request that no candidate is left for (``RouteRefusal``, which says what the filters removed beside the
error). The decision itself (``RouteDecision``) is prebuilt by the plan that holds it
(``gateway.routing.plan``).
"""

from __future__ import annotations

from urllib.parse import quote

from gateway.http.errors import ErrorReply

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


class RouteRefusal(ErrorReply):
    """No candidate is left for the request: the error, and what the filters removed (the access log)."""

    __slots__ = ("filtered", "filtered_reasons")

    def __init__(self, reply: ErrorReply, filtered: int, filtered_reasons: int) -> None:
        super().__init__(reply.status, reply.code, reply.message, reply.headers, error_type=reply.error_type,
                         close=reply.close)
        self.filtered = filtered
        self.filtered_reasons = filtered_reasons
