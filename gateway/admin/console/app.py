"""The console (docs/console.md): server-rendered pages under ``/console`` on the admin listener.

Off unless ``admin.tokens`` is set. Signing in exchanges an admin token for a session cookie
(``session.py``); the pages read the supervisor's ``ConsoleSources`` and, for keys and spend, the
admin API itself through ``AdminApp.dispatch_as``, so a console change passes the same scope check and
lands in the same audit log, under the token's name, as a call with the bearer token would. Every
answer carries the security headers of ``guard.py``. ``/console/api/<page>`` answers a page's data as
JSON with its live part rendered, which the page's script polls to refresh in place.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from gateway.admin.console.guard import SECURITY_HEADERS, is_https, same_origin
from gateway.admin.console.keys_page import KeysPage
from gateway.admin.console.session import (
    SessionBook,
    cleared_cookie,
    cookie_value,
    csrf_matches,
    session_cookie,
)
from gateway.admin.console.traffic import TrafficShare
from gateway.admin.console.views import cluster_totals, endpoints_view, providers_view, requests_view
from gateway.admin.pages import AdminApp, AdminResponse, error_response, json_response
from gateway.admin.tokens import Caller, token_digest
from gateway.overlay.snapshot import Snapshot

log = logging.getLogger("gridgate.admin")

_HERE = Path(__file__).parent
_HTML = "text/html; charset=utf-8"
_STATIC_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
REFRESH_MS = 2000


class ConsoleSources(Protocol):
    """What the console reads from the supervisor (``gateway.supervisor.console_sources``)."""

    def overlay_snapshot(self) -> Snapshot | None: ...

    def overlay_age_s(self) -> float | None: ...

    def overlay_report(self) -> dict[str, Any]: ...

    def endpoints_report(self) -> dict[str, Any]: ...

    def recent_requests(self) -> list[dict[str, Any]]:
        """The workers' last requests, newest first (``gateway.process_protocol.RecentRequest`` fields)."""
        ...


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: Mapping[str, str]
    body: bytes
    peer: str

    def form(self) -> dict[str, str]:
        return {name: values[0] for name, values in parse_qs(self.body.decode("utf-8", "replace")).items()}


@dataclass(frozen=True, slots=True)
class Page:
    title: str
    template: str  # <template>.html is the page, <template>_live.html its refreshed part
    view: Callable[[Caller, Request], Awaitable[dict[str, Any]]]


