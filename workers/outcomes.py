"""How a request ends, in one place: ``Outcomes.close`` takes a closed ``RequestRecord``
(workers/request_record.py), prices what its attempts cost (``request_cost.attempts_cost``, with the
worker's price book; written out for the usual metered request, served by its only costly attempt),
settles its quota reservation with that cost and its tokens (one ``settle`` call:
docs/configuration.md, "What a request is charged"), counts its metrics and writes its access line. ``refuse`` answers with a gateway-made error (the record closes as the answer ends);
``observe`` is what an attempt that got a head tells about its provider (first-byte latency, cooling).
Requests refused before the proxy (malformed, or on their head) end in ``rejected``.
"""

from __future__ import annotations

import time

from gateway.config import Cooling
from gateway.http.errors import ErrorReply
from gateway.metrics.writer import WorkerMetrics
from gateway.quota.gate import QuotaGate
from gateway.request.attempts import AttemptResult, attempt_tokens, served_tokens, usage_split
from gateway.routing.decision import header_value
from gateway.routing.failover import COOLING_STATUSES
from gateway.routing.prefix import MOVED, PrefixTable
from gateway.spend.price_book import PriceBook
from workers.access_log import AccessLog
from workers.cooling import cool_for_answer
from workers.head_gate import HeadRefusal
from workers.providers import Endpoint, ProviderStates
from workers.recent_requests import RequestRing
from workers.request_cost import ABSURD_FACTOR, CHECKED_OBSERVERS, attempts_cost
from workers.request_record import RequestRecord
from workers.spend_tracker import SpendTracker

_monotonic = time.monotonic
_ATTEMPTS = tuple((b"x-gridgate-attempts", b"%d" % n) for n in range(64))
# The status of a request that ended with no answer: the client left (never counted in the metrics:
# nothing was answered), or the handler failed (the server answers 500).
CLIENT_CLOSED = 499


def attempts_header(count: int) -> tuple[bytes, bytes]:
    return _ATTEMPTS[count] if count < len(_ATTEMPTS) else (b"x-gridgate-attempts", b"%d" % count)


def served_model_headers(record: RequestRecord) -> list[tuple[bytes, bytes]]:
    """A request whose model is an alias or has a fallback chain says which model served it and how many
    models it moved along its chain (docs/models.md)."""
    model = record.served
    headers = [] if model is None else [(b"x-gridgate-model", header_value(model))]
    if record.model_route is not None and record.model_route.hops:
        headers.append((b"x-gridgate-fallback-hops", b"%d" % record.fallback_hops))
    return headers


def _unanswered(record: RequestRecord) -> None:
    """The status and error of a request that ended with no answer: the client left, or the handler failed."""
    gone = record.exchange is None or record.exchange.client_gone
    record.status, record.error = (CLIENT_CLOSED, "client_closed") if gone else (500, "internal_error")


def _clamped(quota: QuotaGate, worst: int) -> int:
    """An absurd usage's cost: the worst case the admission reserved, counted (``request_cost``)."""
    quota.counters.spend_usage_clamped += 1
    return worst


