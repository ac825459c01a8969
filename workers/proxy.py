"""The request lifecycle, top to bottom: admitted on its head (workers/head_gate.py: key, allowed
route, header scan) -> capability -> tenant policy -> pin -> route -> admit (quota) -> forward
(workers/forwarding.py: providers, endpoints, relay) -> the record closes (workers/outcomes.py: settle
the reservation, metrics, access line).

Each step returns its result or an ``ErrorReply``; the first reply ends the request. What the end
needs is gathered on the request's ``RequestRecord`` (workers/request_record.py).
"""

from __future__ import annotations

import random
import time
from urllib.parse import unquote_to_bytes

from gateway.http.errors import ErrorReply
from gateway.metrics.writer import WorkerMetrics
from gateway.quota.gate import Admission, QuotaGate
from gateway.quota.report import QuotaBackendUnavailable, spend_of
from gateway.request.capability import (
    MCP_SESSION_NAME,
    CapabilityRequest,
    body_features,
    lookup_capability,
    session_key,
)
from gateway.request.estimate import MAX_ALLOWANCE, estimate_prompt_tokens
from gateway.request.headers import ACCEPT_ENCODING, RequestHeaders
from gateway.request.routes import MCP, MODELS, AllowedRoute
from gateway.request.usage import rewrite_request_for_usage
from gateway.routing import RouteDecision, Router
from gateway.routing.decision import RouteRefusal
from gateway.routing.eligibility import Needs
from gateway.routing.evidence import route_evidence
from gateway.routing.plan import model_not_found
from gateway.routing.tenants import Policy, TenantPolicies, model_not_allowed
from workers.clusters import ClusterManager
from workers.exchange import Exchange
from workers.forwarding import Forwarder
from workers.head_gate import Admitted
from workers.key_gate import key_answer, model_not_allowed_for_key
from workers.model_chain import ModelChain
from workers.outcomes import Outcomes
from workers.overlay_follower import OverlayFollower
from workers.providers import ProviderStates
from workers.proxy_settings import ProxySettings
from workers.request_record import RequestRecord
from workers.tracing import Tracer

_monotonic = time.monotonic
_random = random.random
_FORM_URLENCODED = b"application/x-www-form-urlencoded"
_JSON_HEADER = (b"content-type", b"application/json")
_BODYLESS_METHODS = (b"GET", b"HEAD", b"DELETE", b"OPTIONS")
INFERENCE_MODEL = "inference_model"


