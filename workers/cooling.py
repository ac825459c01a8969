"""The one call the request path makes when an endpoint answered 429 or 503 (docs/routing.md, "Cooling").

It replaces cooling the whole provider on every such answer: the endpoint is cooled for the answer's
``Retry-After`` (capped at ``routing.cooling.max``) or ``routing.cooling.default``, and its provider
only when the answer spoke for the whole provider (gateway.routing.cooling) or no endpoint of it is
left; both are counted. The request path reads the two facts from the answer's head with
``gateway.routing.cooling.cooling_signals`` (one pass over a retryable head's headers).
"""

from __future__ import annotations

from gateway.config import Cooling
from gateway.metrics.writer import WorkerMetrics
from gateway.routing.cooling import Scope
from gateway.routing.failover import cooling_seconds, parse_retry_after
from workers.providers import Endpoint, ProviderStates


def cool_for_answer(providers: ProviderStates, metrics: WorkerMetrics, cluster: str, provider: int,
                    endpoint: Endpoint, retry_after: bytes | None, provider_wide: bool, cooling: Cooling,
                    now: float, wall_now: float) -> Scope:
    """Cool ``endpoint`` (and maybe its provider, ``cluster``) after a 429/503; returns what was cooled.

    ``now`` is the monotonic clock (cooling is shared across workers by it), ``wall_now`` the wall
    clock a ``Retry-After`` HTTP date is read against."""
    seconds = cooling_seconds(parse_retry_after(retry_after, wall_now), cooling)
    scope = providers.cool_endpoint(provider, endpoint, seconds, now, provider_wide)
    metrics.endpoint_cooled(cluster)
    if scope == Scope.PROVIDER:
        metrics.cooled(cluster)
    return scope
