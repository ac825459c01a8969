"""The request lifecycle, top to bottom: headers -> authenticate -> capability -> admit (quota) ->
route -> [provider: pick an endpoint -> connection -> relay the response] -> settle the reservation.

Each step returns its result or an ``ErrorReply``; the first reply ends the request. ``forward`` tries
providers in the order the router gives (failover, CONTRACT §11: within the attempt budget and one
deadline, only before any response byte reached the client); ``_try_provider`` tries the endpoints of
one provider with ``ProviderAttempts`` (sans-IO) deciding what follows a failure, and a
``ResponseRelay`` streams the provider's answer to the client as it arrives.
"""

from __future__ import annotations

import asyncio
import random
import time
from urllib.parse import unquote_to_bytes

from gateway.auth import Authenticator
from gateway.capability import CapabilityRequest, lookup_capability, request_features, session_key
from gateway.http.errors import ErrorReply
from gateway.ids import CounterIds
from gateway.metrics import WorkerMetrics
from gateway.quota.estimate import estimate_prompt_tokens
from gateway.quota.gate import Admission, QuotaGate
from gateway.quota.usage import rewrite_request_for_usage
from gateway.request.attempts import Next, ProviderAttempts, Settlement, settlement_for
from gateway.request.failover import COOLING_STATUSES, Failover, cooling_seconds, parse_retry_after
from gateway.request.headers import HeaderPlan, RequestHeaders
from gateway.routing import RouteDecision, Router
from gateway.routing.decision import header_value
from gateway.routing.eligibility import Needs
from gateway.routing.plan import model_not_found
from gateway.routing.tenants import Policy, TenantPolicies, model_not_allowed
from workers.access_log import AccessLog
from workers.clusters import ClusterManager, UpstreamCluster, UpstreamEndpoint
from workers.overlay_follower import OverlayFollower
from workers.providers import ProviderStates
from workers.proxy_settings import ProxySettings
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
_ATTEMPTS = tuple((b"x-gridgate-attempts", b"%d" % n) for n in range(64))
_HELD_CODES = {429: "upstream_rate_limited", 502: "upstream_bad_gateway", 503: "upstream_unavailable",
               504: "upstream_timeout"}


def _attempts_header(count: int) -> tuple[bytes, bytes]:
    return _ATTEMPTS[count] if count < len(_ATTEMPTS) else (b"x-gridgate-attempts", b"%d" % count)


