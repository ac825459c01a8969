"""How a request ends, in one place: the quota settlement, the gateway-made error answer, the metrics
and the access-log line."""

from __future__ import annotations

from gateway.http.errors import ErrorReply
from gateway.metrics.writer import WorkerMetrics
from gateway.quota.gate import Admission, QuotaGate
from gateway.request.attempts import Settlement
from gateway.routing import RouteDecision
from gateway.routing.decision import header_value
from workers.access_log import AccessLog
from workers.exchange import Exchange

_ATTEMPTS = tuple((b"x-gridgate-attempts", b"%d" % n) for n in range(64))


def attempts_header(count: int) -> tuple[bytes, bytes]:
    return _ATTEMPTS[count] if count < len(_ATTEMPTS) else (b"x-gridgate-attempts", b"%d" % count)


class Outcomes:
    __slots__ = ("quota", "metrics", "access_log", "route_headers")

    def __init__(self, quota: QuotaGate | None, metrics: WorkerMetrics, access_log: AccessLog,
                 route_headers: bool) -> None:
        self.quota = quota
        self.metrics = metrics
        self.access_log = access_log
        self.route_headers = route_headers

    def settle(self, admission: Admission | None, settlement: Settlement, tokens: int | None = None,
               prompt_tokens: int | None = None, completion_tokens: int | None = None) -> None:
        """Reconcile a reservation off the response path (never blocks)."""
        gate = self.quota
        if admission is None or gate is None:
            return
        if settlement == Settlement.CHARGE_USAGE and tokens is not None:
            gate.settle(admission, tokens, prompt_tokens, completion_tokens)
        elif settlement == Settlement.RELEASE:  # nothing reached a provider: its request slots go back too
            gate.settle(admission, 0, reached=False)
        else:
            gate.settle(admission, None)

    def refuse(self, exchange: Exchange, reply: ErrorReply, request_id: bytes, provider: str | None = None,
               attempts: int = 0, *, tenant: str | None = None, capability: str | None = None,
               route: RouteDecision | None = None, filtered: int = 0, reasons: int = 0) -> None:
        """Answer with a gateway-made error; errors about a provider name it and count under its cluster."""
        self.metrics.request(provider, reply.status)
        extra = [(b"x-request-id", request_id)]
        if self.route_headers and provider is not None:
            extra.append((b"x-gridgate-provider", header_value(provider)))
            extra.append(attempts_header(attempts))
        exchange.send_error(reply, extra)
        self.access_log.record(exchange, request_id, reply.status, tenant=tenant, capability=capability, route=route,
                               attempts=attempts, error=reply.code, filtered=filtered, reasons=reasons)
