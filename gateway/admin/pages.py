"""The admin pages (docs/operations.md#admin-listener) as pure routing: ``(method, target)`` in,
``AdminResponse`` out.

No sockets here (``gateway.admin.server`` serves an ``AdminApp``), so the pages are easy to test.
The data comes from ``AdminSources``, implemented by the supervisor; ``/metrics`` from a
``MetricsExposition`` that other modules add metric families to.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from gateway.admin.tokens import AdminTokens, Caller, FailedTokenThrottle
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

# Pages open to anyone who reaches the listener, tokens or not.
OPEN_PAGES = frozenset({"/healthz", "/readyz", "/metrics"})
# The scope an /admin/* page needs besides a valid token (None: any valid token).
_PAGE_SCOPES = {"/admin/quota": "quota:read", "/admin/spend": "spend:read"}
_ADMIN_REALM = ("www-authenticate", 'Bearer realm="gridgate-admin"')


class KeyPages(Protocol):
    """The managed-keys pages (``gateway.admin.keys_api.KeysApi``)."""

    def allowed_methods(self, path: str) -> str | None: ...

    def scope_for(self, method: str) -> str: ...

    def handle(self, method: str, path: str, query: dict[str, list[str]], body: bytes,
               caller: Caller) -> Awaitable[AdminResponse]: ...

    def note(self, action: str, actor: str, changed: dict[str, Any]) -> Awaitable[None]: ...


class ConsolePages(Protocol):
    """The console (``gateway.admin.console.app.Console``): the web pages under ``/console``."""

    def handle(self, method: str, target: str, headers: Mapping[str, str], body: bytes,
               peer: str) -> Awaitable[AdminResponse]: ...


def is_console_path(path: str) -> bool:
    return path == "/console" or path.startswith("/console/")


def needs_token_config(path: str) -> bool:
    """Pages that answer 403 while no admin token is configured: the key and spend endpoints."""
    return path in ("/admin/keys", "/admin/audit", "/admin/spend") or path.startswith("/admin/keys/")


class AdminApp:
    """Maps a request to an ``AdminResponse``; never raises.

    ``tokens``: the running config's admin tokens. Without any, the read-only pages stay open (the
    config keeps the listener on loopback then) and the key and spend pages answer 403; with tokens,
    every ``/admin/*`` page needs one (401 without, 403 without the page's scope), and an address that
    keeps presenting bad tokens is slowed with 429 (``FailedTokenThrottle``).
    """

    def __init__(self, sources: AdminSources, metrics: MetricsExposition, *,
                 tokens: Callable[[], AdminTokens] | None = None, keys: KeyPages | None = None,
                 throttle: FailedTokenThrottle | None = None, spend: Handler | None = None,
                 providers: Callable[[], dict[str, Any]] | None = None) -> None:
        self._sources = sources
        self._metrics = metrics
        self._tokens = tokens
        self._keys = keys
        self._throttle = throttle or FailedTokenThrottle()
        self._console: ConsolePages | None = None
        self._routes: dict[str, Handler] = {
            "/healthz": self._healthz,
            "/readyz": self._readyz,
            "/metrics": self._render_metrics,
            "/admin/overlay": self._overlay,
            "/admin/endpoints": self._endpoints,
            "/admin/quota": self._quota,
        }
        if spend is not None:  # gateway.admin.spend_api.SpendApi.handle
            self._routes["/admin/spend"] = spend
        if providers is not None:  # the supervisor's conformance verdicts (docs/provider-conformance.md)
            report = providers

            async def providers_page(query: dict[str, list[str]]) -> AdminResponse:
                return json_response(200, report())

            self._routes["/admin/providers"] = providers_page

    @property
    def throttle(self) -> FailedTokenThrottle:
        """The failed-token brake, shared with the console's sign-in."""
        return self._throttle

    def tokens(self) -> AdminTokens:
        """The running config's admin tokens (none configured: an empty set)."""
        return AdminTokens(()) if self._tokens is None else self._tokens()

    async def audit(self, action: str, actor: str, changed: dict[str, Any]) -> None:
        """An entry in the audit log (``GET /admin/audit``) that changes no key; nothing without managed keys."""
        if self._keys is not None:
            await self._keys.note(action, actor, changed)

    def attach_console(self, console: ConsolePages) -> None:
        self._console = console

    async def handle(self, method: str, target: str, *, authorization: str | None = None, body: bytes = b"",
                     peer: str = "", headers: Mapping[str, str] | None = None) -> AdminResponse:
        """``authorization``: the request's Authorization header; ``peer``: the client's address;
        ``headers``: every request header by lower-case name (the console reads its cookie there)."""
        parts = urlsplit(target)
        path = parts.path
        if self._console is not None and is_console_path(path):
            return await self._console.handle(method, target, headers or {}, body, peer)
        try:
            caller = None
            if path not in OPEN_PAGES and path.startswith("/admin/"):
                refused, caller = self._authorize(method, path, authorization, peer)
                if refused is not None:
                    return refused
            return await self._route(method, path, parts.query, body, caller)
        except Exception:  # a broken report must not take the admin listener down
            log.exception("admin page %s failed", path)
            return error_response(500, f"{path} failed; see the supervisor log", "internal_error", "server_error")

    async def dispatch_as(self, caller: Caller, method: str, target: str, body: bytes = b"") -> AdminResponse:
        """An ``/admin/*`` page answered for ``caller`` (a console session's token): the scope check
        applies as for a bearer token, and a change is audited under the caller's name."""
        parts = urlsplit(target)
        refused = self._scope_refusal(method, parts.path, caller)
        if refused is not None:
            return refused
        try:
            return await self._route(method, parts.path, parts.query, body, caller)
        except Exception:
            log.exception("admin page %s failed (console)", parts.path)
            return error_response(500, f"{parts.path} failed; see the supervisor log", "internal_error",
                                  "server_error")

    async def _route(self, method: str, path: str, query: str, body: bytes, caller: Caller | None) -> AdminResponse:
        key_methods = None if self._keys is None else self._keys.allowed_methods(path)
        if key_methods is not None and self._keys is not None:
            if method not in key_methods.split(", "):
                return _not_allowed(method, path, key_methods)
            return await self._keys.handle(method, path, parse_qs(query), body,
                                           caller or Caller("anonymous", frozenset()))
        handler = self._routes.get(path)
        if handler is None:
            return error_response(404, f"no admin page at {path}", "not_found")
        if method not in ("GET", "HEAD"):
            return _not_allowed(method, path, "GET, HEAD")
        return await handler(parse_qs(query))

    def _authorize(self, method: str, path: str, authorization: str | None,
                   peer: str) -> tuple[AdminResponse | None, Caller | None]:
        """(a refusal, or None and the caller) for an ``/admin/*`` page."""
        tokens = None if self._tokens is None else self._tokens()
        if tokens is None or not tokens.configured:
            if needs_token_config(path):
                return error_response(403, "the key and spend endpoints need admin tokens: configure "
                                           "admin.tokens", "admin_tokens_not_configured"), None
            return None, None
        retry_after = self._throttle.retry_after(peer)
        if retry_after is not None:
            response = error_response(429, "too many requests with an invalid admin token from this address; "
                                           f"retry in {retry_after}s", "too_many_failed_tokens")
            response.headers.append(("retry-after", str(retry_after)))
            return response, None
        caller = tokens.caller(authorization)
        if caller is None:
            missing = not authorization
            if not missing:  # a wrong token counts towards the brake; none at all guesses nothing
                self._throttle.failed(peer)
            response = error_response(401, "missing admin token: send Authorization: Bearer <token>" if missing
                                      else "invalid admin token", "invalid_admin_token")
            response.headers.append(_ADMIN_REALM)
            return response, None
        return self._scope_refusal(method, path, caller), caller

    def _scope_refusal(self, method: str, path: str, caller: Caller) -> AdminResponse | None:
        """403 when ``caller`` lacks the scope ``method`` on ``path`` needs, else None."""
        scope = _PAGE_SCOPES.get(path)
        if scope is None and self._keys is not None and self._keys.allowed_methods(path) is not None:
            scope = self._keys.scope_for(method)
        if scope is not None and scope not in caller.scopes:
            return error_response(403, f"admin token {caller.name!r} lacks the scope {scope}", "insufficient_scope")
        return None

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


def _not_allowed(method: str, path: str, allow: str) -> AdminResponse:
    response = error_response(405, f"{method} is not allowed on {path}", "method_not_allowed")
    response.headers.append(("allow", allow))
    return response
