"""The request lifecycle as a filter chain (docs/architecture.md, "A request's path").

The head gate (workers/head_gate.py, workers/cors_gate.py) admits the head: key, allowed route, header
scan, a CORS preflight answered there. ``Proxy.handle`` then chooses by the route's kind:

- a route the gateway answers itself (the model list, the key record) goes to its handler
  (workers/local_answers.py), and no step of the proxied path runs;
- a proxied request runs ``Proxy.steps`` in order: an explicit list built once from the configuration, so
  a feature that is off is not a step at all (no alias step without ``models``, no quota step without a
  ``quota`` block). A step reads and writes the request's ``Flow`` and returns None (go on), an
  ``ErrorReply`` (the request ends with that local answer) or, when it must wait, an awaitable of either.

The steps: capability -> aliases -> permission and pin -> unpriced -> quota admission -> prompt prefix ->
route -> forward (workers/forwarding.py, or the model chain of workers/model_chain.py). The record closes once
(workers/outcomes.py: settle the reservation, metrics, access line).
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable, Iterator
from itertools import chain

import msgspec

from gateway.http.errors import ErrorReply
from gateway.metrics.writer import WorkerMetrics
from gateway.quota.gate import Admission, QuotaGate
from gateway.request.capability import (
    MCP_SESSION_NAME,
    CapabilityRequest,
    body_features,
    lookup_capability,
    session_key,
)
from gateway.request.estimate import MAX_ALLOWANCE, estimate_prompt_tokens
from gateway.request.headers import RequestHeaders
from gateway.request.prefix import has_prompt, prompt_prefix
from gateway.request.routes import MCP, MODELS, AllowedRoute
from gateway.routing import RouteDecision, Router
from gateway.routing.decision import RouteRefusal
from gateway.routing.eligibility import Needs
from gateway.routing.evidence import prefix_evidence, route_evidence
from gateway.routing.plan import PREFIX_MODE
from gateway.routing.prefix import PLACED, SPILLED, PrefixEntry
from gateway.routing.tenants import Policy, TenantPolicies
from workers.clusters import ClusterManager
from workers.exchange import Exchange
from workers.forwarding import Forwarder
from workers.head_gate import Admitted
from workers.local_answers import LocalAnswers
from workers.model_access import model_refusal
from workers.model_chain import ModelChain
from workers.outcomes import HitEnds, Outcomes
from workers.overlay_follower import OverlayFollower
from workers.providers import ProviderStates
from workers.proxy_settings import ProxySettings
from workers.request_record import RequestRecord
from workers.response_cache import ANSWERED, ResponseCache
from workers.tracing import Tracer
from workers.upstream_request import BODYLESS_METHODS, forwarded_headers, upstream_body

_monotonic = time.monotonic
_random = random.random
_FORM_URLENCODED = b"application/x-www-form-urlencoded"
INFERENCE_MODEL = "inference_model"


class Flow(msgspec.Struct, gc=False):
    """What the steps of one proxied request hand each other (the record holds what its end needs).
    Built in C (no Python ``__init__`` per request) and part of no cycle."""

    record: RequestRecord
    exchange: Exchange
    admitted: Admitted
    policy: Policy
    request: CapabilityRequest = None  # type: ignore[assignment]  # the capability step sets it
    pinned: RouteDecision | None = None  # a pinned route (docs/routing.md)
    route: RouteDecision | ErrorReply | None = None
    prefix: PrefixEntry | None = None  # the prompt prefix's entry (prefix affinity: docs/routing.md)


# A step's verdict: None (the next step runs), the local answer that ends the request, or an awaitable of
# either (a step that must wait: the quota's ledger, the forwarding).
Verdict = ErrorReply | Awaitable[ErrorReply | None] | None
Step = Callable[[Flow], Verdict]


class Proxy:
    """Per-worker request handler; ``handle`` runs once per request."""

    def __init__(
        self, *, settings: ProxySettings, tenants: TenantPolicies, overlay: OverlayFollower, router: Router,
        clusters: ClusterManager, providers: ProviderStates, quota: QuotaGate | None, metrics: WorkerMetrics,
        outcomes: Outcomes, tracer: Tracer | None = None, cache: ResponseCache | None = None,
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
        self.chain = ModelChain(settings=settings, overlay=overlay, forwarder=self.forwarder, metrics=metrics,
                                route=self.route)
        self.answers = LocalAnswers(overlay=overlay, quota=quota, outcomes=outcomes).by_kind
        self.cache = cache  # None: no response cache (docs/cache.md)
        if cache is not None:
            cache.admit_hit = self.admit_hit
            cache.ends = HitEnds(outcomes)
        self.steps = self.build_steps()
        # Run at once, in the server's read of the request: the steps up to routing (a hit or a refusal needs
        # no task). Routing and forwarding run together in the request's task, as one step of the loop: no
        # other request's pick comes between a route and the lease its forwarding takes.
        routed = next(i for i, step in enumerate(self.steps) if step in (self.read_prefix, self.choose_route))
        self.at_once, self.in_task = self.steps[:routed], self.steps[routed:]

    def build_steps(self) -> tuple[Step, ...]:
        """The proxied path's steps, in order; the features the configuration leaves off are left out."""
        steps: list[Step] = [self.read_capability]
        if self.settings.models:
            steps.append(self.resolve_alias)
        steps.append(self.permit)
        if self.outcomes.reject_unpriced:
            steps.append(self.refuse_unpriced)
        if self.cache is not None:  # before admission: a hit takes no token reservation
            steps.append(self.cache.look_up)
        if self.quota is not None:
            steps.append(self.admit)
        if self.settings.prefix_bytes and self.router.prefixes is not None:
            steps.append(self.read_prefix)
        steps += (self.choose_route, self.forward)
        return tuple(steps)

    def handle(self, exchange: Exchange) -> Awaitable[None] | None:
        """One request, from its admitted head to its end, run at once (in the server's read of it) up to its
        first step that must wait: None when it is over without one (a hit from the worker's own copy, a
        refusal: no task), else the awaitable of the rest (``go_on``: the server awaits it in a task). Its
        record closes exactly once: as its answer ends (the exchange closes it), or as the request ends
        without one (the client left, an exception: the server answers 500)."""
        admitted: Admitted | None = exchange.admitted  # key, route and headers, decided on the head
        if admitted is None:  # fail closed: nothing is forwarded unless the head gate admitted it
            raise RuntimeError("the server in front of the proxy runs no head gate (workers/head_gate.py)")
        record = exchange.record = RequestRecord(exchange=exchange, ends=self.outcomes,
                                                 request_id=admitted.request_id, tenant=admitted.tenant)
        key = admitted.key
        if key is not None and key.via is not None:  # a JWT, a client certificate or a previous secret
            record.identity, record.subject = key.via, key.alias
        if self.tracer is not None:
            record.trace = self.tracer.begin(record, admitted.headers.balance_keys, admitted.route.surface.name,
                                             exchange.t_start)
        later = None  # the rest, once a step must wait: it closes the record then
        try:
            policy = self.tenants.get(admitted.tenant)
            kind = admitted.route.kind
            if kind <= MODELS:  # the kinds below the proxied ones: answered by the gateway itself
                later = self.answer_locally(record, admitted, policy, kind)
                return later
            record.batch = policy.batch
            flow = Flow(record, exchange, admitted, policy)
            steps = iter(self.at_once)
            for step in steps:
                verdict = step(flow)
                if verdict is None:
                    continue
                if not isinstance(verdict, ErrorReply):  # (a refusal may be a subclass: RouteRefusal)
                    later = self.go_on(flow, verdict, chain(steps, self.in_task))
                    return later
                self.end_with(flow, verdict)
                return None
            later = self.go_on(flow, None, iter(self.in_task))
            return later
        finally:
            if later is None:
                record.close()

    async def go_on(self, flow: Flow, pending: Awaitable[ErrorReply | None] | None, steps: Iterator[Step]) -> None:
        """The rest of the request in its task: the verdict of the step that waits (``pending``), then ``steps``."""
        try:
            verdict = None if pending is None else await pending
            if verdict is None:
                for step in steps:
                    verdict = step(flow)
                    if verdict is None:
                        continue
                    if not isinstance(verdict, ErrorReply):
                        verdict = await verdict
                        if verdict is None:
                            continue
                    break
            if verdict is not None:
                self.end_with(flow, verdict)
        finally:
            flow.record.close()

    async def answer_locally(self, record: RequestRecord, admitted: Admitted, policy: Policy, kind: int) -> None:
        """A route the gateway answers itself (workers/local_answers.py)."""
        try:
            await self.answers[kind](record, admitted, policy)
        finally:
            record.close()

    def end_with(self, flow: Flow, verdict: ErrorReply) -> None:
        """A step's local answer ends the request (``ANSWERED``: the step answered it itself, a cache hit)."""
        if verdict is not ANSWERED and not flow.exchange.client_gone:
            self.outcomes.refuse(flow.record, verdict)

    # -- the steps, in their order ------------------------------------------------------------------
    def read_capability(self, flow: Flow) -> ErrorReply | None:
        """What the request asks for (model, tool, ...), from its model header or its body."""
        exchange = flow.exchange
        headers = flow.admitted.headers
        body = exchange.body
        if not body and headers.model is None and exchange.method in BODYLESS_METHODS:
            return self.bodyless_capability(flow)
        content_type = headers.content_type
        if content_type is not None and content_type.startswith(_FORM_URLENCODED) and body[:1] == b"{":
            content_type = None  # `curl -d '{...}'` sends JSON under the form type; read it as JSON
        request = lookup_capability(headers.model, body, content_type, self.settings.filters)
        if type(request) is ErrorReply:
            return request
        flow.request = request  # type: ignore[assignment]
        flow.record.capability = request.name  # type: ignore[union-attr]
        return None

    def bodyless_capability(self, flow: Flow) -> ErrorReply | None:
        """A request without a body or a model header: an MCP session's own requests, else a 400."""
        exchange = flow.exchange
        if flow.admitted.route.kind == MCP:
            # The MCP session's event stream (GET) and its end (DELETE) carry no JSON-RPC message:
            # they belong to the session, routed like its messages that name no tool.
            flow.request = CapabilityRequest("mcp_tool", MCP_SESSION_NAME, None)
            flow.record.capability = MCP_SESSION_NAME
            return None
        return ErrorReply(400, "missing_capability", f"{exchange.method.decode()} "
                          f"{exchange.target.split(b'?', 1)[0].decode('latin-1')} names no model: "
                          "send the model header so the gateway knows where to route it")

    def resolve_alias(self, flow: Flow) -> None:
        """An alias resolves before policy, quota rules and prices (docs/models.md)."""
        request = flow.request
        chosen = self.settings.models.get(request.name)
        if chosen is not None and request.kind == INFERENCE_MODEL:
            record = flow.record
            record.model_route = chosen
            flow.request = CapabilityRequest(INFERENCE_MODEL, chosen.target, request.body)
            record.capability = chosen.target

    def permit(self, flow: Flow) -> ErrorReply | None:
        """Whether the tenant and the key may use the capability, and the route's pin."""
        admitted = flow.admitted
        request = flow.request
        managed = admitted.managed
        if not flow.policy.open or (managed is not None and managed.models is not None):  # else nothing could refuse it
            refused = model_refusal(admitted.tenant, flow.policy, managed, request.name)
            if refused is not None:
                return refused
        pin = admitted.headers.pin
        if pin is None:
            return None
        pinned = self.pin(request, pin, flow.policy, admitted.route)
        if type(pinned) is ErrorReply:
            return pinned
        flow.pinned = pinned  # type: ignore[assignment]
        return None

    def refuse_unpriced(self, flow: Flow) -> ErrorReply | None:
        """``pricing.unpriced: reject``: a model nothing prices never reaches a provider."""
        name = flow.request.name
        return None if self.outcomes.prices.admits(name) else model_not_priced(name)  # type: ignore[union-attr]

    def admit(self, flow: Flow) -> Verdict:
        """Reserve tokens before routing: a denial never reaches a provider (429/503 with headers).
        ``count_tokens`` generates no tokens: never metered."""
        admitted = flow.admitted
        if not admitted.route.surface.metered:
            return None
        request = flow.request
        fields = request.body
        allowance = None
        if fields is not None:
            # ``BodyFields.completion_allowance`` written out for the usual body, which names
            # ``max_tokens`` alone, a plain count: one call fewer per request.
            allowance = fields.max_tokens
            if (allowance.__class__ is not int or not 0 <= allowance <= MAX_ALLOWANCE  # type: ignore[operator]
                    or fields.max_completion_tokens is not None or fields.max_output_tokens is not None):
                allowance = fields.completion_allowance
        record = flow.record
        # A worker-held block's admission is set on the record there (None: go on, as for an unmetered request).
        admission = self.quota.admit_into(record, admitted.tenant, request.name,  # type: ignore[union-attr]
                                          len(flow.exchange.body), allowance, admitted.key)
        if admission is None:
            return None
        if admission.__class__ is not Admission:  # the ledger decides: await this tick's batch
            return self.admitted_later(record, admission)
        record.shadow = admission.shadow  # limits in shadow mode that would have refused it
        if not admission.allowed:
            return refusal(admission)
        record.admission = admission
        return None

    def admit_hit(self, flow: Flow) -> Verdict:
        """A cache hit's admission (docs/cache.md): one request against the request limits (and the deny set
        of revoked keys), no tokens; settled at once, as a request that reached a provider and cost nothing."""
        admitted = flow.admitted
        quota = self.quota
        if quota is None or not admitted.route.surface.metered:
            return None
        if quota.admit_hit(admitted.tenant, flow.request.name, admitted.key):  # a worker-held block took it
            return None
        admission = quota.admission(admitted.tenant, flow.request.name, 0, 0, admitted.key)
        if admission is None:
            return None
        if admission.__class__ is not Admission:
            return self.hit_admitted_later(admission)
        return self.settle_hit(admission)

    async def hit_admitted_later(self, pending: Awaitable[Admission]) -> ErrorReply | None:
        return self.settle_hit(await pending)

    def settle_hit(self, admission: Admission) -> ErrorReply | None:
        if not admission.allowed:
            return refusal(admission)
        self.quota.settle(admission, 0, reached=True, cost_nusd=0)  # type: ignore[union-attr]
        return None

    async def admitted_later(self, record: RequestRecord, pending: Awaitable[Admission]) -> ErrorReply | None:
        """The ledger's decision, once this tick's batch has it (as ``admit`` takes a worker-held one)."""
        admission = await pending
        record.shadow = admission.shadow
        if not admission.allowed:
            return refusal(admission)
        record.admission = admission
        return None

    def read_prefix(self, flow: Flow) -> None:
        """Prefix affinity: the hash of the prompt's leading content, and its entry in the placements."""
        if flow.pinned is None and has_prompt(flow.admitted.route.surface):
            key = prompt_prefix(flow.exchange.body, self.settings.prefix_bytes)
            if key is not None:
                flow.prefix = self.router.prefixes.entry(key)  # type: ignore[union-attr]

    def choose_route(self, flow: Flow) -> ErrorReply | None:
        """The pinned route, or the router's: session, filters and stable_hash key first (they go to the
        record for failover). Unrouted ends here unless a model chain may walk on."""
        if flow.pinned is not None:
            flow.route = flow.pinned
            return None
        record = flow.record
        admitted = flow.admitted
        headers = admitted.headers
        barred = admitted.route.barred or None  # the route is allowed only on some clusters: never the others
        settings = self.settings
        # The session fact: for affinity, and for a stable_hash key that names it (affinity on or not).
        session = None
        if settings.session_fact:
            session = headers.session  # the header's key, checked by the scan (gateway/request/headers.py)
            if session is None and settings.affinity_cookie is not None:  # else the cookie's
                session = session_key(None, headers.cookie, settings.affinity_cookie)
        needs = record.needs = self.needs(flow) if settings.filters else None
        key = record.key = (self.hash_key(admitted.tenant, session, record.request_id, headers)
                            if settings.stable_hash_key else b"")
        if not settings.affinity_enabled:
            session = None
        record.barred = barred
        record.session = session if barred is None else None  # a barred request never moves a binding
        route = flow.route = self.route(flow.request, session, needs, key, barred, flow.prefix)
        if type(route) is RouteDecision:
            if flow.prefix is not None and route.mode == PREFIX_MODE:  # placed by its prompt prefix
                placement = record.prefix = self.router.prefixes.placed  # type: ignore[union-attr]
                self.metrics.prefix_event(SPILLED if placement.spilled else PLACED)  # type: ignore[union-attr]
            if route.filtered:  # the filters' counts: evidence on the response and the access line
                record.filtered, record.filtered_reasons = route.filtered, route.filtered_reasons
            if record.trace is not None or self.evidence_sampled():
                evidence = record.evidence = route_evidence(route, self.providers.view, needs, barred)
                if record.prefix is not None:
                    evidence.prefix = prefix_evidence(record.prefix)
            return None
        return self.unrouted(flow, route, barred)

    def unrouted(self, flow: Flow, route: ErrorReply, barred: frozenset[int] | None) -> ErrorReply | None:
        """No provider: the refusal (a 400/422 of the filters counts them), unless a chain walks on."""
        record = flow.record
        if type(route) is RouteRefusal:
            record.filtered, record.filtered_reasons = route.filtered, route.filtered_reasons
        if barred is not None and not self.served_on(flow.admitted.route, flow.request):
            flow.route = route = no_allowed_provider(flow.exchange, flow.admitted.route, flow.request.name)
        return route if record.model_route is None else None

    def forward(self, flow: Flow) -> Awaitable[ErrorReply | None]:
        """Send the request upstream: one model's providers, or an alias's chain (walked even unrouted)."""
        record = flow.record
        exchange = flow.exchange
        admitted = flow.admitted
        record.body, record.metering = upstream_body(flow.request, exchange.body, record.admission,
                                                     admitted.route.surface.rewrites_stream)
        record.forward = forwarded_headers(exchange, admitted.headers, record.request_id, record.body, record.metering)
        record.balance_keys = admitted.headers.balance_keys
        if record.model_route is not None:
            return self.chain.walk(record, flow.request, admitted, flow.policy, flow.route,  # type: ignore[arg-type]
                                   flow.pinned is not None)
        return self.forwarder.forward(record, flow.route)  # type: ignore[arg-type]

    # -- what the steps use -----------------------------------------------------------------------
    def evidence_sampled(self) -> bool:
        """Whether this request's access line carries the route evidence (``access_log.evidence_sample``)."""
        sample = self.settings.evidence_sample
        return sample >= 1.0 or (sample > 0.0 and _random() < sample)

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

    def needs(self, flow: Flow) -> Needs:
        """What the request needs from a provider: context, features, the tenant's regions."""
        fields = flow.request.body
        completion = 0
        if fields is not None:
            completion = fields.completion_allowance or 0  # the allowance the quota reserves for
        return Needs(estimate_prompt_tokens(len(flow.exchange.body)) + completion,
                     body_features(fields, flow.admitted.route.surface.body), flow.policy.regions)

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
              key: bytes, barred: frozenset[int] | None,
              prefix: PrefixEntry | None = None) -> RouteDecision | ErrorReply:
        now = _monotonic()
        self.providers.maybe_refresh(now)
        decision = self.router.route(self.overlay.snapshot, request.kind, request.name, session, now, needs, key,
                                     barred, prefix)
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
