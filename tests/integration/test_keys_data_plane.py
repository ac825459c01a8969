"""Managed keys on the data plane (docs/keys.md), through real gateways sharing one real Valkey and a
real mock provider: a key made with the admin API serves requests, a block/unblock/revoke reaches both
gateways within a second, an expired key and a model outside the key's globs are refused before any
provider sees them, ``GET /v1/gridgate/key`` answers the caller's own key."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime

from gateway.identity.auth import hash_api_key
from gateway.identity.keyformat import key_digest
from tests.harness import Client, candidate, chat, envelope, metric_value, mock_served, request
from tests.integration.test_keys_e2e import TOKENS, admin, wait_for

YAML_KEY = "sk-yaml-team"


def gateways(gateway_factory, providers, url: str, count: int = 2):
    handle = providers["provider-a"]
    overlay = envelope([candidate("m", "provider-a"), candidate("other", "provider-a")])
    auth = {"keys": [{"tenant": "yaml-team", "key": hash_api_key(YAML_KEY)}], "store": {"kind": "valkey", "url": url}}
    return [gateway_factory({"provider-a": [handle.address]}, overlay, extra={"auth": auth, "admin": {"tokens": TOKENS}})
            for _ in range(count)]


def bearer(key: str) -> list[tuple[str, str]]:
    return [("Authorization", f"Bearer {key}")]


def error_code(response) -> str | None:
    return json.loads(response.body)["error"]["code"] if response.status >= 400 else None


def test_a_managed_key_serves_until_blocked_or_revoked_on_every_gateway(gateway_factory, providers,
                                                                         keys_store):
    first, second = gateways(gateway_factory, providers, keys_store.url)
    handle = providers["provider-a"]
    status, created = admin(first, "POST", "/admin/keys", {"tenant": "team-a", "alias": "ci", "models": ["m"]})
    assert status == 201
    key, kid = created["key"], created["record"]["kid"]
    for gateway in (first, second):  # the key reaches both tables, then serves on both
        wait_for(lambda gateway=gateway: chat(gateway.port, "m", bearer(key)).status == 200, "the key to serve", 2.0)
    assert chat(first.port, "m", bearer(YAML_KEY)).status == 200  # auth.keys keep working beside the store

    # A keep-alive connection on the second gateway, open before the block: refused on its next request.
    client = Client(second.port)
    try:
        assert client.request("POST", "/v1/chat/completions", {"model": "m", "messages": []}, bearer(key)).status == 200
        served = mock_served(handle)
        assert admin(first, "POST", f"/admin/keys/{kid}/block")[0] == 200
        blocked_at = time.monotonic()
        wait_for(lambda: error_code(chat(first.port, "m", bearer(key))) == "key_blocked", "the block on the first", 1.0)
        on_open = client.request("POST", "/v1/chat/completions", {"model": "m", "messages": []}, bearer(key))
        while on_open.status == 200 and time.monotonic() - blocked_at < 1.0:
            time.sleep(0.01)
            on_open = client.request("POST", "/v1/chat/completions", {"model": "m", "messages": []}, bearer(key))
        assert (on_open.status, error_code(on_open)) == (401, "key_blocked")
        assert time.monotonic() - blocked_at < 1.0
        body = json.loads(on_open.body)["error"]
        assert body["type"] == "authentication_error" and kid in body["message"]
    finally:
        client.close()
    requests_after_block = mock_served(handle) - served
    assert chat(second.port, "m", bearer(key)).status == 401
    assert mock_served(handle) - served == requests_after_block  # a refused request reaches no provider

    assert admin(first, "POST", f"/admin/keys/{kid}/unblock")[0] == 200
    for gateway in (first, second):
        wait_for(lambda gateway=gateway: chat(gateway.port, "m", bearer(key)).status == 200, "the unblock", 1.0)
    assert admin(second, "POST", f"/admin/keys/{kid}/revoke")[0] == 200
    for gateway in (first, second):
        wait_for(lambda gateway=gateway: error_code(chat(gateway.port, "m", bearer(key))) == "key_revoked",
                 "the revocation", 1.0)


def test_expired_keys_and_models_outside_the_globs_are_refused_before_any_provider(gateway_factory, providers,
                                                                                   keys_store):
    (gateway,) = gateways(gateway_factory, providers, keys_store.url, count=1)
    handle = providers["provider-a"]
    # Four seconds or more: the key must reach the table and serve, and the two requests below be refused
    # and served, before it expires (with two, as little as one second was left for all of it).
    expires = int(time.time()) + 5
    status, created = admin(gateway, "POST", "/admin/keys", {
        "tenant": "team-a", "models": ["m"],
        "expires_at": datetime.fromtimestamp(expires, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")})
    assert status == 201
    key = created["key"]
    wait_for(lambda: chat(gateway.port, "m", bearer(key)).status == 200, "the key to serve", 2.0)
    served = mock_served(handle)
    other = chat(gateway.port, "other", bearer(key))
    assert (other.status, error_code(other)) == (403, "model_not_allowed")
    assert json.loads(other.body)["error"]["type"] == "permission_error"
    assert chat(gateway.port, "other", bearer(YAML_KEY)).status == 200  # the globs are the key's, not the tenant's
    # The model list is narrowed the same way: what the key may use, not all its tenant may.
    status, _, listed = request("127.0.0.1", gateway.port, "GET", "/v1/models", headers=bearer(key))
    assert status == 200 and [model["id"] for model in json.loads(listed)["data"]] == ["m"]
    status, _, unlisted = request("127.0.0.1", gateway.port, "GET", "/v1/models/other", headers=bearer(key))
    assert (status, json.loads(unlisted)["error"]["code"]) == (404, "model_not_found")
    status, _, listed = request("127.0.0.1", gateway.port, "GET", "/v1/models", headers=bearer(YAML_KEY))
    assert status == 200 and sorted(model["id"] for model in json.loads(listed)["data"]) == ["m", "other"]
    while time.time() < expires:
        time.sleep(0.05)
    served += 1
    expired = chat(gateway.port, "m", bearer(key))
    assert (expired.status, error_code(expired)) == (401, "key_expired")
    assert mock_served(handle) == served  # neither the 403 nor the 401 reached the provider


def test_a_caller_reads_its_own_key(gateway_factory, providers, keys_store):
    (gateway,) = gateways(gateway_factory, providers, keys_store.url, count=1)
    status, created = admin(gateway, "POST", "/admin/keys", {
        "tenant": "team-a", "alias": "ci", "models": ["m*"], "limits": {"requests": [{"window": "1m", "count": 60}]}})
    key, kid = created["key"], created["record"]["kid"]
    wait_for(lambda: request("127.0.0.1", gateway.port, "GET", "/v1/gridgate/key", headers=bearer(key))[0] == 200,
             "the key in the table", 2.0)
    status, headers, body = request("127.0.0.1", gateway.port, "GET", "/v1/gridgate/key", headers=bearer(key))
    answer = json.loads(body)
    assert (answer["object"], answer["source"], answer["kid"], answer["tenant"], answer["alias"]) == (
        "gridgate.key", "managed", kid, "team-a", "ci")
    assert answer["status"] == "active" and answer["models"] == ["m*"] and answer["spend"] is None
    assert answer["limits"]["requests"] == [{"window": "1m", "count": 60, "burst": None, "shadow": False}]
    assert headers["content-type"] == "application/json" and headers.get("x-request-id")
    assert key.encode() not in body and key_digest(key).hex().encode() not in body
    assert key.split("-")[2].encode() not in body

    status, _, body = request("127.0.0.1", gateway.port, "GET", "/v1/gridgate/key", headers=bearer(YAML_KEY))
    assert status == 200 and json.loads(body)["source"] == "config" and json.loads(body)["tenant"] == "yaml-team"
    status, _, body = request("127.0.0.1", gateway.port, "GET", "/v1/gridgate/key")
    assert (status, json.loads(body)["error"]["code"]) == (401, "invalid_api_key")
    assert admin(gateway, "POST", f"/admin/keys/{kid}/block")[0] == 200
    wait_for(lambda: request("127.0.0.1", gateway.port, "GET", "/v1/gridgate/key", headers=bearer(key))[0] == 401,
             "the block", 1.0)
    status, _, body = request("127.0.0.1", gateway.port, "POST", "/v1/gridgate/key", headers=bearer(YAML_KEY))
    assert (status, json.loads(body)["error"]["code"]) == (404, "route_not_allowed")


def test_a_managed_key_is_metered_by_its_own_limits_and_its_rule_like_a_yaml_key(gateway_factory, providers,
                                                                                  keys_store):
    handle = providers["provider-a"]
    # 50 an hour for the bots, a slot back every 72 s: at 50 a minute one came back every 1.2 s, and a slow
    # machine that took that long from the first request to the read below found 49 left, not 48.
    rules = [{"name": "bots", "match": {"key": "ci-*"}, "requests": [{"window": "1h", "count": 50}]},
             {"name": "humans", "match": {"key": "alice"}, "requests": [{"window": "1m", "count": 50}]},
             {"name": "team", "match": {"tenant": "team-q"}, "requests": [{"window": "1m", "count": 3}]}]
    gateway = gateway_factory({"provider-a": [handle.address]}, envelope([candidate("m", "provider-a")]), extra={
        "auth": {"keys": [{"tenant": "yaml-team", "key": hash_api_key(YAML_KEY)}]}, "admin": {"tokens": TOKENS},
        "quota": {"backend": {"kind": "valkey", "url": keys_store.url}, "rules": rules}})
    status, created = admin(gateway, "POST", "/admin/keys", {
        "tenant": "team-q", "alias": "ci-bot",
        "limits": {"requests": [{"window": "1m", "count": 2}], "budgets": [{"window": "1h", "tokens": 900}]}})
    assert status == 201
    key, kid = created["key"], created["record"]["kid"]
    wait_for(lambda: request("127.0.0.1", gateway.port, "GET", "/v1/gridgate/key", headers=bearer(key))[0] == 200,
             "the key in the table", 2.0)
    first = chat(gateway.port, "m", bearer(key), max_tokens=10)
    assert first.status == 200
    assert (first.headers["x-ratelimit-limit-requests"], first.headers["x-ratelimit-remaining-requests"]) == ("2", "1")
    assert first.headers["x-ratelimit-limit-tokens"] == "900"  # the key's own budget
    assert chat(gateway.port, "m", bearer(key), max_tokens=10).status == 200
    refused = chat(gateway.port, "m", bearer(key), max_tokens=10)
    assert (refused.status, error_code(refused)) == (429, "rate_limit_exceeded")
    assert "key requests 2/1m" in json.loads(refused.body)["error"]["message"]

    # The caller reads what is left: its own limits (counted under its kid) and its rule.
    status, _, body = request("127.0.0.1", gateway.port, "GET", "/v1/gridgate/key", headers=bearer(key))
    remaining = json.loads(body)["remaining"]
    (own,) = remaining["keys"]
    assert (own["key"], own["requests"][0]["remaining"], own["windows"][0]["limit"]) == (kid, 0, 900)
    # The rules that can apply to this key (for some model): its first match meters it now.
    assert [rule["rule"] for rule in remaining["rules"]] == ["bots", "team"]
    assert remaining["rules"][0]["requests"][0]["remaining"] == 48


def test_a_key_with_allowed_origins_is_refused_from_other_pages(gateway_factory, providers,
                                                               keys_store):
    """docs/cors.md, "A key's own origins": a page on another origin cannot use the key (403
    origin_not_allowed, nothing forwarded); its own origin and non-browser clients (no Origin) can."""
    (gateway,) = gateways(gateway_factory, providers, keys_store.url, count=1)
    handle = providers["provider-a"]
    status, created = admin(gateway, "POST", "/admin/keys",
                            {"tenant": "team-a", "allowed_origins": ["https://app.example.com", r"regex:https://[a-z]+\.example\.org"]})
    assert status == 201, created
    key = created["key"]
    wait_for(lambda: chat(gateway.port, "m", bearer(key)).status == 200, "the key to serve", 2.0)
    served = mock_served(handle)
    other = chat(gateway.port, "m", [*bearer(key), ("Origin", "https://evil.example.com")])
    assert (other.status, error_code(other)) == (403, "origin_not_allowed")
    assert mock_served(handle) == served
    assert chat(gateway.port, "m", [*bearer(key), ("Origin", "https://app.example.com")]).status == 200
    assert chat(gateway.port, "m", [*bearer(key), ("Origin", "https://pages.example.org")]).status == 200
    assert chat(gateway.port, "m", [*bearer(key), ("Origin", "https://pages.example.org.evil.com")]).status == 403
    assert chat(gateway.port, "m", [*bearer(YAML_KEY), ("Origin", "https://evil.example.com")]).status == 200


def test_a_tenant_made_with_the_admin_api_after_the_workers_started_has_its_own_token_counts(
        gateway_factory, providers, keys_store):
    # gridgate_tenant_tokens_total labels tenants by the supervisor's registry, which workers get when they
    # fork; a managed key's tenant is new to them, so its table entry carries its index: counted under its
    # own name, not under "other".
    handle = providers["provider-a"]
    gateway = gateway_factory({"provider-a": [handle.address]}, envelope([candidate("m", "provider-a")]), workers=2,
                              extra={"auth": {"keys": [{"tenant": "yaml-team", "key": hash_api_key(YAML_KEY)}]},
                                     "admin": {"tokens": TOKENS},
                                     "quota": {"backend": {"kind": "valkey", "url": keys_store.url},
                                               "rules": [{"name": "all", "budgets": [{"window": "1m", "tokens": 10**9}]}]}})
    tenant = f"made-{time.monotonic_ns()}"
    status, created = admin(gateway, "POST", "/admin/keys", {"tenant": tenant})
    assert status == 201, created
    key = created["key"]
    wait_for(lambda: chat(gateway.port, "m", bearer(key)).status == 200, "the key to serve", 2.0)
    prompts = 0
    for _ in range(5):  # both workers, most likely
        answer = chat(gateway.port, "m", bearer(key), max_tokens=10)
        assert answer.status == 200
        prompts += answer.json()["usage"]["prompt_tokens"]
    sample = f'gridgate_tenant_tokens_total{{direction="in",tenant="{tenant}"}}'  # the wait's requests count too
    wait_for(lambda: metric_value(gateway.admin_port, sample) >= prompts, "the tenant's own series", 5.0)
    assert metric_value(gateway.admin_port, 'gridgate_tenant_tokens_total{direction="in",tenant="other"}') == 0
