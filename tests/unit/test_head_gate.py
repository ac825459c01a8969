"""The head gate (workers/head_gate.py): key, then route, from one header scan; the per-connection
memo it owns. Real Authenticator, HeaderPlan and RouteTable; a bare slot holder stands in for the
server's connection (the gate only reads and writes its ``auth_memo``)."""

from __future__ import annotations

import json
import os
import time

from gateway.config import parse_config
from gateway.identity.auth import Authenticator, hash_api_key
from gateway.request.headers import HeaderPlan
from gateway.request.routes import API, MODELS, RouteTable
from tests.jwt_idp import SigningKey, claims, jwks
from workers.head_gate import ANONYMOUS_TENANT, Admitted, HeadGate, HeadRefusal
from workers.jwt_gate import JwtGate


class Connection:
    __slots__ = ("auth_memo", "jwt_memo", "head_waited")

    def __init__(self) -> None:
        self.auth_memo = None
        self.jwt_memo = None
        self.head_waited = False


def gate(auth: bool = True) -> HeadGate:
    keys = Authenticator([("team-a", hash_api_key("sk-a")), ("team-b", hash_api_key("sk-b"))]) if auth else None
    return HeadGate(RouteTable("/mcp", [("c", ["GET /v1/files/*"])], {"c": 0}), keys, HeaderPlan("X-Model"))


def bearer(key: str, *more: tuple[bytes, bytes]) -> list[tuple[bytes, bytes]]:
    return [(b"host", b"g"), (b"authorization", b"Bearer " + key.encode()), *more]


def test_admits_a_known_key_on_an_allowed_route_with_the_scanned_headers() -> None:
    admitted = gate()(Connection(), b"POST", b"/v1/chat/completions",
                      bearer("sk-a", (b"x-request-id", b"r-1"), (b"x-custom", b"kept")))
    assert type(admitted) is Admitted
    assert (admitted.tenant, admitted.request_id, admitted.route.kind) == ("team-a", b"r-1", API)
    assert admitted.headers.forward == [(b"x-custom", b"kept")]  # the key is consumed, never forwarded


def test_a_missing_or_unknown_key_is_401_whatever_the_route() -> None:
    front = gate()
    missing = front(Connection(), b"GET", b"/admin/health", [(b"host", b"g")])
    unknown = front(Connection(), b"POST", b"/v1/chat/completions", bearer("sk-x", (b"x-request-id", b"r-2")))
    for refusal in (missing, unknown):
        assert type(refusal) is HeadRefusal and refusal.status == 401 and refusal.code == "invalid_api_key"
        assert refusal.close and refusal.tenant is None
        assert (b"www-authenticate", b'Bearer realm="gridgate"') in refusal.headers
    assert "missing API key" in missing.message and unknown.message == "invalid API key"
    assert (b"x-request-id", b"r-2") in unknown.headers and unknown.request_id == b"r-2"
    assert (unknown.method, unknown.target) == (b"POST", b"/v1/chat/completions")


def test_a_known_key_on_a_route_not_allowed_is_404_naming_the_tenant() -> None:
    refusal = gate()(Connection(), b"DELETE", b"/v1/files/x?y=1", bearer("sk-b"))
    assert type(refusal) is HeadRefusal and (refusal.status, refusal.code) == (404, "route_not_allowed")
    assert refusal.tenant == "team-b" and "DELETE /v1/files/x " in refusal.message
    assert refusal.request_id and (b"x-request-id", refusal.request_id) in refusal.headers


def test_without_auth_every_request_is_anonymous_and_routes_still_apply() -> None:
    front = gate(auth=False)
    assert front(Connection(), b"GET", b"/v1/models", [(b"host", b"g")]).route.kind == MODELS  # type: ignore[union-attr]
    assert front(Connection(), b"POST", b"/v1/completions", []).tenant == ANONYMOUS_TENANT  # type: ignore[union-attr]
    assert type(front(Connection(), b"GET", b"/metrics", [])) is HeadRefusal


