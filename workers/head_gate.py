"""The head gate: what the gateway decides on a request's head, before any byte of its body is read
(docs/security.md).

The server calls the gate right after the head passed its strict checks. One header scan (the one
the proxy uses afterwards), then:

1. **Authenticate** the key (when ``auth`` is configured): missing or unknown is 401. Before the
   route check, so a caller without a key learns nothing about which routes exist, and the access
   line of a refused route names the tenant that tried it. With a managed-key table
   (workers/key_gate.py), a key the YAML keys do not know is looked up there with the same digest; a
   blocked, revoked or expired one is 401 ``key_blocked``/``key_revoked``/``key_expired``. With
   client certificates on the listener (workers/cert_gate.py), a request no key identified (none
   sent, or one no table knows) is who its connection's verified certificate names; a certificate
   that names no tenant is 403 ``certificate_not_mapped`` (docs/identity.md, "mTLS").
2. **Route**: the request must be on an allowed route (``gateway.request.routes``), else 404
   ``route_not_allowed``.

A refusal is a ``HeadRefusal``: the server answers it at once with ``Connection: close`` and never
reads the body; it carries what the access line needs. An admitted request gets an ``Admitted``,
which the server hands to the proxy on the exchange, so nothing is scanned or checked twice.
"""

from __future__ import annotations

from hmac import compare_digest
from time import time as _time
from typing import Protocol

from gateway.http.errors import ErrorReply, HeadWait
from gateway.identity.auth import Authenticator, KeyIdentity, presented_key
from gateway.identity.jwt_verify import JwtGrant, JwtRefusal, looks_like_jwt
from gateway.ids import CounterIds
from gateway.keys.view import KeyEntry
from gateway.request.cors import key_origin_reply
from gateway.request.headers import HeaderPlan, RequestHeaders
from gateway.request.routes import AllowedRoute, RouteTable
from workers.cert_gate import ConnectionCertificates
from workers.jwt_gate import JwtGate
from workers.key_gate import ManagedKeyGate

# Quota for requests without authentication is accounted to this tenant.
ANONYMOUS_TENANT = "anonymous"
_WWW_AUTHENTICATE = (b"www-authenticate", b'Bearer realm="gridgate"')
_WWW_AUTHENTICATE_TOKEN = (b"www-authenticate", b'Bearer realm="gridgate", error="invalid_token"')
_MISSING_KEY = "missing API key: send Authorization: Bearer <key> or X-Api-Key"
_INVALID_KEY = "invalid API key"

# (authorization, x-api-key, the YAML key's identity; with managed keys, a managed key's digest instead)
AuthMemo = tuple[bytes, bytes, KeyIdentity | bytes]
JwtMemo = tuple[bytes, bytes, JwtGrant]


class GatedConnection(Protocol):
    """The per-connection slots the server keeps for the gate (and only the gates write)."""

    auth_memo: AuthMemo | None
    jwt_memo: JwtMemo | None  # the last granted token's (authorization, x-api-key, grant): ``admit_jwt``
    peer_identity: object  # workers/cert_gate.py
    head_waited: bool  # the current head is judged again after a wait (``HeadWait``): no second wait


