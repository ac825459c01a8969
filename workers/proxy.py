"""The request lifecycle, top to bottom: headers -> authenticate -> capability -> admit (quota) ->
route -> pick an endpoint -> connection -> relay the response -> settle the reservation.

Each step returns its result or an ``ErrorReply``; the first reply ends the request. ``forward``
runs the upstream attempts with ``ProviderAttempts`` (sans-IO) deciding what follows a failure, and a
``ResponseRelay`` streams the provider's answer to the client as it arrives.
"""

from __future__ import annotations

import time

from gateway.auth import Authenticator
from gateway.capability import CapabilityRequest, lookup_capability, session_key
from gateway.http.errors import ErrorReply
from gateway.ids import CounterIds
from gateway.metrics import WorkerMetrics
from gateway.quota.gate import Admission, QuotaGate
from gateway.quota.usage import rewrite_request_for_usage
from gateway.request.attempts import Next, ProviderAttempts, Settlement, settlement_for
from gateway.request.headers import HeaderPlan, RequestHeaders
from gateway.routing import RouteDecision, Router
from workers.clusters import ClusterManager, UpstreamCluster
from workers.overlay_follower import OverlayFollower
from workers.relay import ResponseRelay
from workers.server import Exchange
from workers.upstream import ConnectFailed, PoolExhausted

_perf = time.perf_counter
_monotonic = time.monotonic

# Quota for requests without authentication is accounted to this tenant.
ANONYMOUS_TENANT = "anonymous"
_FORM_URLENCODED = b"application/x-www-form-urlencoded"
_JSON_HEADER = (b"content-type", b"application/json")
_BODYLESS_METHODS = (b"GET", b"HEAD", b"DELETE", b"OPTIONS")
_WWW_AUTHENTICATE = [(b"www-authenticate", b'Bearer realm="gridgate"')]
_MISSING_KEY = ErrorReply(401, "invalid_api_key", "missing API key: send Authorization: Bearer <key> or X-Api-Key",
                          _WWW_AUTHENTICATE)
_INVALID_KEY = ErrorReply(401, "invalid_api_key", "invalid API key", _WWW_AUTHENTICATE)