def test_the_connection_memo_admits_only_the_same_key_headers() -> None:
    front = gate()
    conn = Connection()
    assert front(conn, b"POST", b"/v1/completions", bearer("sk-a")).tenant == "team-a"  # type: ignore[union-attr]
    assert conn.auth_memo[:2] == (b"Bearer sk-a", b"") and conn.auth_memo[2].tenant == "team-a"
    assert front(conn, b"POST", b"/v1/completions", bearer("sk-a")).tenant == "team-a"  # type: ignore[union-attr]
    assert front(conn, b"POST", b"/v1/completions", bearer("sk-b")).tenant == "team-b"  # type: ignore[union-attr]
    assert conn.auth_memo[2].tenant == "team-b"
    refused = front(conn, b"POST", b"/v1/completions", bearer("sk-b", (b"x-api-key", b"sk-a")))
    assert refused.tenant == "team-b"  # type: ignore[union-attr]  # Bearer wins, but not from the memo
    assert type(front(conn, b"POST", b"/v1/completions", bearer("sk-bx"))) is HeadRefusal
    assert type(front(conn, b"POST", b"/v1/completions", [(b"host", b"g")])) is HeadRefusal
    assert conn.auth_memo[2].tenant == "team-b"  # a refused key never enters the memo


def test_generated_request_ids_are_unique() -> None:
    front = gate(auth=False)
    ids = {front(Connection(), b"POST", b"/v1/completions", []).request_id for _ in range(100)}  # type: ignore[union-attr]
    assert len(ids) == 100


ISS = "https://idp.example.com"


def jwt_gate(directory: str, *keys: SigningKey) -> tuple[HeadGate, JwtGate, str]:
    entry = {"name": "okta", "issuer": ISS, "audience": ["gridgate"], "jwks_file": "keys.json",
             "algorithms": ["RS256"], "tenant_claim": "org", "leeway": "0s"}
    config = parse_config('clusters: [{name: a, endpoints: ["127.0.0.1:9001"]}]\nrouting: {overlay_file: o.json}\n'
                          "auth: {jwt: [" + json.dumps(entry) + "]}\n")
    path = os.path.join(directory, "keys.json")
    with open(path, "wb") as handle:
        handle.write(jwks(*keys))
    tokens = JwtGate(config.auth.jwt, {"okta": path})
    keys_ = Authenticator([("team-a", hash_api_key("sk-a"))])
    return HeadGate(RouteTable("/mcp", [], {}), keys_, HeaderPlan("X-Model"), jwt=tokens), tokens, path


def test_a_connection_reusing_its_token_is_admitted_while_the_grant_is_current(tmp_path) -> None:
    old, new = SigningKey("RS256", "k1"), SigningKey("RS256", "k2")
    front, tokens, path = jwt_gate(str(tmp_path), old)
    conn = Connection()
    alice, bob = old.sign(claims(ISS, sub="alice")), old.sign(claims(ISS, sub="bob", org="other"))
    for token, tenant in ((alice, "acme"), (alice, "acme"), (bob, "other"), ("sk-a", "team-a"), (alice, "acme")):
        admitted = front(conn, b"POST", b"/v1/chat/completions", bearer(token))
        assert type(admitted) is Admitted and admitted.tenant == tenant, (token[:10], admitted)
    assert conn.jwt_memo is not None and conn.jwt_memo[0] == b"Bearer " + alice.encode()
    # The IdP drops k1: the connection's kept grant no longer admits the token it signed.
    with open(path + ".tmp", "wb") as handle:
        handle.write(jwks(new))
    os.replace(path + ".tmp", path)
    assert tokens.poll()
    refused = front(conn, b"POST", b"/v1/chat/completions", bearer(alice))
    assert type(refused) is HeadRefusal and (refused.status, refused.code) == (401, "invalid_token")
    assert "(kid)" in refused.message


def test_a_kept_grant_expires_with_its_token(tmp_path) -> None:
    key = SigningKey("RS256", "k1")
    front, _, _ = jwt_gate(str(tmp_path), key)
    conn = Connection()
    token = key.sign(claims(ISS, lifetime=1))
    assert type(front(conn, b"POST", b"/v1/chat/completions", bearer(token))) is Admitted
    time.sleep(1.3)
    refused = front(conn, b"POST", b"/v1/chat/completions", bearer(token))
    assert type(refused) is HeadRefusal and refused.code == "invalid_token" and "(exp)" in refused.message
