"""The request lifecycle, top to bottom: headers -> authenticate -> tenant policy -> capability ->
pin -> admit (quota) -> route -> forward (workers/forwarding.py: providers, endpoints, relay) ->
settle the reservation.

Each step returns its result or an ``ErrorReply``; the first reply ends the request.
"""

from __future__ import annotations

import time
from hmac import compare_digest
from urllib.parse import unquote_to_bytes

from gateway.auth import Authenticator
from gateway.capability import CapabilityRequest, lookup_capability, request_features, session_key
from gateway.http.errors import ErrorReply
from gateway.ids import CounterIds
from gateway.metrics.writer import WorkerMetrics
from gateway.quota.estimate import estimate_prompt_tokens
from gateway.quota.gate import Admission, QuotaGate
from gateway.quota.usage import rewrite_request_for_usage
from gateway.request.attempts import Settlement
from gateway.request.headers import ACCEPT_ENCODING, HeaderPlan, RequestHeaders
from gateway.routing import RouteDecision, Router
from gateway.routing.eligibility import Needs
from gateway.routing.plan import model_not_found
from gateway.routing.tenants import Policy, TenantPolicies, model_not_allowed
from workers.access_log import AccessLog
from workers.clusters import ClusterManager
from workers.exchange import Exchange
from workers.forwarding import Forwarder, ProxyRequest
from workers.outcomes import Outcomes
from workers.overlay_follower import OverlayFollower
from workers.providers import ProviderStates
from workers.proxy_settings import ProxySettings

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
        self.providers = providers
        self.quota = quota
        self.metrics = metrics
        self.access_log = access_log
        self.outcomes = Outcomes(quota, metrics, access_log, settings.route_headers)
        self.forwarder = Forwarder(settings=settings, overlay=overlay, router=router, clusters=clusters,
                                   providers=providers, outcomes=self.outcomes)
        self.ids = CounterIds(b"-")

    async def handle(self, exchange: Exchange) -> None:
        headers = self.header_plan.scan(exchange.headers)
        request_id = headers.request_id or self.ids.next()
        refuse = self.outcomes.refuse
        tenant = self.authenticate(exchange, headers)
        if type(tenant) is ErrorReply:
            return refuse(exchange, tenant, request_id)
        policy = self.tenants.get(tenant)
        if exchange.method == b"GET" and exchange.target.startswith(b"/v1/models"):
            return self.models(exchange, policy, request_id, tenant)
        capability = self.capability(exchange, headers)
        if type(capability) is ErrorReply:
            return refuse(exchange, capability, request_id, tenant=tenant)
        name = capability.name
        if not policy.allows(name):
            return refuse(exchange, model_not_allowed(tenant, name), request_id, tenant=tenant, capability=name)
        pinned = None
        if headers.pin is not None:
            pinned = self.pin(capability, headers.pin, policy)
            if type(pinned) is ErrorReply:
                return refuse(exchange, pinned, request_id, tenant=tenant, capability=name)
        admission = None
        quota = self.quota
        if quota is not None:
            # Reserve tokens before routing: a denial never reaches a provider (429/503 with headers).
            fields = capability.body
            admission = quota.admission(tenant, name, len(exchange.body),
                                        fields.completion_allowance if fields is not None else None)
            if admission is not None:
                if admission.__class__ is not Admission:  # the ledger decides: await this tick's batch
                    admission = await admission
                if not admission.allowed:
                    return refuse(exchange, refusal(admission), request_id, tenant=tenant, capability=name)
        session = None
        if self.settings.affinity_enabled:
            session = session_key(headers.session, headers.cookie, self.settings.affinity_cookie)
        needs = self.needs(exchange, capability, policy) if self.settings.filters else None
        key = self.hash_key(tenant, session, request_id, headers) if self.settings.stable_hash_key else b""
        route = pinned or self.route(capability, session, needs, key)
        if type(route) is ErrorReply:
            self.outcomes.settle(admission, Settlement.RELEASE)
            router = self.router  # a 400/422 from the filters: the access line says what they removed
            return refuse(exchange, route, request_id, tenant=tenant, capability=name, filtered=router.filtered,
                          reasons=router.filtered_reasons)
        filtered = self.router.filtered if pinned is None else 0
        body, metering = upstream_body(capability, exchange.body, admission)
        request = ProxyRequest(
            exchange, request_id, tenant, policy.batch, name, admission, session, needs, key, filtered,
            self.router.filtered_reasons if filtered else 0,
            headers.balance_keys, body, metering, forwarded_headers(exchange, headers, request_id, body),
            [(b"x-gridgate-filtered", b"%d" % filtered)] if filtered and self.settings.route_headers else [],
        )
        try:
            await self.forwarder.forward(request, route)
        except BaseException:
            self.outcomes.settle(admission, Settlement.CHARGE_ESTIMATE)  # a provider may have worked on it
            raise

    # -- steps ------------------------------------------------------------------------------------
    def authenticate(self, exchange: Exchange, headers: RequestHeaders) -> str | ErrorReply:
        """The tenant of the presented key; 401 when auth is on and the key is missing or unknown."""
        if self.auth is None:
            return ANONYMOUS_TENANT
        # A keep-alive client sends the same key with every request: when both key headers equal those
        # its connection's last request was admitted with (compared in constant time), the tenant is
        # that request's, without hashing again. The key stays with the connection, whose buffers hold
        # it anyway, and goes with it; nothing keyed by a raw key outlives a connection.
        authorization = headers.authorization or b""
        api_key = headers.api_key or b""
        conn = exchange.conn
        memo = conn.auth_memo
        if memo is not None and compare_digest(memo[0], authorization) and compare_digest(memo[1], api_key):
            return memo[2]
        tenant = self.auth.authenticate(headers.authorization, headers.api_key)
        if tenant is not None:
            conn.auth_memo = (authorization, api_key, tenant)
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
                return self.outcomes.refuse(exchange, model_not_found("inference_model", model), request_id,
                                            tenant=tenant)
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
            completion = fields.completion_allowance or 0  # the allowance the quota reserves for
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

    def route(self, request: CapabilityRequest, session: bytes | None, needs: Needs | None,
              key: bytes) -> RouteDecision | ErrorReply:
        now = _monotonic()
        self.providers.maybe_refresh(now)
        router = self.router
        decision = router.route(self.overlay.snapshot, request.kind, request.name, session, now, needs, key)
        if router.filtered:
            self.metrics.route_filtered(router.filtered_reasons)
        if type(decision) is not ErrorReply:
            self.metrics.affinity(decision.affinity)
        return decision