class Proxy:
    """Per-worker request handler; ``handle`` runs once per request."""

    def __init__(
        self, *, settings: ProxySettings, tenants: TenantPolicies, overlay: OverlayFollower, router: Router,
        clusters: ClusterManager, providers: ProviderStates, quota: QuotaGate | None, metrics: WorkerMetrics,
        outcomes: Outcomes, tracer: Tracer | None = None,
    ) -> None:
        self.settings = settings
        self.tracer = tracer  # None: tracing is off (docs/tracing.md)
        self.tenants = tenants
        self.overlay = overlay
        self.router = router
        self.providers = providers
        self.quota = quota
        self.metrics = metrics
        self.outcomes = outcomes
        self.forwarder = Forwarder(settings=settings, overlay=overlay, router=router, clusters=clusters,
                                   outcomes=outcomes)
        self.model_routes = settings.models
        self.chain = ModelChain(settings=settings, overlay=overlay, forwarder=self.forwarder, metrics=metrics,
                                route=self.route)

    async def handle(self, exchange: Exchange) -> None:
        """One request, from its admitted head to its end. Its record closes exactly once: as its answer
        ends (the exchange closes it), or here when the request ends without one (the client left, an
        exception: the server answers 500)."""
        admitted: Admitted | None = exchange.admitted  # key, route and headers, decided on the head
        if admitted is None:  # fail closed: nothing is forwarded unless the head gate admitted it
            raise RuntimeError("the server in front of the proxy runs no head gate (workers/head_gate.py)")
        record = exchange.record = RequestRecord(exchange=exchange, ends=self.outcomes,
                                                 request_id=admitted.request_id, tenant=admitted.tenant)
        if self.tracer is not None:
            record.trace = self.tracer.begin(record, admitted.headers.balance_keys, admitted.route.surface.name,
                                             exchange.t_start)
        try:
            policy = self.tenants.get(admitted.tenant)
            if admitted.route.kind <= MODELS:  # answered by the gateway: the model list, or the key
                if admitted.route.kind == MODELS:
                    return self.models(record, policy)
                return await self.key(record, admitted)
            capability = self.capability(exchange, admitted.headers, admitted.route)
            if type(capability) is ErrorReply:
                return self.outcomes.refuse(record, capability)
            models = self.model_routes
            if models:  # an alias resolves before policy, quota rules and prices (docs/models.md)
                chosen = models.get(capability.name)
                if chosen is not None and capability.kind == INFERENCE_MODEL:
                    record.model_route = chosen
                    capability = CapabilityRequest(INFERENCE_MODEL, chosen.target, capability.body)
            record.capability = capability.name
            record.batch = policy.batch
            pinned = self.permit(capability, admitted, policy)
            if type(pinned) is ErrorReply:
                return self.outcomes.refuse(record, pinned)
            if self.outcomes.reject_unpriced and not self.outcomes.prices.admits(capability.name):  # type: ignore[union-attr]
                return self.outcomes.refuse(record, model_not_priced(capability.name))
            quota = self.quota
            surface = admitted.route.surface
            if quota is not None and surface.metered:  # count_tokens generates no tokens: never metered
                # Reserve tokens before routing: a denial never reaches a provider (429/503 with headers).
                fields = capability.body
                allowance = None
                if fields is not None:
                    # ``BodyFields.completion_allowance`` written out for the usual body, which names
                    # ``max_tokens`` alone, a plain count: one call fewer per request.
                    allowance = fields.max_tokens
                    if (allowance.__class__ is not int or not 0 <= allowance <= MAX_ALLOWANCE  # type: ignore[operator]
                            or fields.max_completion_tokens is not None or fields.max_output_tokens is not None):
                        allowance = fields.completion_allowance
                admission = quota.admission(admitted.tenant, capability.name, len(exchange.body), allowance,
                                            admitted.key)
                if admission is not None:
                    if admission.__class__ is not Admission:  # the ledger decides: await this tick's batch
                        admission = await admission
                    record.shadow = admission.shadow  # limits in shadow mode that would have refused it
                    if not admission.allowed:
                        return self.outcomes.refuse(record, refusal(admission))
                    record.admission = admission
            route = pinned or self.decide(record, capability, admitted, policy)
            chained = record.model_route is not None  # an alias, or a fallback chain: walked even unrouted
            if chained or type(route) is RouteDecision:
                record.body, record.metering = upstream_body(capability, exchange.body, record.admission,
                                                             surface.rewrites_stream)
                record.forward = forwarded_headers(exchange, admitted.headers, record.request_id, record.body)
                record.balance_keys = admitted.headers.balance_keys
                if chained:
                    route = await self.chain.walk(record, capability, admitted, policy, route, pinned is not None)
                else:
                    route = await self.forwarder.forward(record, route)  # type: ignore[arg-type]
            if route is not None and not exchange.client_gone:
                self.outcomes.refuse(record, route)
        finally:
            record.close()

    # -- steps ------------------------------------------------------------------------------------
    def permit(self, capability: CapabilityRequest, admitted: Admitted,
               policy: Policy) -> RouteDecision | ErrorReply | None:
        """The tenant's policy for the capability, and its pin: None (route it), the pinned route, or the
        refusal."""
        if not policy.allows(capability.name):
            return model_not_allowed(admitted.tenant, capability.name)
        managed = admitted.managed
        if managed is not None and managed.models is not None:  # the key's own models globs
            refused = model_not_allowed_for_key(managed, capability.name)
            if refused is not None:
                return refused
        pin = admitted.headers.pin
        return None if pin is None else self.pin(capability, pin, policy, admitted.route)

    def decide(self, record: RequestRecord, capability: CapabilityRequest, admitted: Admitted,
               policy: Policy) -> RouteDecision | ErrorReply:
        """The route: session, filters and stable_hash key first (they go to the record for failover)."""
        allowed = admitted.route
        headers = admitted.headers
        barred = allowed.barred or None  # the route is allowed only on some clusters: never the others
        settings = self.settings
        # The session fact: for affinity, and for a stable_hash key that names it (affinity on or not).
        session = None
        if settings.session_fact:
            session = headers.session  # the header's key, checked by the scan (gateway/request/headers.py)
            if session is None and settings.affinity_cookie is not None:  # else the cookie's
                session = session_key(None, headers.cookie, settings.affinity_cookie)
        needs = record.needs = self.needs(record.exchange, capability, policy) if settings.filters else None
        key = record.key = (self.hash_key(admitted.tenant, session, record.request_id, headers)
                            if settings.stable_hash_key else b"")
        if not settings.affinity_enabled:
            session = None
        record.barred = barred
        record.session = session if barred is None else None  # a barred request never moves a binding
        route = self.route(capability, session, needs, key, barred)
        if type(route) is RouteDecision or type(route) is RouteRefusal:
            # The filters' counts: evidence on the response and the access line (a 400/422 from them too).
            record.filtered, record.filtered_reasons = route.filtered, route.filtered_reasons
        if type(route) is RouteDecision and (record.trace is not None or self.evidence_sampled()):
            record.evidence = route_evidence(route, self.providers.view, needs, barred)
        if type(route) is not RouteDecision and barred is not None and not self.served_on(allowed, capability):
            return no_allowed_provider(record.exchange, allowed, capability.name)
        return route

    def evidence_sampled(self) -> bool:
        """Whether this request's access line carries the route evidence (``access_log.evidence_sample``)."""
        sample = self.settings.evidence_sample
        return sample >= 1.0 or (sample > 0.0 and _random() < sample)

    def models(self, record: RequestRecord, policy: Policy) -> None:
        """``GET /v1/models`` (the list the tenant may use) and ``GET /v1/models/{id}``, from the overlay."""
        exchange = record.exchange
        target = exchange.target.split(b"?", 1)[0]
        if target == b"/v1/models":
            body = self.overlay.models_body(policy)
        else:
            model = unquote_to_bytes(target[len(b"/v1/models/"):]).decode("utf-8", "replace")
            body = self.overlay.model_body(model, policy) if target.startswith(b"/v1/models/") else None
            if body is None:
                return self.outcomes.refuse(record, model_not_found("inference_model", model))
        record.status = 200
        exchange.respond(200, [_JSON_HEADER, (b"x-request-id", record.request_id)], body)

    async def key(self, record: RequestRecord, admitted: Admitted) -> None:
        """``GET /v1/gridgate/key``: the caller's own key (docs/keys.md); 401 without one. ``remaining``
        is the quota's reading of the key's limits and its tenant's rules (one ledger call), null
        without a quota block or when its backend does not answer in time."""
        key = admitted.key
        if key is None:
            return self.outcomes.refuse(record, ErrorReply(401, "invalid_api_key", "GET /v1/gridgate/key "
                                                           "needs an API key: auth is not configured"))
        remaining = spend = None
        if self.quota is not None:
            try:
                report = await self.quota.key_report(key)
                remaining = {"rules": report["rules"], "keys": report["keys"]}
                spend = spend_of(report)
            except QuotaBackendUnavailable:
                pass
        if record.exchange.client_gone:
            return None
        record.status = 200
        record.exchange.respond(200, [_JSON_HEADER, (b"x-request-id", record.request_id)],
                                key_answer(key, admitted.managed, remaining=remaining, spend=spend))

    def capability(self, exchange: Exchange, headers: RequestHeaders,
                   allowed: AllowedRoute) -> CapabilityRequest | ErrorReply:
        body = exchange.body
        if not body and headers.model is None and exchange.method in _BODYLESS_METHODS:
            if allowed.kind == MCP:
                # The MCP session's event stream (GET) and its end (DELETE) carry no JSON-RPC message:
                # they belong to the session, routed like its messages that name no tool.
                return CapabilityRequest("mcp_tool", MCP_SESSION_NAME, None)
            return ErrorReply(400, "missing_capability", f"{exchange.method.decode()} "
                              f"{exchange.target.split(b'?', 1)[0].decode('latin-1')} names no model: "
                              "send the model header so the gateway knows where to route it")
        content_type = headers.content_type
        if content_type is not None and content_type.startswith(_FORM_URLENCODED) and body[:1] == b"{":
            content_type = None  # `curl -d '{...}'` sends JSON under the form type; read it as JSON
        return lookup_capability(headers.model, body, content_type, self.settings.filters)

    def pin(self, request: CapabilityRequest, pin: bytes, policy: Policy,
            allowed: AllowedRoute) -> RouteDecision | ErrorReply:
        """A pinned route (docs/routing.md): only for tenants with ``may_pin``; no failover; never to a
        provider the request's route is not allowed on."""
        if not policy.may_pin:
            return ErrorReply(403, "pin_not_allowed", "This API key may not pin a route.")
        decision = self.router.pinned(self.overlay.snapshot, request.kind, request.name,
                                      pin.strip().decode("latin-1"))
        if type(decision) is not ErrorReply and decision.provider in allowed.barred:
            return ErrorReply(404, "route_not_allowed", f"This route is not allowed on the pinned provider "
                              f"{decision.cluster!r} (only on {', '.join(sorted(allowed.clusters or ()))}).")
        return decision

    def needs(self, exchange: Exchange, request: CapabilityRequest, policy: Policy) -> Needs:
        """What the request needs from a provider: context, features, the tenant's regions."""
        fields = request.body
        completion = 0
        if fields is not None:
            completion = fields.completion_allowance or 0  # the allowance the quota reserves for
        surface = exchange.admitted.route.surface  # type: ignore[attr-defined]
        return Needs(estimate_prompt_tokens(len(exchange.body)) + completion,
                     body_features(fields, surface.body), policy.regions)

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

    def served_on(self, allowed: AllowedRoute, request: CapabilityRequest) -> bool:
        """Whether a cluster the route is allowed on has a candidate of the capability (error path only)."""
        capability = self.overlay.snapshot.capabilities.get((request.kind, request.name))
        clusters = allowed.clusters or ()
        return capability is not None and any(member.cluster in clusters for member in capability.members)

    def route(self, request: CapabilityRequest, session: bytes | None, needs: Needs | None,
              key: bytes, barred: frozenset[int] | None) -> RouteDecision | ErrorReply:
        now = _monotonic()
        self.providers.maybe_refresh(now)
        decision = self.router.route(self.overlay.snapshot, request.kind, request.name, session, now, needs, key,
                                     barred)
        if type(decision) is RouteDecision:
            if decision.filtered:
                self.metrics.route_filtered(decision.filtered_reasons)
            self.metrics.affinity(decision.affinity)
        elif type(decision) is RouteRefusal:
            self.metrics.route_filtered(decision.filtered_reasons)
        return decision


