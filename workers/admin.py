"""The admin listener (CONTRACT §6): a tiny HTTP/1.1 server on ``admin.listen``.

It runs inside the supervisor, on the supervisor's asyncio loop, so it answers
from what the supervisor knows (worker status messages, the shared-memory
segment) without touching the data plane. h11 does the HTTP framing; this is not
a hot path, so clarity wins over speed.

The pieces:
- ``AdminSources``: what the supervisor provides (readiness, reports);
- ``MetricsExposition``: the pluggable ``/metrics`` page: modules add a
  prometheus_client collector (``register``) or finished text (``register_text``);
- ``AdminApp``: routes a request to a response (no sockets, easy to test);
- ``AdminServer``: h11 over asyncio streams on a socket the caller bound;
- ``QuotaReporter``: the quota page's own client of the shared ledger.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

import h11
import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from gateway.config import Quota
from gateway.quota.rules import rules_from_config

log = logging.getLogger("gridgate.admin")

_MAX_HEAD_BYTES = 16 * 1024
_MAX_BODY_BYTES = 64 * 1024
_IDLE_TIMEOUT = 30.0
_JSON = "application/json"


class ReportUnavailable(Exception):
    """A report's source cannot answer right now (-> 503 with this message)."""


class AdminSources(Protocol):
    """What the admin pages read; implemented by the supervisor."""

    def readiness(self) -> tuple[bool, str]:
        """(ready, reason): ready when every serving worker reported ``ready`` and none is stale."""
        ...

    def overlay_report(self) -> dict[str, Any]: ...

    def endpoints_report(self) -> dict[str, Any]:
        """Raises ReportUnavailable when the shared-memory view is not there."""
        ...

    def quota_enabled(self) -> bool: ...

    def quota_report(self, tenant: str) -> Awaitable[dict[str, Any]]:
        """Raises ReportUnavailable when the quota backend cannot answer."""
        ...


@dataclass(slots=True)
class AdminResponse:
    status: int
    body: bytes
    content_type: str = _JSON
    headers: list[tuple[str, str]] = field(default_factory=list)


_encoder = msgspec.json.Encoder()


def json_response(status: int, payload: Any) -> AdminResponse:
    return AdminResponse(status, _encoder.encode(payload))


def error_response(status: int, message: str, code: str, kind: str = "invalid_request_error") -> AdminResponse:
    """The OpenAI error shape the data plane uses too, so clients parse one format."""
    return json_response(status, {"error": {"message": message, "type": kind, "code": code}})