class Proxy:
    """Per-worker request handler; ``handle`` runs once per request."""

    def __init__(
        self, *, settings: ProxySettings, header_plan: HeaderPlan, auth: Authenticator | None,
        tenants: TenantPolicies, overlay: OverlayFollower, router: Router, clusters: ClusterManager,
        providers: ProviderStates, quota: QuotaGate | None, metrics: WorkerMetrics, access_log: AccessLog,
    ) -> None:
        self.settings = settings
        self.header_plan = header_plan
        self.auth = auth
        self.tenants = tenants
        self.overlay = overlay
        self.router = router
        self.clusters = clusters
        self.providers = providers
        self.quota = quota
        self.metrics = metrics
        self.route_headers = settings.route_headers
        self.retry = settings.retry
        self.ids = CounterIds(b"-")
        self.rng = random.Random()
        self.access_log = access_log

    async def handle(self, exchange: Exchange) -> None:
        headers = self.header_plan.scan(exchange.headers)
        request_id = headers.request_id or self.ids.next()
        tenant = self.authenticate(headers)
        if type(tenant) is ErrorReply:
            return self.refuse(exchange, tenant, request_id)
        policy = self.tenants.get(tenant)
        if exchange.method == b"GET" and exchange.target.startswith(b"/v1/models"):
            return self.models(exchange, policy, request_id, tenant)
        capability = self.capability(exchange, headers)
        if type(capability) is ErrorReply:
            return self.refuse(exchange, capability, request_id, tenant=tenant)
        name = capability.name
        if not policy.allows(name):
            return self.refuse(exchange, model_not_allowed(tenant, name), request_id, tenant=tenant, capability=name)
        pinned = None
        if headers.pin is not None:
            pinned = self.pin(capability, headers.pin, policy)
            if type(pinned) is ErrorReply:
                return self.refuse(exchange, pinned, request_id, tenant=tenant, capability=name)
        admission = None
        if self.quota is not None:
            admission = await self.admit(tenant, capability, len(exchange.body))
            if type(admission) is ErrorReply:
                return self.refuse(exchange, admission, request_id, tenant=tenant, capability=name)
        session = None
        if self.settings.affinity_enabled:
            session = session_key(headers.session, headers.cookie, self.settings.affinity_cookie)
        needs = self.needs(exchange, capability, policy) if self.settings.filters else None
        key = self.hash_key(tenant, session, request_id, headers) if self.settings.stable_hash_key else b""
        route = pinned or self.route(capability, session, needs, key)
        if type(route) is ErrorReply:
            self.settle(admission, Settlement.RELEASE)
            return self.refuse(exchange, route, request_id, tenant=tenant, capability=name)
        try:
            await self.forward(exchange, headers, capability, route, admission, request_id, session, needs, key,
                               self.router.filtered if pinned is None else 0, tenant, policy.batch)
        except BaseException:
            self.settle(admission, Settlement.CHARGE_ESTIMATE)  # a provider may have worked on it
            raise

    # -- steps ------------------------------------------------------------------------------------
    def authenticate(self, headers: RequestHeaders) -> str | ErrorReply:
        """The tenant of the presented key; 401 when auth is on and the key is missing or unknown."""
        if self.auth is None:
            return ANONYMOUS_TENANT
        tenant = self.auth.authenticate(headers.authorization, headers.api_key)
        if tenant is not None:
            return tenant
        return _MISSING_KEY if headers.authorization is None and headers.api_key is None else _INVALID_KEY

    def models(self, exchange: Exchange, policy: Policy, request_id: bytes, tenant: str) -> None:
        """``GET /v1/models`` (the list the tenant may use) and ``GET /v1/models/{id}``, from the overlay."""
        target = exchange.target.split(b"?", 1)[0]
        if target == b"/v1/models":
            body = self.overlay.models_body(policy)
        else:
            model = unquote_to_bytes(target[len(b"/v1/models/"):]).decode("utf-8", "replace")
            body = self.overlay.model_body(model, policy) if target.startswith(b"/v1/models/") else None
            if body is None:
                return self.refuse(exchange, model_not_found("inference_model", model), request_id, tenant=tenant)
        exchange.respond(200, [_JSON_HEADER, (b"x-request-id", request_id)], body)
        self.metrics.request(None, 200)
        self.access_log.record(exchange, request_id, 200, tenant=tenant)

    def capability(self, exchange: Exchange, headers: RequestHeaders) -> CapabilityRequest | ErrorReply:
        content_type = headers.content_type
        if content_type is not None and content_type.startswith(_FORM_URLENCODED) and exchange.body[:1] == b"{":
            content_type = None  # `curl -d '{...}'` sends JSON under the form type; read it as JSON
        if not exchange.body and headers.model is None and exchange.method in _BODYLESS_METHODS:
            # A bodyless request naming no model is for the gateway itself, and nothing here serves it.
            return ErrorReply(404, "not_found", f"{exchange.method.decode()} {exchange.target.decode('latin-1')} "
                              "is not served by the gateway; proxied requests name a model (body or model header)")
        return lookup_capability(headers.model, exchange.body, content_type, self.settings.filters)

    def pin(self, request: CapabilityRequest, pin: bytes, policy: Policy) -> RouteDecision | ErrorReply:
        """A pinned route (CONTRACT §12): only for tenants with ``may_pin``; no failover."""
        if not policy.may_pin:
            return ErrorReply(403, "pin_not_allowed", "This API key may not pin a route.")
        return self.router.pinned(self.overlay.snapshot, request.kind, request.name,
                                  pin.strip().decode("latin-1"))

    def needs(self, exchange: Exchange, request: CapabilityRequest, policy: Policy) -> Needs:
        """What the request needs from a provider: context, features, the tenant's regions."""
        fields = request.body
        completion = 0
        if fields is not None:
            completion = fields.max_tokens or fields.max_completion_tokens or 0
        return Needs(estimate_prompt_tokens(len(exchange.body)) + completion,
                     request_features(fields, exchange.target), policy.regions)

    def hash_key(self, tenant: str, session: bytes | None, request_id: bytes, headers: RequestHeaders) -> bytes:
        """The stable_hash picker's key, from the configured request facts."""
        parts = []
        for fact in self.settings.stable_hash_key:
            if fact == "tenant":
                parts.append(tenant.encode())
            elif fact == "session":
                parts.append(session or b"")
            elif fact == "request_id":
                parts.append(request_id)
            else:  # ("header", lowercase name)
                parts.append((headers.balance_keys or {}).get(fact[1], b""))
        return b"\x00".join(parts)

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

    def route(self, request: CapabilityRequest, session: bytes | None, needs: Needs | None,
              key: bytes) -> RouteDecision | ErrorReply:
        now = _monotonic()
        self.providers.maybe_refresh(now)
        decision = self.router.route(self.overlay.snapshot, request.kind, request.name, session, now, needs, key)
        if type(decision) is not ErrorReply:
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

    def refuse(self, exchange: Exchange, reply: ErrorReply, request_id: bytes, provider: str | None = None,
               attempts: int = 0, *, tenant: str | None = None, capability: str | None = None,
               route: RouteDecision | None = None, filtered: int = 0) -> None:
        """Answer with a gateway-made error; errors about a provider count under its cluster."""
        self.metrics.request(provider, reply.status)
        extra = [(b"x-request-id", request_id)]
        if self.route_headers and provider is not None:
            extra.append((b"x-gridgate-provider", header_value(provider)))
            extra.append(_attempts_header(attempts))
        exchange.send_error(reply, extra)
        self.access_log.record(exchange, request_id, reply.status, tenant=tenant, capability=capability, route=route,
                               attempts=attempts, error=reply.code, filtered=filtered)

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

    @staticmethod
    def _request_headers(exchange: Exchange, headers: RequestHeaders, request_id: bytes,
                         body: bytes) -> list[tuple[bytes, bytes]]:
        """The headers every provider attempt sends (the per-provider ones are added per attempt)."""
        forward = headers.forward
        peer = exchange.peer
        xff = headers.xff
        forward.append((b"x-forwarded-for", xff + b", " + peer if xff else peer))
        forward.append((b"x-request-id", request_id))
        if body:
            forward.append((b"content-length", b"%d" % len(body)))
        elif exchange.method not in _BODYLESS_METHODS:
            forward.append((b"content-length", b"0"))
        return forward

    def _provider_headers(self, cluster: UpstreamCluster, route: RouteDecision,
                          request_id: bytes) -> list[tuple[bytes, bytes]]:
        headers = list(cluster.auth_headers)
        if cluster.provider_hop:
            headers.append((b"x-ai-routing-candidate", route.evidence[1][1]))
            headers.append((b"x-ai-routing-request-id", request_id))
            if self.overlay.snapshot.is_envelope:
                headers.append((b"x-ai-routing-revision", route.revision.encode()))
        return headers

    async def forward(
        self, exchange: Exchange, headers: RequestHeaders, request: CapabilityRequest, route: RouteDecision,
        admission: Admission | None, request_id: bytes, session: bytes | None, needs: Needs | None, key: bytes,
        filtered: int, tenant: str, batch: bool,
    ) -> None:
        """Try providers until one answers (or the budget is spent); settle the reservation."""
        body, metering = self._upstream_body(request, exchange.body, admission)
        evidence = [(b"x-gridgate-filtered", b"%d" % filtered)] if filtered and self.route_headers else []
        base = self._request_headers(exchange, headers, request_id, body)
        first = route
        failover: Failover | None = None
        reached = False
        deadline = _monotonic() + float(self.retry.deadline)
        while True:
            cluster = self.clusters.by_provider.get(route.provider)
            assert cluster is not None  # the router only picks configured providers
            may_retry = self.retry.attempts > (0 if failover is None else failover.attempts) + 1
            outcome = await self._try_provider(
                exchange, headers, cluster, route, base, body, metering, admission, request_id, deadline,
                hold_retryable=may_retry and route.plan.provider_count > 1 and route.mode != "pinned",
                attempt=1 if failover is None else failover.attempts + 1, evidence=evidence,
                tenant=tenant, batch=batch, capability=request.name, filtered=filtered,
            )
            if outcome is None:  # answered (or the client left): settled
                if session is not None and route.provider != first.provider:
                    self.router.rebind(session, route, _monotonic())  # the binding moves to who served
                return
            reply, provider_reached = outcome
            reached = reached or provider_reached
            if failover is None:
                failover = Failover(self.retry, deadline, self.rng)
            failover.failed(route.provider, reply)
            if not failover.may_try_another(_monotonic()) or exchange.client_gone or route.mode == "pinned":
                break
            following = self.router.failover(first, failover.tried, needs, key)
            if following is None:
                break
            self.metrics.retry()
            await asyncio.sleep(failover.backoff())
            route = following
        self.settle(admission, Settlement.CHARGE_ESTIMATE if reached else Settlement.RELEASE)
        if not exchange.client_gone:
            self.refuse(exchange, failover.last_reply, request_id, cluster.name, failover.attempts, tenant=tenant,
                        capability=request.name, route=route, filtered=filtered)
        else:
            self.access_log.record(exchange, request_id, 499, tenant=tenant, capability=request.name, route=route,
                                   attempts=failover.attempts, error="client_closed", filtered=filtered)

    async def _try_provider(
        self, exchange: Exchange, headers: RequestHeaders, cluster: UpstreamCluster, route: RouteDecision,
        base: list[tuple[bytes, bytes]], body: bytes, metering: bool | None, admission: Admission | None,
        request_id: bytes, deadline: float, hold_retryable: bool, attempt: int,
        evidence: list[tuple[bytes, bytes]], tenant: str, batch: bool, capability: str, filtered: int,
    ) -> tuple[ErrorReply, bool] | None:
        """One provider, its endpoints in turn. None: the request is over (answered, or the client left,
        and settled); else the reply to give if no other provider serves, and whether a request was sent."""
        upstream_headers = [*base, *self._provider_headers(cluster, route, request_id)]
        response_headers = [(b"x-request-id", request_id)]
        if self.route_headers:
            response_headers.append(_attempts_header(attempt))
            response_headers += route.evidence
            response_headers += evidence
        if admission is not None:
            response_headers += admission.headers
        key = cluster.balance_key(headers.balance_keys, exchange.target)
        first_byte = self.settings.first_byte_timeout
        attempts: ProviderAttempts[UpstreamEndpoint] = ProviderAttempts(cluster.name)
        while (endpoint := cluster.pick(key, attempts.excluded)) is not None:
            pool = endpoint.pool
            cluster.begin(endpoint)  # in flight from the pick: a hanging connect attracts no more picks
            try:
                conn = None if attempts.fresh else pool.try_acquire()
                if conn is None:
                    try:
                        conn = await pool.acquire(fresh=attempts.fresh, timeout=deadline - _monotonic(),
                                                  tenant=tenant, batch=batch)  # fair order among waiters
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
                    self.access_log.record(exchange, request_id, 499, tenant=tenant, capability=capability,
                                           route=route, attempts=attempt, error="client_closed", filtered=filtered)
                    return None
                relay = ResponseRelay(exchange, conn, response_headers, metering, hold_retryable)
                exchange.on_client_lost = relay.client_lost
                exchange.on_pause_writing = relay.pause_upstream
                exchange.on_resume_writing = relay.resume_upstream
                overhead = _perf() - exchange.t_start
                if self.route_headers:
                    response_headers.append((b"x-gridgate-overhead-ms", b"%.3f" % (overhead * 1000.0)))
                attempts.sent()
                sent_at = _monotonic()
                head_by = deadline if first_byte is None else min(deadline, sent_at + first_byte)
                conn.send_request(relay, exchange.method, exchange.target,
                                  [(b"host", endpoint.host_header), *upstream_headers], body, head_by)
                if exchange.client_paused:
                    relay.pause_upstream()  # the client is still behind on an earlier response
                await relay.done
            finally:
                cluster.end(endpoint)
            status = relay.status
            if status:
                self.providers.observe_first_byte(cluster.provider, relay.first_byte_at - sent_at)
            if status in COOLING_STATUSES:
                self._cool(cluster, relay.retry_after)
            if relay.response_started:
                self.metrics.overhead(overhead)
                self.metrics.request(cluster.name, status)
                cluster.record_success(endpoint, status)
                tokens = relay.total_tokens
                self.settle(admission, settlement_for(status, tokens, relay.client_left), tokens)
                failure = relay.failure
                self.access_log.record(
                    exchange, request_id, status, tenant=tenant, capability=capability, route=route, attempts=attempt,
                    endpoint=endpoint.address, overhead_s=overhead, filtered=filtered,
                    error=f"upstream_{failure.name.lower()}" if failure else "client_closed" if relay.client_left else None,
                )
                return None
            if relay.held_status:
                cluster.record_success(endpoint, status)  # it answered: a 429 is a cooling signal, not a failure
                return self._held_reply(cluster, status, relay.retry_after), True
            if relay.failure is None:  # the client left before the response started
                self.settle(admission, Settlement.CHARGE_ESTIMATE)
                self.access_log.record(exchange, request_id, 499, tenant=tenant, capability=capability, route=route,
                                       attempts=attempt, endpoint=endpoint.address, error="client_closed",
                                       filtered=filtered)
                return None
            if self.route_headers:
                response_headers.pop()  # the overhead header is re-measured on the next attempt
            self.metrics.retry()
            cluster.record_failure(endpoint, relay.failure)
            if _monotonic() >= deadline:
                break
            if attempts.failed_before_head(endpoint, relay.failure, relay.detail, conn.reused) == Next.STOP:
                break
        return attempts.error_reply(), attempts.reached

    def _cool(self, cluster: UpstreamCluster, retry_after: bytes | None) -> None:
        """A 429/503 cools its provider in every worker of the host (Retry-After wins, capped)."""
        seconds = cooling_seconds(parse_retry_after(retry_after, time.time()), self.settings.cooling)
        self.providers.cool(cluster.provider, seconds, _monotonic())

    @staticmethod
    def _held_reply(cluster: UpstreamCluster, status: int, retry_after: bytes | None) -> ErrorReply:
        """The client's answer if the provider's retryable status ends up being the last word."""
        headers = []
        if retry_after is not None and status in COOLING_STATUSES:
            headers.append((b"retry-after", retry_after))
        return ErrorReply(status, _HELD_CODES[status], f"{cluster.name}: answered {status}", headers)