def request_origin(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The request's ``Origin`` (names are lowercase, as the codec delivers them)."""
    for name, value in headers:
        if name == b"origin":
            return value
    return None


class Admitted:
    """A request the gate let through: its route, tenant, scanned headers and request id, its key
    (None without auth) and, for a managed key, its table entry (None for a YAML key). ``cors``: the
    CORS headers of its answers (workers/cors_gate.py sets it; None: CORS is off)."""

    __slots__ = ("route", "tenant", "headers", "request_id", "key", "managed", "cors")

    def __init__(self, route: AllowedRoute, tenant: str, headers: RequestHeaders, request_id: bytes,
                 key: KeyIdentity | None = None, managed: KeyEntry | None = None) -> None:
        self.route = route
        self.tenant = tenant
        self.headers = headers
        self.request_id = request_id
        self.key = key
        self.managed = managed
        self.cors: tuple[tuple[bytes, bytes], ...] | None = None


class HeadRefusal(ErrorReply):
    """A request refused on its head, with what its access line says about it."""

    __slots__ = ("request_id", "method", "target", "tenant")

    def __init__(self, status: int, code: str, message: str, headers: list[tuple[bytes, bytes]], *,
                 request_id: bytes, method: bytes, target: bytes, tenant: str | None) -> None:
        super().__init__(status, code, message, headers, close=True)  # the body is never read
        self.request_id = request_id
        self.method = method
        self.target = target
        self.tenant = tenant


class HeadGate:
    """One per worker; ``__call__`` runs once per request head."""

    __slots__ = ("routes", "auth", "header_plan", "ids", "keys", "certificates", "jwt")

    def __init__(self, routes: RouteTable, auth: Authenticator | None, header_plan: HeaderPlan,
                 ids: CounterIds | None = None, keys: ManagedKeyGate | None = None,
                 certificates: ConnectionCertificates | None = None, jwt: JwtGate | None = None) -> None:
        self.routes = routes
        self.auth = auth
        self.header_plan = header_plan
        self.ids = ids or CounterIds(b"-")
        self.keys = keys if auth is not None else None  # managed keys need authentication
        self.certificates = certificates  # client certificates (mTLS); None when the listener asks for none
        self.jwt = jwt if auth is not None else None  # JWT bearer tokens (docs/identity.md)

    def __call__(self, conn: GatedConnection, method: bytes, target: bytes,
                 headers: list[tuple[bytes, bytes]]) -> Admitted | HeadRefusal:
        scanned = self.header_plan.scan(headers)
        request_id = scanned.request_id or self.ids.next()
        if self.jwt is not None:
            admitted = self.admit_jwt(conn, method, target, scanned, request_id)
            if admitted is not None:
                return admitted
        auth = self.auth
        keys = self.keys
        managed = None
        if keys is None:
            key = None if auth is None else self.authenticate(conn, scanned, auth)
        else:
            found = keys.authenticate(conn, scanned, auth)  # type: ignore[arg-type]
            if found.__class__ is KeyEntry:
                managed = found
                key = found.identity  # type: ignore[union-attr]
                if managed.origins is not None:  # type: ignore[union-attr]
                    refused = key_origin_reply(request_origin(headers), managed.origins)  # type: ignore[union-attr]
                    if refused is not None:
                        return HeadRefusal(403, refused.code, refused.message, [(b"x-request-id", request_id)],
                                           request_id=request_id, method=method, target=target, tenant=key.tenant)
            elif found.__class__ is tuple:  # a key the table knows but refuses
                code, message, tenant = found  # type: ignore[misc]
                return HeadRefusal(401, code, message, [_WWW_AUTHENTICATE, (b"x-request-id", request_id)],
                                   request_id=request_id, method=method, target=target, tenant=tenant)
            else:
                key = found  # type: ignore[assignment]
        if key is None and self.certificates is not None:  # no key identified it: the certificate may
            named = self.certificates(conn)  # type: ignore[arg-type]
            if named.__class__ is str:
                return HeadRefusal(403, "certificate_not_mapped", named, [(b"x-request-id", request_id)],  # type: ignore[arg-type]
                                   request_id=request_id, method=method, target=target, tenant=None)
            key = named  # type: ignore[assignment]
        if key is None and auth is not None:
            missing = scanned.authorization is None and scanned.api_key is None
            return HeadRefusal(401, "invalid_api_key", _MISSING_KEY if missing else _INVALID_KEY,
                               [_WWW_AUTHENTICATE, (b"x-request-id", request_id)],
                               request_id=request_id, method=method, target=target, tenant=None)
        tenant = ANONYMOUS_TENANT if key is None else key.tenant
        route = self.routes.match(method, target)
        if route is None:
            return route_not_allowed(method, target, request_id, tenant)
        return Admitted(route, tenant, scanned, request_id, key, managed)

    def admit_jwt(self, conn: GatedConnection, method: bytes, target: bytes, scanned: RequestHeaders,
                  request_id: bytes) -> Admitted | HeadRefusal | None:
        """A JWT bearer's request, or None when the credential has no JWT's shape (an opaque API key).

        A keep-alive client sends its token with every request: when both key headers equal those the
        connection's last granted token came in (compared in constant time), that grant serves while
        ``JwtVerifier.current`` (unexpired, key sets unchanged), without hashing the token again. Like
        ``auth_memo``, it stays with the connection, whose buffers hold the token anyway."""
        authorization = scanned.authorization or b""
        api_key = scanned.api_key or b""
        jwt = self.jwt
        memo = conn.jwt_memo
        if memo is not None and compare_digest(memo[0], authorization) and compare_digest(memo[1], api_key):
            kept = memo[2]
            # ``JwtVerifier.current`` (unexpired, key sets unchanged since) and ``admit_token`` written out for a kept
            # grant (a client reusing its token: nearly every request of a JWT client): three calls fewer per request.
            if kept.valid_until > _time() and kept.keys_generation == jwt.verifier.keys_generation:  # type: ignore[union-attr]
                key = kept.identity
                route = self.routes.match(method, target)
                if route is None:
                    return route_not_allowed(method, target, request_id, key.tenant)
                return Admitted(route, key.tenant, scanned, request_id, key, kept)  # type: ignore[arg-type]
        token = presented_key(scanned.authorization, scanned.api_key)
        if token is None or not looks_like_jwt(token):
            return None
        found = jwt.grant(token)  # type: ignore[union-attr]
        if found.__class__ is JwtGrant:
            conn.jwt_memo = (authorization, api_key, found)  # type: ignore[assignment]
        elif found.kid is not None and not conn.head_waited:  # type: ignore[union-attr]  # an unknown kid
            until = jwt.waits.wait_for(found.issuer, found.kid)  # type: ignore[union-attr]
            if until is not None:  # wait for the issuer's next key set, then this head is judged again
                raise HeadWait(until)
        return self.admit_token(found, method, target, scanned, request_id)

    def admit_token(self, found: JwtGrant | JwtRefusal, method: bytes, target: bytes, scanned: RequestHeaders,
                    request_id: bytes) -> Admitted | HeadRefusal:
        """A JWT's request: its grant is the request's identity (``managed``: its model globs), its
        refusal a 401 ``invalid_token`` naming the check that failed."""
        if found.__class__ is not JwtGrant:
            message = f"invalid token ({found.check}): {found.message}"  # type: ignore[union-attr]
            return HeadRefusal(401, "invalid_token", message, [_WWW_AUTHENTICATE_TOKEN, (b"x-request-id", request_id)],
                               request_id=request_id, method=method, target=target, tenant=None)
        key = found.identity  # type: ignore[union-attr]
        route = self.routes.match(method, target)
        if route is None:
            return route_not_allowed(method, target, request_id, key.tenant)
        return Admitted(route, key.tenant, scanned, request_id, key, found)  # type: ignore[arg-type]

    def authenticate(self, conn: GatedConnection, headers: RequestHeaders, auth: Authenticator) -> KeyIdentity | None:
        """Who the presented key is, or None (missing or unknown).

        A keep-alive client sends the same key with every request: when both key headers equal those
        its connection's last request was admitted with (compared in constant time), the key is that
        request's, without hashing again. The key stays with the connection, whose buffers hold it
        anyway, and goes with it; nothing keyed by a raw key outlives a connection.
        """
        authorization = headers.authorization or b""
        api_key = headers.api_key or b""
        memo = conn.auth_memo
        if memo is not None and compare_digest(memo[0], authorization) and compare_digest(memo[1], api_key):
            return memo[2]  # type: ignore[return-value]  # an identity: this path memoises only YAML keys
        key = auth.identify(headers.authorization, headers.api_key)
        if key is not None:
            conn.auth_memo = (authorization, api_key, key)
        return key


def route_not_allowed(method: bytes, target: bytes, request_id: bytes, tenant: str | None) -> HeadRefusal:
    """404 ``route_not_allowed``: not a route the gateway serves (docs/security.md)."""
    path = target.split(b"?", 1)[0].decode("latin-1")
    if len(path) > 200:
        path = path[:200] + "..."
    message = f"{method.decode('latin-1')} {path} is not a route this gateway serves"
    return HeadRefusal(404, "route_not_allowed", message, [(b"x-request-id", request_id)],
                       request_id=request_id, method=method, target=target, tenant=tenant)