def upstream_body(request: CapabilityRequest, body: bytes, admission: Admission | None) -> tuple[bytes, bool | None]:
    """The body to send and the metering mode (None: not metered; True: rewritten to ask for usage).

    A metered stream whose client did not ask for a usage chunk is rewritten to ask for one; the relay's
    usage filter then removes that chunk so the client sees exactly what it asked for.
    """
    if admission is None or not admission.metered:
        return body, None
    fields = request.body
    if fields is not None and fields.stream and not fields.include_usage:
        rewritten = rewrite_request_for_usage(body)
        if rewritten is not None:
            return rewritten, True
    return body, False


def forwarded_headers(exchange: Exchange, headers: RequestHeaders, request_id: bytes,
                      body: bytes) -> list[tuple[bytes, bytes]]:
    """The headers every provider attempt sends (each provider's own are added per attempt). The
    client's ``Accept-Encoding`` goes last, where a metered request's ``identity`` replaces it
    (``gateway.request.headers.ask_identity_encoding``)."""
    forward = headers.forward
    peer = exchange.peer
    xff = headers.xff
    forward.append((b"x-forwarded-for", xff + b", " + peer if xff else peer))
    forward.append((b"x-request-id", request_id))
    if body:
        forward.append((b"content-length", b"%d" % len(body)))
    elif exchange.method not in _BODYLESS_METHODS:
        forward.append((b"content-length", b"0"))
    if headers.accept_encoding is not None:
        forward.append((ACCEPT_ENCODING, headers.accept_encoding))
    return forward


def refusal(admission: Admission) -> ErrorReply:
    """The answer to a request the quota did not admit (429 with the budget headers, or 503)."""
    message, error_type, code = admission.error or ("request not admitted", None, "quota_unavailable")
    return ErrorReply(admission.status or 503, code, message, admission.headers, error_type=error_type)
