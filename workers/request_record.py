"""One request's record: what the end of the request needs, gathered as the request goes, closed once.

The proxy makes one per request it handles and fills it step by step (tenant, capability, admission,
route, attempts, what the attempts that did not serve cost); the forwarder points ``attempt`` at the
relay of the attempt in progress. ``close`` runs exactly once: from the exchange's end (``end`` or
``abort``, before the response's last bytes are flushed) when a response was given, else from the
``finally`` of the proxy's handler (the client left, an exception). Closing hands the record to the
worker's ``Outcomes`` (workers/outcomes.py), which settles the quota once, counts the metrics and writes
the access line; the record itself becomes that line (the access log keeps it until its next write-out),
so it copies the few exchange fields the line needs and lets go of everything else.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from gateway.models.aliases import ModelRoute
    from gateway.quota.admission import Admission
    from gateway.routing import RouteDecision
    from gateway.routing.eligibility import Needs

_perf = time.perf_counter


class RequestRecord(msgspec.Struct, gc=False):
    """Built in C with keywords, untracked by the collector: the one reference cycle it is part of while
    the request runs (exchange -> record -> exchange, record -> relay -> exchange) is broken by ``close``,
    which always runs (the handler's ``finally``)."""

    # -- who asks, and where the end goes
    exchange: Any = None  # workers.exchange.Exchange, until closed
    ends: Any = None  # workers.outcomes.Outcomes: settles, counts and logs the closed record
    request_id: bytes | None = None
    tenant: str | None = None
    # A JWT's or a client certificate's request: ``jwt:<issuer>`` or ``mtls``, and its subject (the access line's).
    identity: str | None = None
    subject: str | None = None
    batch: bool = False  # the tenant waits behind interactive ones for upstream connections
    capability: str | None = None  # the model the path routes (an alias's target: docs/models.md)
    model_route: ModelRoute | None = None  # the requested name was an alias or has a fallback chain
    # -- decided before the first attempt
    admission: Admission | None = None  # the quota's, when it admitted the request
    session: bytes | None = None  # the session-affinity key whose binding follows the serving provider
    needs: Needs | None = None  # eligibility filters (None: none apply)
    key: bytes = b""  # the stable_hash picker's key
    prefix: Any = None  # gateway.routing.prefix.Placement: prefix affinity placed it (its end feeds back)
    barred: frozenset[int] | None = None  # providers its route may not reach (docs/security.md)
    balance_keys: dict[bytes, bytes] | None = None  # consistent-hash header values of the balancers
    body: bytes = b""  # as sent upstream (rewritten to ask for usage when metered)
    metering: bool | None = None  # None: not metered; True: the body was rewritten to ask for usage
    forward: list[tuple[bytes, bytes]] | None = None  # the headers every attempt sends
    # -- the attempts
    route: RouteDecision | None = None  # the provider of the latest attempt (the one that served)
    attempts: int = 0  # providers tried
    endpoint: Any = None  # workers.clusters.UpstreamEndpoint the request was last sent to
    attempt: Any = None  # workers.relay.ResponseRelay of the attempt in progress, or of the one that served
    owed: int = 0  # tokens the attempts that ended without serving cost (gateway/request/attempts.py)
    reached: bool = False  # one of those attempts reached its provider (its request slot is spent)
    # The request reached a provider when ``reached`` or ``attempt`` is set (the attempt that served or was
    # in progress at the end); not when it was refused or not routable, the client left before it was sent,
    # no connection came, or only pooled connections the provider had closed took it (docs/limits.md,
    # "Request limits"): then nothing is charged and its request slots go back (workers/outcomes.py).
    overhead_s: float | None = None  # gateway time before the upstream request was written
    # -- a fallback chain (docs/models.md): the model of the latest attempt, the moves and their reasons
    served_model: str | None = None  # None: ``capability`` (no chain moved the request)
    fallback_hops: int = 0
    fallback_reasons: list[str] | None = None
    fallback_skipped: int = 0  # chain models skipped: the tenant or key may not use them
    # -- the outcome: a gateway-made answer's status and code, and the cluster it is counted under
    status: int = 0
    error: str | None = None
    provider: str | None = None
    filtered: int = 0  # candidates the eligibility filters removed, and why (reason bits)
    filtered_reasons: int = 0
    shadow: tuple[str, ...] | None = None  # quota limits in shadow mode that would have refused it
    evidence: Any = None  # gateway.routing.evidence.RouteEvidence of a sampled request (the access line)
    trace: Any = None  # workers.tracing.RequestTrace of a traced request
    # -- the access line's copy of the exchange, taken at close
    ended: float = 0.0
    t_start: float | None = None
    t_first_byte: float = 0.0
    method: bytes | None = None
    target: bytes | None = None
    bytes_in: int = 0
    bytes_out: int = 0
    tokens_prompt: int | None = None
    tokens_completion: int | None = None
    tokens_cached: int | None = None  # of the prompt, as the provider reported them (None: not reported)
    tokens_reasoning: int | None = None  # of the completion, likewise
    # What the request's attempts cost, in nano-USD, priced as ``served`` (docs/pricing.md); None: it
    # reached no provider, or has no model to price.
    cost_nusd: int | None = None
    spend_alert: str | None = None  # a budget threshold this request crossed first in its period
    # -- the response cache (docs/cache.md): hit, miss or bypass (None: no cache), what a hit saved, and a
    # leader's capture of its answer (workers/response_cache.py), stored as the record closes
    cache: str | None = None
    saved_tokens: int | None = None
    saved_nusd: int | None = None
    cache_fill: Any = None
    closed: bool = False

    @property
    def served(self) -> str | None:
        """The model that served (or was last tried): the one a request is priced at (docs/pricing.md)."""
        return self.served_model or self.capability

    @property
    def requested_model(self) -> str | None:
        """The name the client asked for, when it was an alias (else None: ``capability``)."""
        route = self.model_route
        return route.requested if route is not None and route.alias else None

    @property
    def estimate(self) -> int:
        """The tokens reserved at admission (0 when not metered)."""
        admission = self.admission
        return 0 if admission is None else admission.estimate

    def close(self) -> None:
        """The request is over: settle, count and log it (once; later calls do nothing)."""
        if self.closed:
            return
        self.closed = True
        self.ended = _perf()
        exchange = self.exchange
        if exchange is not None:
            exchange.record = None
            self.t_start = exchange.t_start
            self.t_first_byte = exchange.t_first_byte
            self.method = exchange.method
            self.target = exchange.target
            self.bytes_in = len(exchange.body)
            self.bytes_out = exchange.bytes_out
        try:
            self.ends.close(self)
        finally:
            fill = self.cache_fill
            if fill is not None:  # a cache miss's leader: its answer is stored (when whole) and shared
                self.cache_fill = None
                fill.cache.store(fill, self)
            # The line is written later: it keeps no body, headers, relay or exchange meanwhile.
            self.exchange = self.attempt = self.admission = self.forward = self.needs = None
            self.body = b""
