"""The upstream half of a request: providers in the router's order (failover, CONTRACT §11), and
inside one provider its endpoints in turn, until one answers.

``Forwarder.forward`` walks providers within the attempt budget and one deadline, only before any
response byte reached the client; ``_try_provider`` tries the endpoints of one provider, with
``ProviderAttempts`` (sans-IO) deciding what follows a failure, and a ``ResponseRelay`` streams the
answer to the client as it arrives.
"""

from __future__ import annotations

import asyncio
import random
import time

from gateway.http.errors import ErrorReply
from gateway.quota.estimate import relayed_floor
from gateway.quota.gate import Admission
from gateway.request.attempts import Next, ProviderAttempts, Settlement, attempt_tokens, unanswered_tokens
from gateway.request.failover import COOLING_STATUSES, Failover, cooling_seconds, parse_retry_after
from gateway.request.headers import ask_identity_encoding
from gateway.routing import RouteDecision, Router
from gateway.routing.eligibility import Needs
from workers.clusters import ClusterManager, UpstreamCluster, UpstreamEndpoint
from workers.exchange import Exchange
from workers.outcomes import Outcomes, attempts_header
from workers.overlay_follower import OverlayFollower
from workers.providers import ProviderStates
from workers.proxy_settings import ProxySettings
from workers.relay import ResponseRelay
from workers.upstream import ConnectFailed, PoolExhausted

_perf = time.perf_counter
_monotonic = time.monotonic
_HELD_CODES = {429: "upstream_rate_limited", 502: "upstream_bad_gateway", 503: "upstream_unavailable",
               504: "upstream_timeout"}


def _split(total: int, prompt: int | None, completion: int | None) -> tuple[int, int]:
    """Both sides of a usage that reported its total and one side."""
    if prompt is None:
        return max(0, total - (completion or 0)), completion or 0
    return prompt, max(0, total - prompt)


class ProxyRequest:
    """One request on its way upstream: what every attempt needs, decided once before the first."""

    __slots__ = (
        "exchange", "request_id", "tenant", "batch", "capability", "admission", "session", "needs", "key",
        "filtered", "filtered_reasons", "balance_keys", "body", "metering", "forward", "evidence", "barred",
        "owed",
    )

    def __init__(
        self, exchange: Exchange, request_id: bytes, tenant: str, batch: bool, capability: str,
        admission: Admission | None, session: bytes | None, needs: Needs | None, key: bytes, filtered: int,
        filtered_reasons: int, balance_keys: dict[bytes, bytes] | None, body: bytes, metering: bool | None,
        forward: list[tuple[bytes, bytes]], evidence: list[tuple[bytes, bytes]],
        barred: frozenset[int] | None = None,
    ) -> None:
        self.exchange = exchange
        self.request_id = request_id
        self.tenant = tenant
        self.batch = batch  # the tenant waits behind interactive ones for upstream connections
        self.capability = capability
        self.admission = admission
        self.session = session  # the session-affinity key
        self.needs = needs  # eligibility filters (None: none apply)
        self.key = key  # the stable_hash picker's key
        self.filtered = filtered  # candidates the filters removed (evidence)
        self.filtered_reasons = filtered_reasons  # why (gateway.routing.eligibility reason bits)
        self.balance_keys = balance_keys  # consistent-hash header values of the endpoint balancers
        self.body = body  # as sent upstream (rewritten to ask for usage when metered)
        self.metering = metering  # None: not metered; True: the body was rewritten to ask for usage
        self.forward = forward  # the headers every attempt sends
        self.evidence = evidence  # extra evidence headers (x-gridgate-filtered)
        self.barred = barred  # providers its route may not reach (docs/security.md); failover skips them too
        self.owed = 0  # tokens the attempts that ended without serving cost (gateway.request.attempts)

    @property
    def estimate(self) -> int:
        """The tokens reserved at admission (0 when not metered)."""
        admission = self.admission
        return 0 if admission is None else admission.estimate


