"""The admin pages (docs/operations.md#admin-listener) as pure routing: ``(method, target)`` in,
``AdminResponse`` out.

No sockets here (``gateway.admin.server`` serves an ``AdminApp``), so the pages are easy to test.
The data comes from ``AdminSources``, implemented by the supervisor; ``/metrics`` from a
``MetricsExposition`` that other modules add metric families to.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from gateway.http.errors import error_body

log = logging.getLogger("gridgate.admin")

_JSON = "application/json"


class ReportUnavailable(Exception):
    """A report's source cannot answer right now (-> 503 with this message)."""


class AdminSources(Protocol):
    """What the admin pages read; implemented by the supervisor."""

    def readiness(self) -> tuple[bool, str]:
        """(ready, reason): ready when every serving worker reported ``ready`` and none is stale."""
        ...

    def overlay_report(self) -> dict[str, Any]: ...

    def endpoints_report(self) -> dict[str, Any]: ...

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


def error_response(status: int, message: str, code: str, kind: str | None = None) -> AdminResponse:
    """The OpenAI error shape the data plane uses too (one builder), so clients parse one format."""
    return AdminResponse(status, error_body(status, code, message, kind))


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
        return json_response(200, self._sources.endpoints_report())

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