class MetricsExposition:
    """``/metrics``: the pluggable registry other modules add metric families to.

    Two ways in, both evaluated at scrape time (from shared memory or the
    supervisor's state, so nothing is kept in sync by hand):
    - ``register(collector)``: any object whose ``collect()`` yields prometheus_client
      metric families (e.g. ``GaugeMetricFamily``);
    - ``register_text(render)``: a callable returning finished exposition text
      (families are independent blocks, so texts concatenate into one valid page).
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self._registry = CollectorRegistry(auto_describe=False)
        self._texts: list[Callable[[], bytes]] = []

    def register(self, collector: Any) -> None:
        self._registry.register(collector)

    def register_text(self, render: Callable[[], bytes]) -> None:
        self._texts.append(render)

    def render(self) -> bytes:
        return b"".join([generate_latest(self._registry), *(render() for render in self._texts)])


Handler = Callable[[dict[str, list[str]]], Awaitable[AdminResponse]]


class AdminApp:
    """Maps ``(method, target)`` to an ``AdminResponse``; never raises."""

    def __init__(self, sources: AdminSources, metrics: MetricsExposition) -> None:
        self._sources = sources
        self._metrics = metrics
        self._routes: dict[str, Handler] = {
            "/healthz": self._healthz,
            "/readyz": self._readyz,
            "/metrics": self._render_metrics,
            "/admin/overlay": self._overlay,
            "/admin/endpoints": self._endpoints,
            "/admin/quota": self._quota,
        }

    async def handle(self, method: str, target: str) -> AdminResponse:
        parts = urlsplit(target)
        handler = self._routes.get(parts.path)
        if handler is None:
            return error_response(404, f"no admin page at {parts.path}", "not_found")
        if method not in ("GET", "HEAD"):
            response = error_response(405, f"{method} is not allowed on {parts.path}", "method_not_allowed")
            response.headers.append(("allow", "GET, HEAD"))
            return response
        try:
            return await handler(parse_qs(parts.query))
        except Exception:  # a broken report must not take the admin listener down
            log.exception("admin page %s failed", parts.path)
            return error_response(500, f"{parts.path} failed; see the supervisor log", "internal_error", "server_error")

    async def _healthz(self, query: dict[str, list[str]]) -> AdminResponse:
        return json_response(200, {"status": "ok"})

    async def _readyz(self, query: dict[str, list[str]]) -> AdminResponse:
        ready, reason = self._sources.readiness()
        if ready:
            return json_response(200, {"status": "ready"})
        return json_response(503, {"status": "not_ready", "reason": reason})

    async def _render_metrics(self, query: dict[str, list[str]]) -> AdminResponse:
        return AdminResponse(200, self._metrics.render(), self._metrics.content_type)

    async def _overlay(self, query: dict[str, list[str]]) -> AdminResponse:
        return json_response(200, self._sources.overlay_report())

    async def _endpoints(self, query: dict[str, list[str]]) -> AdminResponse:
        try:
            return json_response(200, self._sources.endpoints_report())
        except ReportUnavailable as exc:
            return error_response(503, str(exc), "endpoints_unavailable", "server_error")

    async def _quota(self, query: dict[str, list[str]]) -> AdminResponse:
        if not self._sources.quota_enabled():
            return error_response(404, "token quotas are not configured", "quota_disabled")
        tenant = (query.get("tenant") or [""])[0]
        if not tenant:
            return error_response(400, "query parameter 'tenant' is required", "missing_tenant")
        try:
            return json_response(200, await self._sources.quota_report(tenant))
        except ReportUnavailable as exc:
            return error_response(503, str(exc), "quota_backend_unavailable", "server_error")


class AdminServer:
    """Serves an ``AdminApp`` over HTTP/1.1 (keep-alive) on an already bound socket."""

    def __init__(self, app: AdminApp, sock: socket.socket) -> None:
        self._app = app
        self._sock = sock
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.StreamWriter] = set()

    def fds(self) -> list[int]:
        """The listening socket and open connections: a forked child must close them."""
        fds = [self._sock.fileno()]
        for writer in self._connections:
            sock = writer.get_extra_info("socket")
            if sock is not None and sock.fileno() >= 0:
                fds.append(sock.fileno())
        return [fd for fd in fds if fd >= 0]

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve_connection, sock=self._sock)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        else:
            self._sock.close()

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD_BYTES)
        self._connections.add(writer)
        try:
            while True:
                request = await _read_request(conn, reader)
                if request is None:
                    break
                method = request.method.decode("ascii", "replace")
                response = await self._app.handle(method, request.target.decode("ascii", "replace"))
                await _send(conn, writer, response, head_only=method == "HEAD")
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is not h11.DONE:
                    break
                conn.start_next_cycle()
        except h11.RemoteProtocolError as exc:
            if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                status = exc.error_status_hint
                response = error_response(status, f"malformed request: {exc}", "bad_request")
                await _send(conn, writer, response, head_only=False, close=True)
        except (ConnectionError, TimeoutError, h11.LocalProtocolError):
            pass
        finally:
            self._connections.discard(writer)
            writer.close()


async def _read_request(conn: h11.Connection, reader: asyncio.StreamReader) -> h11.Request | None:
    """The next complete request (its body read and dropped), or None when the peer is done."""
    request: h11.Request | None = None
    body_bytes = 0
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await asyncio.wait_for(reader.read(65536), _IDLE_TIMEOUT)
            conn.receive_data(data)
        elif isinstance(event, h11.Request):
            request = event
        elif isinstance(event, h11.Data):
            body_bytes += len(event.data)
            if body_bytes > _MAX_BODY_BYTES:
                raise h11.RemoteProtocolError("request body too large", error_status_hint=413)
        elif isinstance(event, h11.EndOfMessage):
            return request
        else:  # ConnectionClosed or PAUSED after a protocol switch attempt
            return None


async def _send(
    conn: h11.Connection,
    writer: asyncio.StreamWriter,
    response: AdminResponse,
    head_only: bool,
    close: bool = False,
) -> None:
    headers = [
        ("content-type", response.content_type),
        ("content-length", str(len(response.body))),
        ("cache-control", "no-store"),
        *response.headers,
    ]
    if close:
        headers.append(("connection", "close"))
    reason = HTTPStatus(response.status).phrase.encode()
    writer.write(conn.send(h11.Response(status_code=response.status, headers=headers, reason=reason)))
    if response.body and not head_only:
        writer.write(conn.send(h11.Data(data=response.body)))
    writer.write(conn.send(h11.EndOfMessage()))
    await writer.drain()


# --------------------------------------------------------------------------- /admin/quota


class QuotaReporter:
    """``/admin/quota``: reads the shared ledger from the supervisor's loop through its own client."""

    def __init__(self, url: str, quota: Quota) -> None:
        self.key = (url, quota)
        self._url, self._quota = url, quota
        self._client: Any = None
        self._gate: Any = None

    async def report(self, tenant: str) -> dict[str, Any]:
        from gateway.quota.backend import create_client
        from gateway.quota.gate import QuotaBackendUnavailable, QuotaGate
        from gateway.quota.ledger import QuotaLedger

        if self._gate is None:  # made lazily: the client belongs to the running loop
            self._client = create_client(self._url, timeout_s=1.0)
            ledger = QuotaLedger(self._client, reservation_timeout_s=float(self._quota.reservation_timeout))
            self._gate = QuotaGate(ledger, rules_from_config(self._quota), on_backend_error=self._quota.on_backend_error)
        try:
            return await self._gate.quota_report(tenant)
        except QuotaBackendUnavailable as exc:
            raise ReportUnavailable(f"quota backend unavailable: {exc}") from None

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = self._gate = None