class Forwarder:
    def __init__(self, *, settings: ProxySettings, overlay: OverlayFollower, router: Router,
                 clusters: ClusterManager, providers: ProviderStates, outcomes: Outcomes) -> None:
        self.settings = settings
        self.retry = settings.retry
        self.route_headers = settings.route_headers
        self.overlay = overlay
        self.router = router
        self.clusters = clusters
        self.providers = providers
        self.outcomes = outcomes
        self.rng = random.Random()

    async def forward(self, req: ProxyRequest, route: RouteDecision) -> None:
        """Try providers until one answers (or the budget is spent); settle the reservation."""
        exchange = req.exchange
        if req.metering is not None:
            ask_identity_encoding(req.forward)  # the usage must be readable in the answer
        first = route
        failover: Failover | None = None
        deadline = _monotonic() + float(self.retry.deadline)
        while True:
            cluster = self.clusters.by_provider.get(route.provider)
            assert cluster is not None  # the router only picks configured providers
            attempt = 1 if failover is None else failover.attempts + 1
            hold = (self.retry.attempts > attempt and route.plan.provider_count > 1 and route.mode != "pinned")
            outcome = await self._try_provider(req, cluster, route, deadline, hold, attempt)
            if outcome is None:  # answered (or the client left): settled
                if req.session is not None and route.provider != first.provider:
                    self.router.rebind(req.session, route, _monotonic())  # the binding moves to who served
                return
            if failover is None:
                failover = Failover(self.retry, deadline, self.rng)
            failover.failed(route.provider, outcome)
            if not failover.may_try_another(_monotonic()) or exchange.client_gone or route.mode == "pinned":
                break
            following = self.router.failover(first, failover.tried, req.needs, req.key, req.barred)
            if following is None:
                break
            self.outcomes.metrics.failover(cluster.name)
            await asyncio.sleep(failover.backoff())
            route = following
        outcomes = self.outcomes
        outcomes.settle(req.admission, Settlement.CHARGE_USAGE, req.owed)  # 0: nothing reached a provider
        if exchange.client_gone:
            outcomes.access_log.record(exchange, req.request_id, 499, tenant=req.tenant, capability=req.capability,
                                       route=route, attempts=failover.attempts, error="client_closed",
                                       filtered=req.filtered, reasons=req.filtered_reasons)
        else:
            outcomes.refuse(exchange, failover.last_reply, req.request_id, cluster.name, failover.attempts,
                            tenant=req.tenant, capability=req.capability, route=route, filtered=req.filtered,
                            reasons=req.filtered_reasons)

    def _upstream_headers(self, req: ProxyRequest, cluster: UpstreamCluster,
                          route: RouteDecision) -> list[tuple[bytes, bytes]]:
        """The request's headers plus this provider's own (its credentials, the provider-hop headers)."""
        if not cluster.auth_headers and not cluster.provider_hop:
            return req.forward
        headers = [*req.forward, *cluster.auth_headers]
        if cluster.provider_hop:
            headers.append((b"x-ai-routing-candidate", route.evidence[1][1]))
            headers.append((b"x-ai-routing-request-id", req.request_id))
            if self.overlay.snapshot.is_envelope:
                headers.append((b"x-ai-routing-revision", route.revision.encode()))
        return headers

    def _response_headers(self, req: ProxyRequest, route: RouteDecision, attempt: int) -> list[tuple[bytes, bytes]]:
        headers = [(b"x-request-id", req.request_id)]
        if self.route_headers:
            headers.append(attempts_header(attempt))
            headers += route.evidence
            headers += req.evidence
        if req.admission is not None:
            headers += req.admission.headers
        return headers

    async def _try_provider(
        self, req: ProxyRequest, cluster: UpstreamCluster, route: RouteDecision, deadline: float,
        hold_retryable: bool, attempt: int,
    ) -> ErrorReply | None:
        """One provider, its endpoints in turn. None: the request is over (answered, or the client left,
        and settled); else the reply to give if no other provider serves. What each attempt that ended
        without serving cost is added to ``req.owed``."""
        exchange = req.exchange
        outcomes = self.outcomes
        upstream_headers = self._upstream_headers(req, cluster, route)
        response_headers = self._response_headers(req, route, attempt)
        key = cluster.balance_key(req.balance_keys, exchange.target)
        first_byte = self.settings.first_byte_timeout
        attempts: ProviderAttempts[UpstreamEndpoint] = ProviderAttempts(cluster.name)
        while (endpoint := cluster.pick(key, attempts.excluded)) is not None:
            if attempts.failure is not None:
                outcomes.metrics.retry()  # an endpoint of this provider failed: this is a retry inside it
            pool = endpoint.pool
            cluster.begin(endpoint)  # in flight from the pick: a hanging connect attracts no more picks
            try:
                conn = None if attempts.fresh else pool.try_acquire()
                if conn is None:
                    try:
                        conn = await pool.acquire(fresh=attempts.fresh, timeout=deadline - _monotonic(),
                                                  tenant=req.tenant, batch=req.batch)  # fair order among waiters
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
                    outcomes.settle(req.admission, Settlement.CHARGE_USAGE, req.owed)
                    outcomes.access_log.record(exchange, req.request_id, 499, tenant=req.tenant,
                                               capability=req.capability, route=route, attempts=attempt,
                                               error="client_closed", filtered=req.filtered,
                                               reasons=req.filtered_reasons)
                    return None
                relay = ResponseRelay(exchange, conn, response_headers, req.metering, hold_retryable)
                exchange.listener = relay
                overhead = _perf() - exchange.t_start
                if self.route_headers:
                    response_headers.append((b"x-gridgate-overhead-ms", b"%.3f" % (overhead * 1000.0)))
                attempts.sent()
                sent_at = _monotonic()
                head_by = deadline if first_byte is None else min(deadline, sent_at + first_byte)
                conn.send_request(relay, exchange.method, exchange.target, endpoint.host_header, upstream_headers,
                                  req.body, head_by)
                if exchange.client_paused:
                    relay.pause_writing()  # the client is still behind on an earlier response
                await relay.done
            finally:
                cluster.end(endpoint)
                # The exchange and its relay point at each other: unlinked, refcounting frees both at
                # the end of the request instead of leaving a cycle per request to the collector.
                exchange.listener = None
            status = relay.status
            if status:
                self.providers.observe_first_byte(cluster.provider, relay.first_byte_at - sent_at)
                if status in COOLING_STATUSES:
                    self._cool(cluster, relay.retry_after)
            if relay.response_started:
                self._served(req, cluster, endpoint, route, relay, overhead, attempt, sent_at)
                return None
            if relay.held_status:
                cluster.record_success(endpoint, status)  # it answered: a 429 is a cooling signal, not a failure
                req.owed += attempt_tokens(status, None, req.estimate)  # its body was discarded unread
                return self._held_reply(cluster, status, relay.retry_after)
            if relay.failure is None:  # the client left before the response started
                req.owed += attempt_tokens(0, None, req.estimate)  # the provider may be working on it
                outcomes.settle(req.admission, Settlement.CHARGE_USAGE, req.owed)
                outcomes.access_log.record(exchange, req.request_id, 499, tenant=req.tenant, capability=req.capability,
                                           route=route, attempts=attempt, endpoint=endpoint.address,
                                           error="client_closed", filtered=req.filtered,
                                           reasons=req.filtered_reasons)
                return None
            if self.route_headers:
                response_headers.pop()  # the overhead header is re-measured on the next attempt
            cluster.record_failure(endpoint, relay.failure)
            req.owed += unanswered_tokens(relay.failure, conn.reused, req.estimate)
            # Recorded first, so that a failure at the deadline is reported as what it was (a timeout: 504).
            if attempts.failed_before_head(endpoint, relay.failure, relay.detail, conn.reused) == Next.STOP:
                break
            if _monotonic() >= deadline:
                break
        return attempts.error_reply()

    def _served(self, req: ProxyRequest, cluster: UpstreamCluster, endpoint: UpstreamEndpoint,
                route: RouteDecision, relay: ResponseRelay, overhead: float, attempt: int, sent_at: float) -> None:
        """A response was relayed (completely, or cut after it started): count it and settle."""
        outcomes = self.outcomes
        status = relay.status
        metrics = outcomes.metrics
        metrics.overhead(overhead)
        metrics.request(cluster.name, status)
        metrics.upstream_latency(cluster.name, relay.first_byte_at - sent_at, relay.ended_at - sent_at)
        cluster.record_success(endpoint, status)
        usage = relay.usage  # None when not metered
        tokens = prompt = completion = None
        if usage is not None:
            tokens, prompt, completion = usage.total_tokens, usage.prompt_tokens, usage.completion_tokens
            floor = 0
            if tokens is None:  # no usage: at least what reached the client (a hang-up near the end)
                floor = relayed_floor(len(req.exchange.body), req.exchange.bytes_out)
            charged = req.owed + attempt_tokens(status, tokens, req.estimate, floor)
            if req.owed and tokens is not None and (prompt is None) != (completion is None):
                # The tenant's tokens in/out split this usage, not what the earlier attempts cost.
                outcomes.settle(req.admission, Settlement.CHARGE_USAGE, charged, *_split(tokens, prompt, completion))
            else:
                outcomes.settle(req.admission, Settlement.CHARGE_USAGE, charged, prompt, completion)
        failure = relay.failure
        outcomes.access_log.record(  # by position, in the signature's order (tenant .. reasons)
            req.exchange, req.request_id, status, req.tenant, req.capability, route, attempt, endpoint.address,
            overhead, prompt, completion,
            failure.code if failure else "client_closed" if relay.client_left else None,
            req.filtered, req.filtered_reasons,
        )

    def _cool(self, cluster: UpstreamCluster, retry_after: bytes | None) -> None:
        """A 429/503 cools its provider in every worker of the host (Retry-After wins, capped)."""
        seconds = cooling_seconds(parse_retry_after(retry_after, time.time()), self.settings.cooling)
        self.providers.cool(cluster.provider, seconds, _monotonic())
        self.outcomes.metrics.cooled(cluster.name)

    @staticmethod
    def _held_reply(cluster: UpstreamCluster, status: int, retry_after: bytes | None) -> ErrorReply:
        """The client's answer if the provider's retryable status ends up being the last word."""
        headers = []
        if retry_after is not None and status in COOLING_STATUSES:
            headers.append((b"retry-after", retry_after))
        return ErrorReply(status, _HELD_CODES[status], f"{cluster.name}: answered {status}", headers)
