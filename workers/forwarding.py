"""The upstream half of a request: providers in the router's order (failover, docs/routing.md
"Failover"), and inside one provider its endpoints in turn, until one answers.

``Forwarder.forward`` walks providers within the attempt budget and one deadline, only before any
response byte reached the client; ``_try_provider`` tries the endpoints of one provider, each under an
``EndpointLease`` (in flight while held; its outcome feeds outlier detection), with ``ProviderAttempts``
(sans-IO) deciding what follows a failure. A ``ResponseRelay`` streams the answer to the client as it
arrives and answers an ``AttemptResult``. What an attempt that did not serve cost is added to the
request's record (``owed``); the attempt that serves (or is in progress when the request ends) is the
record's ``attempt``, accounted when the record closes (workers/outcomes.py).
"""

from __future__ import annotations

import asyncio
import random
import time

from gateway.http.errors import ErrorReply
from gateway.request.attempts import (
    AttemptResult,
    Next,
    ProviderAttempts,
    attempt_tokens,
    never_taken,
    unanswered_tokens,
)
from gateway.routing import RouteDecision, Router
from gateway.routing.failover import COOLING_STATUSES, Failover
from workers.clusters import ClusterManager, EndpointLease, UpstreamCluster, UpstreamEndpoint
from workers.outcomes import Outcomes, attempts_header, served_model_headers
from workers.overlay_follower import OverlayFollower
from workers.proxy_settings import ProxySettings
from workers.relay import ResponseRelay
from workers.request_record import RequestRecord
from workers.response_cache import CACHE_HEADERS
from workers.upstream import ConnectFailed, PoolExhausted, UpstreamConnection

_perf = time.perf_counter
_monotonic = time.monotonic
_HELD_CODES = {429: "upstream_rate_limited", 502: "upstream_bad_gateway", 503: "upstream_unavailable",
               504: "upstream_timeout"}