class Outcomes:
    """One per worker: the end of every request the proxy handled, and the answers it makes itself."""

    __slots__ = ("quota", "metrics", "access_log", "providers", "cooling", "route_headers", "prices",
                 "reject_unpriced", "spend", "prefixes", "recent")

    def __init__(self, quota: QuotaGate | None, metrics: WorkerMetrics, access_log: AccessLog,
                 providers: ProviderStates, cooling: Cooling, route_headers: bool,
                 prices: PriceBook | None = None, spend: SpendTracker | None = None) -> None:
        self.recent: RequestRing | None = None  # on with the console (admin.tokens)
        self.spend = spend  # rollups and spend metrics (docs/pricing.md); None: a test's bare outcomes
        self.quota = quota
        self.prices = prices  # None: requests are not priced (cost_nusd stays None)
        # ``pricing.unpriced: reject``: the proxy asks ``prices.admits`` before a request leaves
        self.reject_unpriced = prices is not None and prices.unpriced == "reject"
        self.metrics = metrics
        self.access_log = access_log
        self.providers = providers
        self.cooling = cooling
        self.route_headers = route_headers
        self.prefixes: PrefixTable | None = None  # prefix affinity's placements: an answer feeds back

    def close(self, record: RequestRecord) -> None:
        """The request is over (once): runs before its last bytes leave, so its metrics count it by then."""
        relay = record.attempt
        result = None if relay is None else relay.result()
        served = result is not None and result.started
        if served:
            self._served(record, result)  # type: ignore[arg-type]
        elif record.status == 0:  # no answer was given: the client left, or the handler failed
            _unanswered(record)
        if record.status != CLIENT_CLOSED:
            self.metrics.request(record.provider, record.status)
        admission = record.admission
        prices = self.prices
        if (admission is not None and served and prices is not None and (quota := self.quota) is not None
                and not record.owed
                and (usage := result.usage).__class__ in CHECKED_OBSERVERS  # type: ignore[union-attr]
                and (tokens := usage.total_tokens) is not None
                and (model := record.served_model or record.capability) is not None):
            # The metered request as nearly every one ends (its serving attempt alone cost anything, usage in
            # counts): ``attempts_cost`` and ``_charge`` written out, cost clamped past ABSURD_FACTOR x the
            # worst case; tests/unit/test_outcomes_fast.py holds it equal to the general path (``_priced_and_settled``).
            cost = prices.usage_cost(model, usage, True)
            worst = admission.worst_nusd
            if worst and cost > ABSURD_FACTOR * worst:  # type: ignore[operator]
                cost = _clamped(quota, worst)
            record.cost_nusd = cost
            quota.settle(admission, tokens, record.tokens_prompt, record.tokens_completion, cost_nusd=cost)
            if (spend := self.spend) is not None:  # ``count``'s checks known to pass (it reached, with a model)
                spend.count_reached(record, model, cost)
        else:
            self._priced_and_settled(record, result, served)
        if record.prefix is not None:  # prefix affinity: cached tokens and the first token feed back
            self._prefix_ended(record, result if served else None)
        if record.trace is not None:  # its spans end and go to the exporter's queue (docs/tracing.md)
            record.trace.end(record, result)
        self.access_log.record(record)
        if (recent := self.recent) is not None:  # the console's last requests (workers/recent_requests.py)
            recent.add(record)

    def _priced_and_settled(self, record: RequestRecord, result: AttemptResult | None, served: bool) -> None:
        """``close``'s general path (what its fast path writes out): the request's attempts priced, its quota
        settled with their tokens and cost, and it counted in the day's rollups."""
        admission = record.admission
        prices = self.prices
        reached = record.reached or record.attempt is not None  # it reached a provider (workers/request_record.py)
        if prices is not None and reached:
            metered = admission is not None
            record.cost_nusd, clamped = attempts_cost(prices, record.served_model or record.capability, result,
                                                      served, record.owed, admission.estimate if metered else 0,
                                                      admission.worst_nusd if metered else 0, metered)
            if clamped and self.quota is not None:
                self.quota.counters.spend_usage_clamped += 1
        if admission is not None and self.quota is not None:
            if reached:
                self.quota.settle(admission, *self._charge(record, result, served), cost_nusd=record.cost_nusd)
            else:  # it never reached a provider: nothing is charged, and its request slots go back too
                self.quota.settle(admission, 0, reached=False)
        if (spend := self.spend) is not None:  # the day's rollups and the spend metrics (docs/pricing.md)
            spend.count(record)

    def _served(self, record: RequestRecord, result: AttemptResult) -> None:
        """A provider's response was relayed (completely, or cut after it started)."""
        route = record.route
        assert route is not None
        cluster = record.provider = route.cluster
        record.status = result.status
        failure = result.failure
        if failure is not None:
            record.error = failure.code
        elif result.stream_error is not None:
            record.error = result.stream_error  # the provider ended the stream with an error event
        elif result.client_left:
            record.error = "client_closed"  # else None, or why the gateway ended the stream (a shutdown)
        usage = result.usage
        if usage is not None:
            record.tokens_prompt, record.tokens_completion = usage.prompt_tokens, usage.completion_tokens
            record.tokens_cached, record.tokens_reasoning = usage.cached_tokens, usage.reasoning_tokens
        metrics = self.metrics
        metrics.overhead(record.overhead_s or 0.0)
        metrics.upstream_latency(cluster, result.first_byte_s, result.duration_s)
        self.observe(route.provider, cluster, record.endpoint, result)

    def _prefix_ended(self, record: RequestRecord, result: AttemptResult | None) -> None:
        """The prefix's placement hears how its request went (gateway.routing.prefix)."""
        if result is None or record.route is None:
            self.prefixes.ended(record.prefix, -1, None, None)  # type: ignore[union-attr]
            return
        usage = result.usage
        learnt = self.prefixes.ended(record.prefix, record.route.provider,  # type: ignore[union-attr]
                                     None if usage is None else usage.cached_tokens, result.first_token_s)
        if learnt is not None:
            event, moved = learnt
            self.metrics.prefix_event(event)
            if moved and event != MOVED:
                self.metrics.prefix_event(MOVED)

    @staticmethod
    def _charge(record: RequestRecord, result: AttemptResult | None,
                served: bool) -> tuple[int, int | None, int | None]:
        """The tokens the request's attempts cost (docs/configuration.md, "What a request is charged"),
        and the tenant's tokens in/out of the usage that served it."""
        owed = record.owed
        if result is None:
            return owed, None, None
        if not served:  # sent, and no answer came: the provider may be working on it
            return owed + attempt_tokens(0, None, record.estimate), None, None
        usage = result.usage
        tokens = None if usage is None else usage.total_tokens
        prompt, completion = record.tokens_prompt, record.tokens_completion
        if tokens is None:
            return owed + served_tokens(result, record.estimate, record.bytes_in, record.bytes_out), prompt, completion
        # The usage that served it: ``served_tokens`` without its calls (the common case, every request).
        if owed:  # the tenant's tokens in/out split this usage, not the other attempts'
            prompt, completion = usage_split(tokens, prompt, completion)
        return owed + tokens, prompt, completion

    def observe(self, provider: int, cluster: str, endpoint: Endpoint, result: AttemptResult) -> None:
        """What an answer says about its provider: its first-byte latency (least_loaded), and a 429/503
        cools it in every worker of the host (Retry-After wins, capped: docs/routing.md)."""
        status = result.status
        if status:
            self.providers.observe_first_byte(provider, result.first_byte_s)
            if status in COOLING_STATUSES:
                cool_for_answer(self.providers, self.metrics, cluster, provider, endpoint, result.retry_after,
                                result.provider_wide, self.cooling, _monotonic(), time.time())

    def refuse(self, record: RequestRecord, reply: ErrorReply) -> None:
        """Answer with a gateway-made error; one about a provider (``record.provider``) names it and its
        attempts, and counts under its cluster. The record closes as the answer ends."""
        record.status = reply.status
        record.error = reply.code
        extra = [(b"x-request-id", record.request_id)]
        provider = record.provider
        if self.route_headers and provider is not None:
            extra.append((b"x-gridgate-provider", header_value(provider)))
            extra.append(attempts_header(record.attempts))
        if record.model_route is not None:
            extra += served_model_headers(record)
        record.exchange.send_error(reply, extra)

    def rejected(self, reply: ErrorReply) -> None:
        """A request refused before the proxy: malformed, over a limit, timed out (the server answered
        it), or refused on its head by the head gate, whose refusal names the request."""
        self.metrics.request(None, reply.status)
        if type(reply) is HeadRefusal:
            self.access_log.rejected(reply.status, reply.code, reply.request_id, reply.method, reply.target,
                                     reply.tenant)
        else:
            self.access_log.rejected(reply.status, reply.code)


class HitEnds:
    """The end of a request a response cache hit answered (workers/response_cache.py makes it the record's
    ``ends`` as it answers): ``Outcomes.close`` for what such a record holds, nothing more asked of it. It
    has no attempt (no provider, no price, no cooling), no admission left (``Proxy.admit_hit`` settled it),
    no prefix placement (that step comes after the cache's), and its request was counted with the hit
    (``WorkerMetrics.hit_answered``). What it saved goes into the rollup, its trace ends, its line is kept.
    tests/unit/test_hit_ends.py holds it equal to ``Outcomes.close``."""

    __slots__ = ("outcomes",)

    def __init__(self, outcomes: Outcomes) -> None:
        self.outcomes = outcomes

    def close(self, record: RequestRecord) -> None:
        outcomes = self.outcomes
        if (spend := outcomes.spend) is not None:
            spend.count_hit(record)
        if record.trace is not None:
            record.trace.end(record, None)
        outcomes.access_log.record(record)
        if (recent := outcomes.recent) is not None:
            recent.add(record)
