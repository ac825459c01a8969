"""The request lifecycle: auth -> quota -> route -> endpoint -> upstream -> stream back.

One ``Proxy`` per worker. ``handle`` runs once per request; the response streams through an
``UpstreamCall`` (the upstream connection's sink) as bytes arrive, so nothing is buffered whole.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from gateway.ids import CounterIds
from gateway.quota.usage import usage_observer
from workers.errors import GatewayError
from workers.server import Exchange
from workers.upstream import (
    CONNECT_ERROR,
    PROTOCOL,
    TIMEOUT,
    ConnectFailed,
    PoolExhausted,
    UpstreamConnection,
)

log = logging.getLogger("gridgate.proxy")
_perf = time.perf_counter

# Request headers the gateway consumes or rewrites; everything else is forwarded as-is.
_H_AUTHORIZATION, _H_API_KEY, _H_CONNECTION, _H_REQUEST_ID, _H_XFF, _H_COOKIE, _H_DROP = range(7)
_REQUEST_SPECIAL: dict[bytes, int] = {
    b"authorization": _H_AUTHORIZATION,
    b"x-api-key": _H_API_KEY,
    b"connection": _H_CONNECTION,
    b"x-request-id": _H_REQUEST_ID,
    b"x-forwarded-for": _H_XFF,
    b"cookie": _H_COOKIE,
    b"host": _H_DROP,
    b"content-length": _H_DROP,
    b"transfer-encoding": _H_DROP,
    b"keep-alive": _H_DROP,
    b"proxy-connection": _H_DROP,
    b"proxy-authorization": _H_DROP,
    b"te": _H_DROP,
    b"trailer": _H_DROP,
    b"upgrade": _H_DROP,
    b"expect": _H_DROP,
    b"x-ai-routing-candidate": _H_DROP,
    b"x-ai-routing-request-id": _H_DROP,
    b"x-ai-routing-revision": _H_DROP,
}
_RESPONSE_DROP = frozenset(
    (b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"te", b"trailer", b"upgrade",
     b"x-request-id")
)
_MAX_ATTEMPTS = 3
_QUOTA_HEADERS = frozenset(
    (b"x-ratelimit-limit-tokens", b"x-ratelimit-remaining-tokens", b"x-ratelimit-reset-tokens")
)


def _connection_tokens(value: bytes) -> set[bytes]:
    return {token.strip().lower() for token in value.split(b",") if token.strip()}


def _valid_request_id(value: bytes) -> bool:
    return 0 < len(value) <= 128 and all(33 <= c <= 126 for c in value)


class UpstreamCall:
    """Sink of one upstream attempt: relays the response to the client as it arrives."""

    __slots__ = (
        "exchange", "conn", "head_future", "done_future", "failure", "status", "extra_headers",
        "response_started", "is_sse", "metering", "usage", "length_framed",
    )

    def __init__(self, exchange: Exchange, extra_headers: list[tuple[bytes, bytes]]) -> None:
        loop = asyncio.get_running_loop()
        self.exchange = exchange
        self.conn: UpstreamConnection | None = None
        self.head_future: asyncio.Future = loop.create_future()
        self.done_future: asyncio.Future = loop.create_future()
        self.failure: tuple[str, str] | None = None
        self.status = 0
        self.extra_headers = extra_headers
        self.response_started = False
        self.is_sse = False
        # None: not metered; False/True: metered, and whether the request was rewritten to ask for usage.
        self.metering: bool | None = None
        self.usage: Any = None
        self.length_framed = False  # the client was promised a Content-Length

    def upstream_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status = status
        out = []
        drop = _RESPONSE_DROP
        metered = self.metering is not None
        chunked = has_length = False
        listed: set[bytes] | None = None
        content_type = None
        for name, value in headers:
            if name in drop:
                if name == b"transfer-encoding":
                    chunked = True
                elif name == b"connection":
                    listed = _connection_tokens(value)
                continue
            if name == b"content-type":
                content_type = value
                self.is_sse = value.startswith(b"text/event-stream")
            elif name == b"content-length":
                has_length = True
            elif metered and name in _QUOTA_HEADERS:
                continue  # the gateway's own token budget headers replace the provider's
            out.append((name, value))
        if metered:
            self.usage = usage_observer(content_type, self.metering)
        # Re-frame as chunked when the provider did, or when the usage filter may shorten the body.
        reframe = chunked or (has_length and self.metering is True)
        if reframe or listed:
            out = [
                (n, v) for n, v in out
                if not (reframe and n == b"content-length") and not (listed and n in listed)
            ]
        self.length_framed = has_length and not reframe
        out += self.extra_headers
        self.response_started = True
        self.exchange.start(status, out)
        if not self.head_future.done():
            self.head_future.set_result(None)

    def upstream_data(self, data: bytes) -> None:
        usage = self.usage
        if usage is not None:
            data = usage.feed(data)
        self.exchange.write(data)

    def upstream_flush(self) -> None:
        self.exchange.flush()

    def upstream_end(self) -> None:
        if self.usage is not None:
            self.exchange.write(self.usage.flush())
        self.exchange.end()
        if not self.head_future.done():
            self.head_future.set_result(None)
        if not self.done_future.done():
            self.done_future.set_result(None)

    def upstream_failed(self, reason: str, detail: str) -> None:
        self.failure = (reason, detail)
        if not self.response_started:
            if not self.head_future.done():
                self.head_future.set_result(None)
            return
        # After the first byte the stream cannot be retried: end it visibly, never silently.
        exchange = self.exchange
        if self.is_sse and not self.length_framed and not exchange.client_gone:
            exchange.write(
                b'data: {"error": {"message": "upstream stream failed: %s", "type": "upstream_error", '
                b'"code": "upstream_%s"}}\n\n' % (reason.encode(), reason.encode())
            )
            exchange.end()
        else:
            exchange.abort()
        if not self.done_future.done():
            self.done_future.set_result(None)

    def client_lost(self) -> None:
        conn = self.conn
        if conn is not None and conn.sink is self:
            conn.abandon()
        self.failure = ("client_lost", "client disconnected")
        for future in (self.head_future, self.done_future):
            if not future.done():
                future.set_result(None)

    # Flow control: only while the connection still serves this call (after its end it may already
    # be back in the pool, serving someone else).
    def pause_upstream(self) -> None:
        conn = self.conn
        if conn is not None and conn.sink is self:
            conn.pause()

    def resume_upstream(self) -> None:
        conn = self.conn
        if conn is not None and conn.sink is self:
            conn.resume()


class Proxy:
    """Per-worker request handler. ``runtime`` supplies routing, endpoints and the optional gates."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.ids = CounterIds(b"-")

    async def handle(self, exchange: Exchange) -> None:
        runtime = self.runtime
        # One pass over the client's headers: pick out what we consume, keep the rest to forward.
        forward: list[tuple[bytes, bytes]] = []
        authorization = api_key = request_id = xff = cookie = None
        listed: set[bytes] | None = None
        special = _REQUEST_SPECIAL
        lookups = runtime.header_lookups  # {lowercased name: slot} for model/affinity headers
        found: dict[bytes, bytes] = {}
        for name, value in exchange.headers:
            kind = special.get(name)
            if kind is None:
                if name in lookups:
                    found[name] = value
                if name[:11] == b"x-gridgate-":
                    continue
                forward.append((name, value))
            elif kind == _H_AUTHORIZATION:
                authorization = value
            elif kind == _H_API_KEY:
                api_key = value
            elif kind == _H_REQUEST_ID:
                request_id = value
            elif kind == _H_XFF:
                xff = value if xff is None else xff + b", " + value
            elif kind == _H_COOKIE:
                cookie = value
                forward.append((name, value))
            elif kind == _H_CONNECTION:
                listed = _connection_tokens(value)
        if listed:
            forward = [(n, v) for n, v in forward if n not in listed]
        if request_id is None or not _valid_request_id(request_id):
            request_id = self.ids.next()
        id_header = (b"x-request-id", request_id)

        try:
            await self._proxy(exchange, runtime, forward, authorization, api_key, request_id, xff, cookie, found)
        except GatewayError as error:
            runtime.metrics.request(None, error.status)
            exchange.send_error(error, [id_header])

    async def _proxy(
        self, exchange: Exchange, runtime: Any, forward: list[tuple[bytes, bytes]],
        authorization: bytes | None, api_key: bytes | None, request_id: bytes, xff: bytes | None,
        cookie: bytes | None, found: dict[bytes, bytes],
    ) -> None:
        id_header = (b"x-request-id", request_id)
        tenant = runtime.authenticate(authorization, api_key)
        if exchange.method == b"GET" and exchange.target == b"/v1/models":
            body = runtime.models_body()
            exchange.respond(200, [(b"content-type", b"application/json"), id_header], body)
            runtime.metrics.request(None, 200)
            return
        request = runtime.capability(exchange, found)
        admission = await runtime.admit(tenant, request, len(exchange.body))
        try:
            route = runtime.route(request, found, cookie)
        except GatewayError:
            runtime.settle(admission, 200, 0)  # nothing was sent upstream: release the whole reservation
            raise
        try:
            await self._forward(exchange, runtime, forward, request, route, request_id, xff, found, admission)
        except BaseException:
            runtime.settle(admission, 0, None)
            raise

    async def _forward(
        self, exchange: Exchange, runtime: Any, forward: list[tuple[bytes, bytes]], request: Any, route: Any,
        request_id: bytes, xff: bytes | None, found: dict[bytes, bytes], admission: Any,
    ) -> None:
        cluster = runtime.clusters[route.cluster]
        extra_response = [(b"x-request-id", request_id), *runtime.route_headers(route, admission)]
        peer = exchange.peer
        forward.append((b"x-forwarded-for", xff + b", " + peer if xff else peer))
        forward.append((b"x-request-id", request_id))
        forward += cluster.auth_headers
        if cluster.provider_hop:
            forward += runtime.provider_hop_headers(route, request_id)
        body, metering = runtime.upstream_body(request, exchange.body, admission)
        if body:
            forward.append((b"content-length", b"%d" % len(body)))
        elif exchange.method not in (b"GET", b"HEAD", b"DELETE", b"OPTIONS"):
            forward.append((b"content-length", b"0"))

        excluded: set[int] = set()
        fresh = reached = False
        failure: tuple[str, str] = (CONNECT_ERROR, "no endpoint")
        busy: PoolExhausted | None = None
        evidence = runtime.route_headers_enabled
        balance_key = cluster.balance_key(found, exchange.target)
        for _attempt in range(_MAX_ATTEMPTS):
            endpoint = cluster.pick(balance_key, excluded)
            if endpoint is None:
                break
            try:
                conn = await endpoint.pool.acquire(fresh=fresh)
            except ConnectFailed as error:
                cluster.record(endpoint, error.reason)
                excluded.add(endpoint.index)
                failure = (CONNECT_ERROR, str(error))
                fresh = False
                continue
            except PoolExhausted as error:
                busy = error  # every connection of this endpoint is in use: try another endpoint
                excluded.add(endpoint.index)
                fresh = False
                continue
            if exchange.client_gone:
                # The client left while we waited for admission or a connection: send nothing.
                endpoint.pool.release(conn, reusable=True)
                runtime.settle(admission, 200, 0)
                return
            call = UpstreamCall(exchange, extra_response)
            call.conn = conn
            call.metering = metering
            exchange.on_client_lost = call.client_lost
            exchange.on_pause_writing = call.pause_upstream
            exchange.on_resume_writing = call.resume_upstream
            overhead = _perf() - exchange.t_start
            if evidence:
                extra_response.append((b"x-gridgate-overhead-ms", b"%.3f" % (overhead * 1000.0)))
            cluster.begin(endpoint)
            reached = True
            try:
                conn.send_request(
                    call, exchange.method, exchange.target, [(b"host", endpoint.host_header), *forward], body
                )
                if exchange.client_paused:
                    call.pause_upstream()  # the client is still behind on an earlier response
                await call.head_future
                if call.response_started:
                    await call.done_future
            finally:
                cluster.end(endpoint)
            failure = call.failure or failure
            if call.response_started:
                runtime.metrics.overhead(overhead)
                runtime.metrics.request(cluster.name, call.status)
                cluster.record(endpoint, None if call.status < 500 else "5xx")
                lost = call.failure is not None and call.failure[0] == "client_lost"
                tokens = call.usage.total_tokens if call.usage is not None else None
                runtime.settle(admission, call.status, tokens, disconnected=lost)
                return
            if call.failure is None or call.failure[0] == "client_lost":
                runtime.settle(admission, 0, None, disconnected=True)
                return
            if evidence:
                extra_response.pop()  # the overhead header is re-measured on the next attempt
            runtime.metrics.retry()
            reason = call.failure[0]
            cluster.record(endpoint, reason)
            if conn.reused and not fresh and reason != TIMEOUT:
                # A pooled connection may have been closed by the provider: retry once on a fresh one.
                fresh = True
                continue
            fresh = False
            if reason == TIMEOUT:
                break
            excluded.add(endpoint.index)
        if not reached:
            runtime.settle(admission, 200, 0)  # no provider received the request: release the reservation
            if busy is not None:
                raise GatewayError(503, "upstream_busy", str(busy), [(b"retry-after", b"1")])
        reason, detail = failure
        if reason == TIMEOUT:
            raise GatewayError(504, "upstream_timeout", f"upstream did not answer in time ({detail})")
        code = "bad_upstream_response" if reason == PROTOCOL else "upstream_unavailable"
        raise GatewayError(502, code, f"upstream request failed: {detail}")
