"""The admin API's token gate (gateway.admin.pages + tokens): scopes, 401/403, the failed-token brake,
and what stays open with and without admin.tokens."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from gateway.admin.keys_api import KeysApi
from gateway.admin.pages import AdminApp, MetricsExposition
from gateway.admin.tokens import AdminTokens, FailedTokenThrottle
from gateway.config import AdminToken
from gateway.identity.auth import hash_api_key
from tests.unit.test_admin_pages import Sources

TOKENS = [
    AdminToken(name="ops", key=hash_api_key("ops-token"), scopes=["keys:read", "keys:write", "quota:read"]),
    AdminToken(name="viewer", key=hash_api_key("viewer-token"), scopes=["keys:read"]),
]


class NoStore:
    """A supervisor whose config has managed keys off: key pages past the gate answer 404."""

    def store(self) -> None:
        return None

    def on_this_host(self, record: object) -> None:
        return None

    def backend_errors(self) -> tuple[type[BaseException], ...]:
        return (OSError,)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def app(tokens: list[AdminToken], clock: Clock | None = None) -> AdminApp:
    configured = AdminTokens(tokens)
    throttle = FailedTokenThrottle(limit=3, window_s=60, clock=clock or Clock())
    return AdminApp(Sources(), MetricsExposition(), tokens=lambda: configured, keys=KeysApi(NoStore()),
                    throttle=throttle)


def call(admin: AdminApp, method: str, target: str, token: str | None = None,
         peer: str = "10.0.0.1") -> tuple[int, Any, dict[str, str]]:
    authorization = None if token is None else f"Bearer {token}"
    response = asyncio.run(admin.handle(method, target, authorization=authorization, peer=peer))
    body = json.loads(response.body) if response.content_type == "application/json" else response.body
    return response.status, body, dict(response.headers)


def test_without_tokens_the_key_pages_are_forbidden_and_the_read_only_pages_stay_open():
    admin = app([])
    for method, target in (("GET", "/admin/keys"), ("POST", "/admin/keys"), ("GET", "/admin/audit"),
                           ("POST", "/admin/keys/AbCdEfGhIjKl/revoke"), ("GET", "/admin/spend")):
        status, body, _ = call(admin, method, target)
        assert (status, body["error"]["code"]) == (403, "admin_tokens_not_configured")
    assert call(admin, "GET", "/admin/endpoints")[0] == 200
    assert call(admin, "GET", "/admin/quota?tenant=t")[0] == 200
    assert call(admin, "GET", "/healthz")[0] == 200


def test_with_tokens_every_admin_page_needs_one_and_the_probes_stay_open():
    admin = app(TOKENS)
    for target in ("/admin/keys", "/admin/endpoints", "/admin/quota?tenant=t", "/admin/audit", "/admin/nothing"):
        status, body, headers = call(admin, "GET", target, peer=target)  # one address each: no brake here
        assert (status, body["error"]["code"]) == (401, "invalid_admin_token")
        assert headers["www-authenticate"].startswith("Bearer")
    assert call(admin, "GET", "/healthz")[0] == 200
    assert call(admin, "GET", "/readyz")[0] == 200
    assert call(admin, "GET", "/metrics")[0] == 200
    assert call(admin, "GET", "/admin/endpoints", "viewer-token")[0] == 200  # any valid token
    assert call(admin, "GET", "/admin/nothing", "viewer-token")[0] == 404


def test_a_token_lacking_the_scope_gets_403_naming_it():
    admin = app(TOKENS)
    status, body, _ = call(admin, "POST", "/admin/keys", "viewer-token")
    assert status == 403 and body["error"]["code"] == "insufficient_scope" and "keys:write" in body["error"]["message"]
    assert call(admin, "GET", "/admin/quota?tenant=t", "viewer-token")[0] == 403
    assert call(admin, "GET", "/admin/quota?tenant=t", "ops-token")[0] == 200
    # Past the gate: managed keys are off in this config.
    status, body, _ = call(admin, "GET", "/admin/keys", "viewer-token")
    assert (status, body["error"]["code"]) == (404, "managed_keys_disabled")
    assert call(admin, "POST", "/admin/keys", "ops-token")[0] == 404


def test_wrong_methods_on_key_pages_answer_405_with_allow():
    admin = app(TOKENS)
    status, _, headers = call(admin, "DELETE", "/admin/keys/AbCdEfGhIjKl", "ops-token")
    assert status == 405 and headers["allow"] == "GET, HEAD, PATCH"
    status, _, headers = call(admin, "GET", "/admin/keys/AbCdEfGhIjKl/block", "ops-token")
    assert status == 405 and headers["allow"] == "POST"


def test_a_flood_of_bad_tokens_from_one_address_is_slowed_with_429():
    clock = Clock()
    admin = app(TOKENS, clock)
    for _ in range(3):
        assert call(admin, "GET", "/admin/keys", "guess", peer="10.9.9.9")[0] == 401
    status, body, headers = call(admin, "GET", "/admin/keys", "guess", peer="10.9.9.9")
    assert (status, body["error"]["code"]) == (429, "too_many_failed_tokens")
    assert headers["retry-after"] == "60"
    assert call(admin, "GET", "/admin/keys", "viewer-token", peer="10.9.9.9")[0] == 429  # the address waits
    assert call(admin, "GET", "/admin/keys", "viewer-token", peer="10.1.1.1")[0] == 404  # others do not
    clock.now += 30
    assert call(admin, "GET", "/admin/keys", "guess", peer="10.9.9.9")[2]["retry-after"] == "30"
    clock.now += 31
    assert call(admin, "GET", "/admin/keys", "viewer-token", peer="10.9.9.9")[0] == 404


def test_the_throttle_forgets_old_addresses_first_and_stays_bounded():
    clock = Clock()
    throttle = FailedTokenThrottle(limit=1, window_s=60, max_addresses=2, clock=clock)
    for address in ("a", "b", "c"):
        throttle.failed(address)
    assert throttle.retry_after("a") is None  # forgotten: only two addresses are kept
    assert throttle.retry_after("b") == 60 and throttle.retry_after("c") == 60


def test_token_matching_takes_a_bearer_token_only():
    tokens = AdminTokens(TOKENS)
    assert tokens.caller("Bearer ops-token").name == "ops"
    assert tokens.caller("bearer   viewer-token ").name == "viewer"
    for header in (None, "", "Bearer", "Basic b3BzLXRva2Vu", "Bearer ops-token2", "ops-token"):
        assert tokens.caller(header) is None