class Forwarder:
    def __init__(self, *, settings: ProxySettings, overlay: OverlayFollower, router: Router,
                 clusters: ClusterManager, outcomes: Outcomes) -> None:
        self.settings = settings
        self.retry = settings.retry
        self.route_headers = settings.route_headers
        self.overlay = overlay
        self.router = router
        self.clusters = clusters
        self.outcomes = outcomes
        self.metrics = outcomes.metrics
        self.providers = outcomes.providers
        self.rng = random.Random()

    async def forward(self, record: RequestRecord, route: RouteDecision, failover: Failover | None = None,
                      onward: bool = False, refusals: frozenset[str] | None = None) -> ErrorReply | None:
        """Try providers until one answers (or the budget is spent). None: the request is over (answered,
        or the client left); else the answer to give, about ``record.provider``.

        A fallback chain (workers/model_chain.py) passes its ``failover``, shared by all its models (one
        deadline, one attempt budget), and ``onward`` when another model may still be tried: then a
        retryable answer of this model's last provider is held back too, and so is a 400 whose error code
        is one of ``refusals`` (the chain moves on at once: no other provider of this model is tried)."""
        first = route
        deadline = _monotonic() + float(self.retry.deadline) if failover is None else failover.deadline
        while True:
            cluster = self.clusters.by_provider[route.provider]  # the router only picks configured providers
            attempt = record.attempts = 1 if failover is None else failover.attempts + 1
            record.route = route
            hold = (self.retry.attempts > attempt and (onward or route.plan.provider_count > 1)
                    and route.mode != "pinned")
            reply = await self._try_provider(record, cluster, route, deadline, hold, refusals if onward else None)
            if reply is None:
                if record.session is not None and route.provider != first.provider:
                    self.router.rebind(record.session, route, _monotonic())  # the binding moves to who served
                return None
            if failover is None:
                failover = Failover(self.retry, deadline, self.rng)
            failover.failed(route.provider, reply)
            if (not failover.may_try_another(_monotonic()) or record.exchange.client_gone
                    or route.mode == "pinned" or reply.status == 400):
                break
            following = self.router.failover(first, failover.tried, record.needs, record.key, record.barred)
            if following is None:
                break
            self.metrics.failover(cluster.name)
            await asyncio.sleep(failover.backoff())
            route = following
        record.provider = cluster.name
        return failover.last_reply

    def _upstream_headers(self, record: RequestRecord, cluster: UpstreamCluster,
                          route: RouteDecision) -> list[tuple[bytes, bytes]]:
        """The request's headers plus this provider's own (its credentials, the provider-hop headers)."""
        forward = record.forward
        assert forward is not None
        if not cluster.auth_headers and not cluster.provider_hop:
            return forward
        headers = [*forward, *cluster.auth_headers]
        if cluster.provider_hop:
            headers.append((b"x-ai-routing-candidate", route.stable_id_header))
            headers.append((b"x-ai-routing-request-id", record.request_id))
            if self.overlay.snapshot.is_envelope:
                headers.append((b"x-ai-routing-revision", route.revision.encode()))
        return headers

    def _response_headers(self, record: RequestRecord, route: RouteDecision) -> list[tuple[bytes, bytes]]:
        headers = [(b"x-request-id", record.request_id)]
        if self.route_headers:
            headers.append(attempts_header(record.attempts))
            headers += route.evidence
        if record.admission is not None:
            headers += record.admission.headers
        if record.model_route is not None:  # an alias or a fallback chain: which model serves (docs/models.md)
            headers += served_model_headers(record)
        if record.cache is not None:  # x-gridgate-cache: miss or bypass (docs/cache.md)
            headers.append(CACHE_HEADERS[record.cache])
        return headers

    async def _try_provider(self, record: RequestRecord, cluster: UpstreamCluster, route: RouteDecision,
                            deadline: float, hold_retryable: bool,
                            hold_refusals: frozenset[str] | None = None) -> ErrorReply | None:
        """One provider, its endpoints in turn. None: the request is over (answered, or the client left);
        else the answer to give if no other provider serves."""
        exchange = record.exchange
        upstream_headers = self._upstream_headers(record, cluster, route)
        response_headers = self._response_headers(record, route)
        key = cluster.balance_key(record.balance_keys, exchange.target)
        attempts: ProviderAttempts[UpstreamEndpoint] = ProviderAttempts(cluster.name)
        # Endpoints cooled by a 429/503 are left out while the provider has others (docs/routing.md, "Cooling").
        attempts.excluded = self.providers.cooled_endpoints(cluster.provider)
        while (endpoint := cluster.pick(key, attempts.excluded)) is not None:
            if attempts.failure is not None:
                self.metrics.retry()  # an endpoint of this provider failed: this is a retry inside it
            with cluster.lease(endpoint) as lease:
                conn = None if attempts.fresh else endpoint.pool.try_acquire()
                if conn is None:
                    conn = await self._connect(record, endpoint, lease, attempts, deadline)
                    if conn.__class__ is not UpstreamConnection:
                        if conn == Next.STOP:
                            break
                        continue
                if exchange.client_gone:
                    # The client left while we waited for admission or a connection: send nothing.
                    endpoint.pool.release(conn, reusable=True)
                    return None
                relay = self._send(record, conn, endpoint, response_headers, upstream_headers, deadline,
                                   hold_retryable, hold_refusals)
                try:
                    result: AttemptResult = await relay.done
                finally:
                    # The exchange and its relay point at each other: unlinked, refcounting frees both at
                    # the end of the request instead of leaving a cycle per request to the collector.
                    exchange.listener = None
                if result.status:
                    lease.answered(result.status)
                elif result.failure is not None:
                    lease.failed(result.failure)
            if result.started or result.client_left:
                return None  # served (or the client left): the record accounts this attempt when it closes
            if self._unserved(record, cluster, route, result, conn.reused) is not None:
                return self._held_reply(cluster, result)
            if self.route_headers:
                response_headers.pop()  # the overhead header is re-measured on the next attempt
            # Recorded first, so that a failure at the deadline is reported as what it was (a timeout: 504).
            next_step = attempts.failed_before_head(endpoint, result.failure, result.detail, conn.reused)
            if next_step == Next.STOP or _monotonic() >= deadline:
                break
        return attempts.error_reply()

    async def _connect(self, record: RequestRecord, endpoint: UpstreamEndpoint, lease: EndpointLease,
                       attempts: ProviderAttempts[UpstreamEndpoint], deadline: float) -> UpstreamConnection | Next:
        """A new (or handed-over) connection to ``endpoint``, or what to do next when none came."""
        try:
            return await endpoint.pool.acquire(fresh=attempts.fresh, timeout=deadline - _monotonic(),
                                               tenant=record.tenant or "", batch=record.batch)  # fair order
        except ConnectFailed as error:
            lease.failed(error.failure)
            return attempts.connect_failed(endpoint, error.failure, str(error))
        except PoolExhausted:
            return attempts.pool_busy(endpoint)

    def _send(self, record: RequestRecord, conn: UpstreamConnection, endpoint: UpstreamEndpoint,
              response_headers: list[tuple[bytes, bytes]], upstream_headers: list[tuple[bytes, bytes]],
              deadline: float, hold_retryable: bool, hold_refusals: frozenset[str] | None) -> ResponseRelay:
        """Write the request on ``conn``; the relay streams the answer and says what the attempt came to."""
        exchange = record.exchange
        # A cache miss's leader relays through its capture (workers/response_cache.py), else straight.
        sink = exchange if record.cache_fill is None else record.cache_fill
        relay = ResponseRelay(sink, conn, response_headers, record.metering, hold_retryable, hold_refusals)
        exchange.listener = relay
        record.attempt = relay
        record.endpoint = endpoint
        overhead = record.overhead_s = _perf() - exchange.t_start
        if self.route_headers:
            response_headers.append((b"x-gridgate-overhead-ms", b"%.3f" % (overhead * 1000.0)))
        sent_at = relay.sent_at = _monotonic()
        first_byte = self.settings.first_byte_timeout
        head_by = deadline if first_byte is None else min(deadline, sent_at + first_byte)
        if record.trace is not None:  # the attempt's span, and its traceparent upstream (docs/tracing.md)
            upstream_headers = record.trace.attempt_started(record, endpoint, upstream_headers)
        conn.send_request(relay, exchange.method, exchange.target, endpoint.host_header, upstream_headers,
                          record.body, head_by)
        if exchange.client_paused:
            relay.pause_writing()  # the client is still behind on an earlier response
        return relay

    def _unserved(self, record: RequestRecord, cluster: UpstreamCluster, route: RouteDecision,
                  result: AttemptResult, reused: bool) -> int | None:
        """An attempt that reached the provider and did not serve: what it cost goes to the record, what it
        said to the provider's state. Returns the held status (the answer may be the last word), or None."""
        record.attempt = None
        if record.trace is not None:
            record.trace.attempt_ended(result, record)
        self.outcomes.observe(route.provider, cluster.name, record.endpoint, result)
        if result.held:  # it answered (its body was discarded unread): 4xx nothing, 5xx the estimate
            record.reached = True
            record.owed += attempt_tokens(result.status, None, record.estimate)
            return result.status
        if not never_taken(result.failure, reused):  # type: ignore[arg-type]
            record.reached = True
        record.owed += unanswered_tokens(result.failure, reused, record.estimate)  # type: ignore[arg-type]
        return None

    @staticmethod
    def _held_reply(cluster: UpstreamCluster, result: AttemptResult) -> ErrorReply:
        """The client's answer if the provider's retryable status ends up being the last word."""
        status, retry_after = result.status, result.retry_after
        if result.refusal is not None:  # a 400 a fallback chain moves on (docs/models.md)
            return ErrorReply(400, result.refusal, f"{cluster.name}: answered 400 {result.refusal}")
        headers = []
        if retry_after is not None and status in COOLING_STATUSES:
            headers.append((b"retry-after", retry_after))
        return ErrorReply(status, _HELD_CODES[status], f"{cluster.name}: answered {status}", headers)