class Console:
    def __init__(self, admin: AdminApp, sources: ConsoleSources, *, sessions: SessionBook | None = None,
                 traffic: TrafficShare | None = None, refresh_ms: int = REFRESH_MS) -> None:
        self._admin = admin
        self._sources = sources
        self._sessions = sessions or SessionBook()
        self._traffic = traffic or TrafficShare()
        self._refresh_ms = refresh_ms
        self._templates: Any = None  # a jinja2.Environment, made on the first page: no cost until then
        self._static = {path.name: (path.read_bytes(), _STATIC_TYPES[path.suffix])
                        for path in (_HERE / "static").iterdir() if path.suffix in _STATIC_TYPES}
        self._pages: dict[str, Page] = {
            "providers": Page("Providers", "providers", self._providers),
            "endpoints": Page("Endpoints", "endpoints", self._endpoints),
            "keys": Page("Tenants and keys", "keys", self._keys_view),
            "requests": Page("Last requests", "requests", self._requests),
        }
        self._keys = KeysPage(admin)

    async def handle(self, method: str, target: str, headers: Mapping[str, str], body: bytes,
                     peer: str) -> AdminResponse:
        parts = urlsplit(target)
        request = Request(method, parts.path.rstrip("/") or "/", parse_qs(parts.query), headers, body, peer)
        try:
            response = await self._route(request)
        except Exception:  # a broken page must not take the admin listener down
            log.exception("console page %s failed", request.path)
            response = error_response(500, f"{request.path} failed; see the supervisor log", "internal_error",
                                      "server_error")
        response.headers.extend(SECURITY_HEADERS)
        return response

    async def _route(self, request: Request) -> AdminResponse:
        if not self._admin.tokens().configured:
            return error_response(404, "the console is off: it needs admin tokens (admin.tokens)", "console_disabled")
        if request.path.startswith("/console/static/"):
            return self._static_file(request)
        if request.path == "/console/login":
            return await self._login(request)
        session_id = cookie_value(request.headers.get("cookie"))
        session = self._sessions.find(session_id)
        await self._audit_expired()
        caller = None if session is None else self._admin.tokens().caller_by_digest(session.token_digest)
        if session is None or caller is None:
            self._sessions.close(session_id)  # a token taken out of admin.tokens ends its sessions
            return self._signed_out(request)
        if request.method == "POST":
            if not (same_origin(request.headers) and
                    csrf_matches(session, request.headers.get("x-csrf-token") or request.form().get("csrf"))):
                return error_response(403, "the change lacks this session's CSRF token, or comes from another "
                                           "site", "csrf_failed")
            if request.path == "/console/logout":
                self._sessions.close(session_id)
                log.info("console: %s signed out", caller.name)
                await self._admin.audit("console_sign_out", caller.name, {"address": request.peer})
                return _redirect("/console", cleared_cookie(is_https(request.headers)))
            return await self._action(request, caller, session.csrf)
        if request.method not in ("GET", "HEAD"):
            return _not_allowed(request, "GET, HEAD")
        return await self._page(request, caller, session.csrf)

    async def _page(self, request: Request, caller: Caller, csrf: str, notice: dict[str, Any] | None = None,
                    status: int = 200) -> AdminResponse:
        api = request.path.startswith("/console/api/")
        name = request.path.removeprefix("/console/api/" if api else "/console").strip("/") or "providers"
        page = self._pages.get(name)
        if page is None:
            return error_response(404, f"no console page at {request.path}", "not_found")
        view = await page.view(caller, request)
        context = {"page": name, "title": page.title, "pages": self._pages, "caller": caller.name,
                   "scopes": sorted(caller.scopes), "csrf": csrf, "view": view, "refresh_ms": self._refresh_ms,
                   "refresh_url": f"/console/api/{name}", "notice": notice}
        live = self._template(f"{page.template}_live.html").render(context)
        if api:
            return json_response(200, {"page": name, "view": view, "html": live})
        html = self._template(f"{page.template}.html").render(context, live=live)
        return AdminResponse(status, html.encode(), _HTML)

    def _template(self, name: str) -> Any:
        if self._templates is None:
            import jinja2

            self._templates = jinja2.Environment(loader=jinja2.FileSystemLoader(_HERE / "templates"),
                                                 autoescape=True, undefined=jinja2.StrictUndefined)
        return self._templates.get_template(name)

    async def _action(self, request: Request, caller: Caller, csrf: str) -> AdminResponse:
        """A key change from the keys page's forms; the answer is the keys page with what happened."""
        if not request.path.startswith("/console/keys/"):
            return error_response(404, f"no console action at {request.path}", "not_found")
        try:
            answer, notice = await self._keys.act(caller, request.path, request.form())
        except LookupError:
            return error_response(404, f"no console action at {request.path}", "not_found")
        if "problem" not in notice and notice.get("key") is None:
            return _redirect("/console/keys", None)  # nothing to show once: back to the page
        page = Request("GET", "/console/keys", {}, request.headers, b"", request.peer)
        return await self._page(page, caller, csrf, notice, 200 if "problem" not in notice else answer.status)

    async def _providers(self, caller: Caller, request: Request) -> dict[str, Any]:
        endpoints = self._sources.endpoints_report()
        shares = self._traffic.observe(cluster_totals(endpoints))
        return providers_view(self._sources.overlay_snapshot(), endpoints, self._sources.overlay_report(), shares,
                              self._sources.overlay_age_s())

    async def _endpoints(self, caller: Caller, request: Request) -> dict[str, Any]:
        return endpoints_view(self._sources.endpoints_report())

    async def _keys_view(self, caller: Caller, request: Request) -> dict[str, Any]:
        return await self._keys.view(caller)

    async def _requests(self, caller: Caller, request: Request) -> dict[str, Any]:
        return requests_view(self._sources.recent_requests())

    # ------------------------------------------------------------------ signing in and out

    async def _login(self, request: Request) -> AdminResponse:
        if request.method != "POST":
            return _not_allowed(request, "POST")
        if not same_origin(request.headers):
            return self._login_page(403, "sign in from the console's own page")
        retry_after = self._admin.throttle.retry_after(request.peer)
        if retry_after is not None:
            response = self._login_page(429, f"too many invalid admin tokens from this address; retry in "
                                             f"{retry_after}s")
            response.headers.append(("retry-after", str(retry_after)))
            return response
        digest = token_digest(request.form().get("token", "").strip().encode("utf-8", "replace"))
        caller = self._admin.tokens().caller_by_digest(digest)
        if caller is None:
            self._admin.throttle.failed(request.peer)
            log.warning("console: a sign-in with an invalid admin token from %s", request.peer)
            await self._admin.audit("console_sign_in_failed", "", {"address": request.peer})  # no name: no token
            return self._login_page(401, "invalid admin token")
        session_id = self._sessions.open(digest)
        log.info("console: %s signed in from %s", caller.name, request.peer)
        await self._admin.audit("console_sign_in", caller.name, {"address": request.peer})
        await self._audit_expired()
        return _redirect("/console", session_cookie(session_id, int(self._sessions.ttl_s), is_https(request.headers)))

    async def _audit_expired(self) -> None:
        for session in self._sessions.take_expired():
            caller = self._admin.tokens().caller_by_digest(session.token_digest)
            name = "" if caller is None else caller.name  # "": the token has left admin.tokens since
            log.info("console: a session of %s expired", name or "a removed token")
            await self._admin.audit("console_session_expired", name, {})

    def _signed_out(self, request: Request) -> AdminResponse:
        if request.method in ("GET", "HEAD") and not request.path.startswith("/console/api/"):
            if request.path == "/console":
                return self._login_page(200, None)
            return _redirect("/console", None)
        return error_response(401, "sign in to the console first (its session ended or never began)",
                              "console_session_required")

    def _login_page(self, status: int, problem: str | None) -> AdminResponse:
        html = self._template("login.html").render(problem=problem, title="Sign in")
        return AdminResponse(status, html.encode(), _HTML)

    def _static_file(self, request: Request) -> AdminResponse:
        found = self._static.get(request.path.removeprefix("/console/static/"))
        if found is None:
            return error_response(404, f"no console file at {request.path}", "not_found")
        if request.method not in ("GET", "HEAD"):
            return _not_allowed(request, "GET, HEAD")
        return AdminResponse(200, found[0], found[1])


def _redirect(location: str, cookie: str | None) -> AdminResponse:
    response = AdminResponse(303, b"", _HTML, [("location", location)])
    if cookie is not None:
        response.headers.append(("set-cookie", cookie))
    return response


def _not_allowed(request: Request, allow: str) -> AdminResponse:
    response = error_response(405, f"{request.method} is not allowed on {request.path}", "method_not_allowed")
    response.headers.append(("allow", allow))
    return response