class Proxy:
    """Per-worker request handler; ``handle`` runs once per request."""

    def __init__(
        self, *, header_plan: HeaderPlan, auth: Authenticator | None, overlay: OverlayFollower, router: Router,
        clusters: ClusterManager, quota: QuotaGate | None, metrics: WorkerMetrics, route_headers: bool,
        affinity_enabled: bool, affinity_cookie: str | None,
    ) -> None:
        self.header_plan = header_plan
        self.auth = auth
        self.overlay = overlay
        self.router = router
        self.clusters = clusters
        self.quota = quota
        self.metrics = metrics
        self.route_headers = route_headers
        self.affinity_enabled = affinity_enabled
        self.affinity_cookie = affinity_cookie.encode() if affinity_enabled and affinity_cookie else None
        self.ids = CounterIds(b"-")

    async def handle(self, exchange: Exchange) -> None:
        headers = self.header_plan.scan(exchange.headers)
        request_id = headers.request_id or self.ids.next()
        tenant = self.authenticate(headers)
        if type(tenant) is ErrorReply:
            return self.refuse(exchange, tenant, request_id)
        if exchange.method == b"GET" and exchange.target == b"/v1/models":
            exchange.respond(200, [_JSON_HEADER, (b"x-request-id", request_id)], self.overlay.models_body)
            self.metrics.request(None, 200)
            return
        capability = self.capability(exchange, headers)
        if type(capability) is ErrorReply:
            return self.refuse(exchange, capability, request_id)
        admission = None
        if self.quota is not None:
            admission = await self.admit(tenant, capability, len(exchange.body))
            if type(admission) is ErrorReply:
                return self.refuse(exchange, admission, request_id)
        route = self.route(capability, headers)
        if type(route) is ErrorReply:
            self.settle(admission, Settlement.RELEASE)
            return self.refuse(exchange, route, request_id)
        await self.forward(exchange, headers, capability, route, admission, request_id)

    # -- steps ------------------------------------------------------------------------------------
    def authenticate(self, headers: RequestHeaders) -> str | ErrorReply:
        """The tenant of the presented key; 401 when auth is on and the key is missing or unknown."""
        if self.auth is None:
            return ANONYMOUS_TENANT
        tenant = self.auth.authenticate(headers.authorization, headers.api_key)
        if tenant is not None:
            return tenant
        return _MISSING_KEY if headers.authorization is None and headers.api_key is None else _INVALID_KEY

    def capability(self, exchange: Exchange, headers: RequestHeaders) -> CapabilityRequest | ErrorReply:
        content_type = headers.content_type
        if content_type is not None and content_type.startswith(_FORM_URLENCODED) and exchange.body[:1] == b"{":
            content_type = None  # `curl -d '{...}'` sends JSON under the form type; read it as JSON
        return lookup_capability(headers.model, exchange.body, content_type)

    async def admit(self, tenant: str, request: CapabilityRequest, body_len: int) -> Admission | ErrorReply:
        """Reserve tokens before routing; a denial never reaches a provider (429/503 with headers)."""
        assert self.quota is not None
        fields = request.body
        admission = await self.quota.admit(
            tenant, request.name, body_len,
            fields.max_tokens if fields is not None else None,
            fields.max_completion_tokens if fields is not None else None,
        )
        if admission.allowed:
            return admission
        message, error_type, code = admission.error or ("request not admitted", None, "quota_unavailable")
        return ErrorReply(admission.status or 503, code, message, admission.headers, error_type=error_type)

    def route(self, request: CapabilityRequest, headers: RequestHeaders) -> RouteDecision | ErrorReply:
        key = None
        if self.affinity_enabled:
            key = session_key(headers.session, headers.cookie, self.affinity_cookie)
        decision = self.router.route(self.overlay.snapshot, request.kind, request.name, key, _monotonic())
        if type(decision) is ErrorReply:
            return decision
        if decision.cluster not in self.clusters:
            return ErrorReply(503, "no_provider_available",
                              f"provider cluster {decision.cluster!r} is not configured on this gateway")
        self.metrics.affinity(decision.affinity)
        return decision

    def settle(self, admission: Admission | None, settlement: Settlement, tokens: int | None = None) -> None:
        """Reconcile a reservation off the response path (never blocks)."""
        gate = self.quota
        if admission is None or gate is None:
            return
        if settlement == Settlement.RELEASE:
            gate.release(admission)
        elif settlement == Settlement.CHARGE_USAGE and tokens is not None:
            gate.charge(admission, tokens)
        else:
            gate.charge_estimate(admission)

    def refuse(self, exchange: Exchange, reply: ErrorReply, request_id: bytes) -> None:
        self.metrics.request(None, reply.status)
        exchange.send_error(reply, [(b"x-request-id", request_id)])

    # -- upstream ---------------------------------------------------------------------------------
    def _upstream_body(self, request: CapabilityRequest, body: bytes, admission: Admission | None,
                       ) -> tuple[bytes, bool | None]:
        """The body to send and the metering mode (None: not metered; True: rewritten to ask for usage).

        A metered stream whose client did not ask for a usage chunk is rewritten to ask for one; the
        relay's usage filter then removes that chunk so the client sees exactly what it asked for.
        """
        if admission is None or admission.reservation is None:
            return body, None
        fields = request.body
        if fields is not None and fields.stream and not fields.include_usage:
            rewritten = rewrite_request_for_usage(body)
            if rewritten is not None:
                return rewritten, True
        return body, False

    def _request_headers(self, exchange: Exchange, headers: RequestHeaders, cluster: UpstreamCluster,
                         route: RouteDecision, request_id: bytes, body: bytes) -> list[tuple[bytes, bytes]]:
        forward = headers.forward
        peer = exchange.peer
        xff = headers.xff
        forward.append((b"x-forwarded-for", xff + b", " + peer if xff else peer))
        forward.append((b"x-request-id", request_id))
        forward += cluster.auth_headers
        if cluster.provider_hop:
            forward.append((b"x-ai-routing-candidate", route.evidence[1][1]))
            forward.append((b"x-ai-routing-request-id", request_id))
            if self.overlay.snapshot.is_envelope:
                forward.append((b"x-ai-routing-revision", route.revision.encode()))
        if body:
            forward.append((b"content-length", b"%d" % len(body)))
        elif exchange.method not in _BODYLESS_METHODS:
            forward.append((b"content-length", b"0"))
        return forward

    async def forward(
        self, exchange: Exchange, headers: RequestHeaders, request: CapabilityRequest, route: RouteDecision,
        admission: Admission | None, request_id: bytes,
    ) -> None:
        cluster = self.clusters.get(route.cluster)
        assert cluster is not None  # route() checked it
        body, metering = self._upstream_body(request, exchange.body, admission)
        forward = self._request_headers(exchange, headers, cluster, route, request_id, body)
        response_headers = [(b"x-request-id", request_id)]
        if self.route_headers:
            response_headers += route.evidence
        if admission is not None:
            response_headers += admission.headers
        key = cluster.balance_key(headers.balance_keys, exchange.target)
        attempts: ProviderAttempts = ProviderAttempts(cluster.name)
        while (endpoint := cluster.pick(key, attempts.excluded)) is not None:
            pool = endpoint.pool
            conn = None if attempts.fresh else pool.try_acquire()
            if conn is None:
                try:
                    conn = await pool.acquire(fresh=attempts.fresh)
                except ConnectFailed as error:
                    cluster.record_failure(endpoint, error.failure)
                    if attempts.connect_failed(endpoint, error.failure, str(error)) == Next.STOP:
                        break
                    continue
                except PoolExhausted:
                    if attempts.pool_busy(endpoint) == Next.STOP:
                        break
                    continue
            if exchange.client_gone:
                # The client left while we waited for admission or a connection: send nothing.
                pool.release(conn, reusable=True)
                self.settle(admission, Settlement.RELEASE)
                return
            relay = ResponseRelay(exchange, conn, response_headers, metering)
            exchange.on_client_lost = relay.client_lost
            exchange.on_pause_writing = relay.pause_upstream
            exchange.on_resume_writing = relay.resume_upstream
            overhead = _perf() - exchange.t_start
            if self.route_headers:
                response_headers.append((b"x-gridgate-overhead-ms", b"%.3f" % (overhead * 1000.0)))
            cluster.begin(endpoint)
            attempts.sent()
            try:
                conn.send_request(relay, exchange.method, exchange.target,
                                  [(b"host", endpoint.host_header), *forward], body)
                if exchange.client_paused:
                    relay.pause_upstream()  # the client is still behind on an earlier response
                await relay.done
            finally:
                cluster.end(endpoint)
            if relay.response_started:
                self.metrics.overhead(overhead)
                self.metrics.request(cluster.name, relay.status)
                cluster.record_success(endpoint, relay.status)
                client_gone = relay.client_left
                self.settle(admission, settlement_for(relay.status, relay.total_tokens, client_gone),
                            relay.total_tokens)
                return
            if relay.failure is None:  # the client left before the response started
                self.settle(admission, Settlement.CHARGE_ESTIMATE)
                return
            if self.route_headers:
                response_headers.pop()  # the overhead header is re-measured on the next attempt
            self.metrics.retry()
            cluster.record_failure(endpoint, relay.failure)
            if attempts.failed_before_head(endpoint, relay.failure, relay.detail, conn.reused) == Next.STOP:
                break
        self.settle(admission, Settlement.CHARGE_ESTIMATE if attempts.reached else Settlement.RELEASE)
        self.refuse(exchange, attempts.error_reply(), request_id)