def no_allowed_provider(exchange: Exchange, allowed: AllowedRoute, capability: str) -> ErrorReply:
    """The route is allowed only on some clusters, and none of them serves the capability."""
    path = exchange.target.split(b"?", 1)[0].decode("latin-1")
    return ErrorReply(404, "route_not_allowed", f"{exchange.method.decode('latin-1')} {path} is allowed only on "
                      f"{', '.join(sorted(allowed.clusters or ()))}, and no provider there serves {capability!r}.")


def upstream_body(request: CapabilityRequest, body: bytes, admission: Admission | None,
                  rewrites_stream: bool = True) -> tuple[bytes, bool | None]:
    """The body to send and the metering mode (None: not metered; True: rewritten to ask for usage).

    A metered stream whose client did not ask for a usage chunk is rewritten to ask for one, on the
    APIs that define that member (``route.surface.rewrites_stream``: the Responses and Messages APIs
    refuse it, and report usage in every stream anyway); the relay's usage filter then removes that
    chunk so the client sees exactly what it asked for.
    """
    if admission is None or not admission.metered:
        return body, None
    fields = request.body
    if rewrites_stream and fields is not None and fields.stream and not fields.include_usage:
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


def model_not_priced(model: str) -> ErrorReply:
    """``pricing.unpriced: reject`` and a model nothing prices (docs/pricing.md): refused before any
    provider sees it."""
    shown = model if len(model) <= 200 else model[:200] + "..."
    return ErrorReply(400, "model_not_priced", f"Model {shown!r} has no price and this gateway refuses unpriced "
                      "models (pricing.unpriced: reject).", error_type="invalid_request_error")


def refusal(admission: Admission) -> ErrorReply:
    """The answer to a request the quota did not admit (429 with the budget headers, or 503)."""
    message, error_type, code = admission.error or ("request not admitted", None, "quota_unavailable")
    return ErrorReply(admission.status or 503, code, message, admission.headers, error_type=error_type)
