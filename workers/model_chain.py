"""A request whose model is an alias or has a fallback chain (docs/models.md): its models in turn.

The provider failover (workers/forwarding.py) walks the providers of one model; this walks the models
of the chain on top of it, sharing one ``Failover``: one ``routing.retry`` deadline and one attempt
budget for the whole chain, and, as everywhere, nothing is retried once a response byte went to the
client. A model moves the request on when every provider of it failed for a listed reason, or at once
when the eligibility filter refused it (``context_length_exceeded``) or nothing admits it. Each next model
is checked against the tenant's policy and the key's models first: a forbidden one is skipped (counted),
never tried. The request keeps its one admission (its reservation settles once, for all the attempts).

Requests for a model with no alias and no chain never come here (workers/proxy.py).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

from gateway.http.errors import ErrorReply
from gateway.metrics.writer import WorkerMetrics
from gateway.models.aliases import retarget_body
from gateway.models.fallbacks import failure_reason, provider_reason, refusal_reason
from gateway.request.capability import CapabilityRequest
from gateway.routing import RouteDecision
from gateway.routing.decision import RouteRefusal
from gateway.routing.eligibility import Needs
from gateway.routing.failover import Failover
from gateway.routing.tenants import Policy
from workers.forwarding import Forwarder
from workers.head_gate import Admitted
from workers.model_access import may_use
from workers.overlay_follower import OverlayFollower
from workers.proxy_settings import ProxySettings
from workers.request_record import RequestRecord

# How the chain routes each next model: the proxy's ``route`` (request, session, needs, key, bars).
RouteModel = Callable[[CapabilityRequest, bytes | None, Needs | None, bytes, frozenset[int] | None],
                      RouteDecision | ErrorReply]

_monotonic = time.monotonic


class ModelChain:
    """One per worker, beside the proxy: the parts it forwards with and the callable it routes each next
    model with (``route``), never the proxy itself."""

    def __init__(self, *, settings: ProxySettings, overlay: OverlayFollower, forwarder: Forwarder,
                 metrics: WorkerMetrics, route: RouteModel) -> None:
        self.overlay = overlay
        self.forwarder = forwarder
        self.metrics = metrics
        self.route = route
        self.retry = settings.retry
        self.first_byte_timeout = settings.first_byte_timeout is not None
        self.model_header = settings.model_header
        self.rng = random.Random()
        self.kind = "inference_model"  # only models have aliases and chains (workers/proxy.py)

    async def walk(self, record: RequestRecord, capability: CapabilityRequest, admitted: Admitted,
                   policy: Policy, route: RouteDecision | ErrorReply, pinned: bool) -> ErrorReply | None:
        """Serve the request from its model, or the next ones of its chain. None: the request is over
        (answered, or the client left); else the answer to give."""
        entry = record.model_route
        assert entry is not None
        failover = Failover(self.retry, _monotonic() + float(self.retry.deadline), self.rng)
        hops_left = 0 if pinned else entry.hops  # a pinned route never moves (docs/routing.md)
        following = iter(entry.chain)
        model = capability.name
        reply: ErrorReply | None = None
        while True:
            reason: str | None
            if type(route) is RouteDecision:
                self._retarget(record, model, admitted)
                reply = await self.forwarder.forward(record, route, failover, hops_left > 0, entry.refusals)
                if reply is None or record.exchange.client_gone:
                    return reply
                reason = failure_reason([provider_reason(r, self.first_byte_timeout) for r in failover.replies],
                                        entry.on)
            else:
                reason = refusal_reason(route, entry.on)  # type: ignore[arg-type]
                if reason is None and reply is not None and route.code == "model_not_found":  # type: ignore[union-attr]
                    # The overlay stopped serving this model since it was chosen: on to the next one,
                    # with the last model's answer kept for the client.
                    reason = record.fallback_reasons[-1]  # type: ignore[index]
                else:
                    reply = route  # type: ignore[assignment]
            if reason is None or hops_left == 0 or not failover.may_try_another(_monotonic()):
                return reply
            next_model = self._next_allowed(record, model, following, policy, admitted)
            if next_model is None:
                return reply
            hops_left -= 1
            self._moved(record, model, next_model, reason)
            if type(route) is RouteDecision:
                failover.next_model()
                await asyncio.sleep(failover.backoff())
                if record.exchange.client_gone:
                    return None
            model = next_model
            route = self._route(record, capability, model)

    def _next_allowed(self, record: RequestRecord, model: str, following: object, policy: Policy,
                      admitted: Admitted) -> str | None:
        """The next model of the chain the overlay serves and the tenant and the key may use; the others
        are skipped (counted), never tried."""
        served = self.overlay.snapshot.capabilities
        for candidate in following:  # type: ignore[attr-defined]
            if (self.kind, candidate) in served and may_use(policy, admitted.managed, candidate):
                return candidate
            record.fallback_skipped += 1
            self.metrics.fallback_skipped(model, candidate)
        return None

    def _moved(self, record: RequestRecord, model: str, next_model: str, reason: str) -> None:
        record.fallback_hops += 1
        if record.fallback_reasons is None:
            record.fallback_reasons = [reason]
        else:
            record.fallback_reasons.append(reason)
        record.served_model = next_model
        self.metrics.fallback(model, next_model, reason)

    def _route(self, record: RequestRecord, capability: CapabilityRequest, model: str) -> RouteDecision | ErrorReply:
        """The next model's route, with the request's filters, key and bars; no session: a binding belongs
        to the model the session asked for."""
        record.session = None
        route = self.route(CapabilityRequest(capability.kind, model, capability.body), None, record.needs,
                                 record.key, record.barred)
        if type(route) is RouteDecision or type(route) is RouteRefusal:
            record.filtered, record.filtered_reasons = route.filtered, route.filtered_reasons
        return route

    def _retarget(self, record: RequestRecord, model: str, admitted: Admitted) -> None:
        """The upstream request names ``model``: the body's ``model`` (msgspec; only when it differs) and
        the model header when the client sent one."""
        body = retarget_body(record.body, model)
        forward = record.forward
        assert forward is not None
        if body is not None:
            record.body = body
            for index, (name, _value) in enumerate(forward):
                if name == b"content-length":
                    forward[index] = (name, b"%d" % len(body))
        if admitted.headers.model is not None:
            wanted = model.encode("utf-8")
            for index, (name, value) in enumerate(forward):
                if name == self.model_header and value != wanted:
                    forward[index] = (name, wanted)
