"""Managed keys through real gateways (docs/keys.md): the admin API and CLI over a real supervisor, two
gateways on one Valkey, a store that goes away and comes back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import valkey

from gateway.identity.auth import hash_api_key
from gateway.identity.keyformat import key_digest
from gateway.keys.store import deny_set_key
from tests.harness import ROOT, candidate, envelope, metric_value, request
from tests.unit.test_key_records import KEY_PATTERN

OPS, VIEWER = "ops-admin-token", "viewer-admin-token"
TOKENS = [{"name": "ops", "key": hash_api_key(OPS), "scopes": ["keys:read", "keys:write"]},
          {"name": "viewer", "key": hash_api_key(VIEWER), "scopes": ["keys:read"]}]


def keys_gateway(gateway_factory, providers, url: str | None = None, **extra: Any):
    store = {"kind": "embedded"} if url is None else {"kind": "valkey", "url": url}
    handle = providers["provider-a"]
    return gateway_factory({"provider-a": [handle.address]}, envelope([candidate("m", "provider-a")]),
                           extra={"auth": {"store": store}, "admin": {"tokens": TOKENS}, **extra})


def admin(gateway, method: str, path: str, body: Any = None, token: str | None = OPS) -> tuple[int, Any]:
    headers = [] if token is None else [("Authorization", f"Bearer {token}")]
    try:
        status, _, data = request("127.0.0.1", gateway.admin_port, method, path, body, headers, timeout=5)
    except OSError:
        return 0, None
    return status, json.loads(data) if data else None


def wait_for(predicate, what: str, timeout: float = 5.0, step: float = 0.005) -> float:
    """Seconds until ``predicate()`` held (AssertionError after ``timeout``)."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(step)
    return time.monotonic() - started


def host_status(gateway, kid: str) -> str | None:
    status, body = admin(gateway, "GET", f"/admin/keys/{kid}", token=VIEWER)
    return (body.get("on_this_host") or {}).get("status") if status == 200 else None


def test_the_admin_api_manages_a_key_from_creation_to_revocation(gateway_factory, providers):
    gateway = keys_gateway(gateway_factory, providers)
    status, created = admin(gateway, "POST", "/admin/keys", {
        "tenant": "team-a", "alias": "ci", "models": ["gpt-*"], "metadata": {"owner": "alice"},
        "limits": {"requests": [{"window": "1m", "count": 60}]}, "expires_at": "2099-01-01T00:00:00Z"})
    assert status == 201 and KEY_PATTERN.fullmatch(created["key"])
    record = created["record"]
    kid = record["kid"]
    assert created["key"].startswith(f"gg-{kid}-")
    assert (record["tenant"], record["alias"], record["status"], record["created_by"]) == ("team-a", "ci", "active", "ops")
    assert record["limits"]["requests"] == [{"window": "1m", "count": 60, "burst": None, "shadow": False}]
    wait_for(lambda: host_status(gateway, kid) == "active", "the host table to hold the key")

    status, page = admin(gateway, "GET", "/admin/keys?tenant=team-a&alias=ci", token=VIEWER)
    assert status == 200 and [r["kid"] for r in page["data"]] == [kid] and page["next_cursor"] is None
    status, patched = admin(gateway, "PATCH", f"/admin/keys/{kid}", {"models": ["claude-*"], "alias": None})
    assert status == 200 and patched["models"] == ["claude-*"] and patched["alias"] is None
    assert admin(gateway, "POST", f"/admin/keys/{kid}/block")[1]["status"] == "blocked"
    wait_for(lambda: host_status(gateway, kid) == "blocked", "the block to reach the table")
    assert admin(gateway, "POST", f"/admin/keys/{kid}/unblock")[1]["status"] == "active"
    status, rotated = admin(gateway, "POST", f"/admin/keys/{kid}/rotate", {"grace": "24h"})
    assert status == 200 and rotated["key"] != created["key"] and rotated["key"].startswith(f"gg-{kid}-")
    assert len(rotated["record"]["previous_secrets_valid_until"]) == 1
    wait_for(lambda: admin(gateway, "GET", f"/admin/keys/{kid}")[1]["on_this_host"]["secrets"] == 2,
             "both secrets in the table")
    assert admin(gateway, "POST", f"/admin/keys/{kid}/revoke")[1]["status"] == "revoked"
    status, body = admin(gateway, "POST", f"/admin/keys/{kid}/unblock")
    assert (status, body["error"]["code"]) == (409, "conflict")  # revoking is final

    status, audit = admin(gateway, "GET", "/admin/audit", token=VIEWER)
    assert status == 200
    assert [(e["action"], e["actor"]) for e in audit["data"]] == [
        ("create", "ops"), ("update", "ops"), ("block", "ops"), ("unblock", "ops"), ("rotate", "ops"),
        ("revoke", "ops")]
    assert audit["data"][1]["changed"] == {"alias": None, "models": ["claude-*"]}
    status, later = admin(gateway, "GET", f"/admin/audit?since={audit['data'][3]['id']}", token=VIEWER)
    assert [e["action"] for e in later["data"]] == ["rotate", "revoke"]

    # The keys and their digests appear nowhere but in the two answers that made them.
    everything = json.dumps([page, patched, audit]) + gateway.log()
    everything += request("127.0.0.1", gateway.admin_port, "GET", "/metrics")[2].decode()
    for key in (created["key"], rotated["key"]):
        assert key not in everything and key_digest(key).hex() not in everything


def test_bad_admin_input_gets_a_clear_answer(gateway_factory, providers):
    gateway = keys_gateway(gateway_factory, providers)
    cases = [
        ("POST", "/admin/keys", {"tenant": "team a"}, 400, "tenant: must be 1..64 characters"),
        ("POST", "/admin/keys", {"tenant": "t", "metadata": {f"k{i}": "v" for i in range(17)}}, 400,
         "metadata: at most 16 pairs"),
        ("POST", "/admin/keys", {"tenant": "t", "limits": {"budgets": [{"window": "1h", "tokens": "many"}]}}, 400,
         "limits.budgets[0].tokens: expected an integer"),
        ("POST", "/admin/keys", b"{\"tenant\": ", 400, "body: malformed JSON"),
        ("POST", "/admin/keys", {"tenant": "t", "expires_at": "2001-01-01T00:00:00Z"}, 400, "expires_at: is in the past"),
        ("GET", "/admin/keys/AAAAAAAAAAAA", None, 404, "no key with kid AAAAAAAAAAAA"),
        ("POST", "/admin/keys/AAAAAAAAAAAA/revoke", None, 404, "no key with kid AAAAAAAAAAAA"),
        ("GET", "/admin/keys?limit=0", None, 400, "limit: must be an integer 1..1000"),
        ("GET", "/admin/keys?colour=red", None, 400, "colour: unknown query parameter"),
        ("GET", "/admin/audit?since=yesterday", None, 400, "since: must be an audit entry id"),
        ("PATCH", "/admin/keys/AAAAAAAAAAAA", {"tenant": "other"}, 400, "tenant: unknown key"),
    ]
    for method, path, body, status, message in cases:
        got, answer = admin(gateway, method, path, body)
        assert (got, answer["error"]["message"][:len(message)]) == (status, message), (method, path, answer)
    # A key pasted into the wrong place is never echoed back.
    _, created = admin(gateway, "POST", "/admin/keys", {"tenant": "team-a"})
    key, kid = created["key"], created["record"]["kid"]
    for method, path, body in (("PATCH", f"/admin/keys/{kid}", {"limits": key}), ("GET", f"/admin/keys/{key}", None),
                               ("POST", "/admin/keys", {"tenant": "t", "metadata": key})):
        status, answer = admin(gateway, method, path, body)
        assert status in (400, 404) and key[16:] not in json.dumps(answer), answer
    assert admin(gateway, "GET", "/admin/keys", token=None)[0] == 401
    assert admin(gateway, "POST", "/admin/keys", {"tenant": "t"}, token=VIEWER)[0] == 403
    for _ in range(10):
        assert admin(gateway, "GET", "/admin/keys", token="not-a-token")[0] == 401
    status, body = admin(gateway, "GET", "/admin/keys", token="not-a-token")
    assert (status, body["error"]["code"]) == (429, "too_many_failed_tokens")
    assert request("127.0.0.1", gateway.admin_port, "GET", "/healthz")[0] == 200  # probes stay open


def test_a_revocation_on_one_gateway_reaches_another_within_a_second(gateway_factory, providers, keys_store):
    url = keys_store.url
    first = keys_gateway(gateway_factory, providers, url)
    second = keys_gateway(gateway_factory, providers, url)
    deny = valkey.Valkey.from_url(url)
    try:
        for _ in range(10):
            status, created = admin(first, "POST", "/admin/keys", {"tenant": "team-a"})
            kid = created["record"]["kid"]
            wait_for(lambda kid=kid: host_status(second, kid) == "active", "the new key on the second host", 1.0)
            status, _ = admin(first, "POST", f"/admin/keys/{kid}/revoke")
            assert status == 200 and deny.hget(deny_set_key("team-a"), kid) == b"revoked"  # admission refuses it now
            wait_for(lambda kid=kid: host_status(second, kid) == "revoked", "the revocation on the second host", 1.0)
    finally:
        deny.close()
    assert metric_value(second.admin_port, "gridgate_keys_table_entries") == 10


def test_a_store_that_goes_away_keeps_the_table_and_loses_nothing(gateway_factory, providers, keys_store):
    gateway = keys_gateway(gateway_factory, providers, keys_store.url)
    created = [admin(gateway, "POST", "/admin/keys", {"tenant": "team-a"})[1]["record"]["kid"] for _ in range(3)]
    wait_for(lambda: metric_value(gateway.admin_port, "gridgate_keys_table_entries") == 3, "three keys in the table")
    keys_store.stop()
    status, body = admin(gateway, "POST", f"/admin/keys/{created[0]}/block")
    assert (status, body["error"]["code"]) == (503, "key_store_unavailable")
    assert admin(gateway, "GET", "/admin/keys")[0] == 503
    wait_for(lambda: metric_value(gateway.admin_port, "gridgate_keys_store_connected") == 0, "the follower to notice")
    assert metric_value(gateway.admin_port, "gridgate_keys_table_entries") == 3  # known keys keep their state
    keys_store.start()  # the same data directory: the records come back from its append-only file
    wait_for(lambda: admin(gateway, "POST", f"/admin/keys/{created[0]}/block")[0] == 200, "the store back", 10)
    wait_for(lambda: host_status(gateway, created[0]) == "blocked", "the block after the outage", 5)
    assert all(host_status(gateway, kid) == "active" for kid in created[1:])
    assert "key store is unreachable" in gateway.log()


def test_managed_keys_use_the_quota_valkey_when_there_is_a_quota_block(gateway_factory, providers, keys_store):
    handle = providers["provider-a"]
    gateway = gateway_factory({"provider-a": [handle.address]}, envelope([candidate("m", "provider-a")]), extra={
        "auth": {}, "admin": {"tokens": TOKENS},
        "quota": {"backend": {"kind": "valkey", "url": keys_store.url},
                  "rules": [{"name": "r", "budgets": [{"window": "1m", "tokens": 1000}]}]}})
    status, created = admin(gateway, "POST", "/admin/keys", {"tenant": "team-q"})
    assert status == 201
    direct = valkey.Valkey.from_url(keys_store.url)
    try:
        assert direct.exists(f"gg:keys:v1:{{gg-keys}}:rec:{created['record']['kid']}")
    finally:
        direct.close()


def test_without_tokens_the_key_endpoints_answer_403(gateway_factory, providers):
    handle = providers["provider-a"]
    gateway = gateway_factory({"provider-a": [handle.address]}, envelope([candidate("m", "provider-a")]),
                              extra={"auth": {"store": {"kind": "embedded"}}})
    status, body = admin(gateway, "POST", "/admin/keys", {"tenant": "t"}, token=None)
    assert (status, body["error"]["code"]) == (403, "admin_tokens_not_configured")
    assert admin(gateway, "GET", "/admin/endpoints", token=None)[0] == 200


def cli(gateway, *args: str, token: str | None = OPS) -> subprocess.CompletedProcess:
    env = {**os.environ, "GRIDGATE_ADMIN_TOKEN": token or ""}
    return subprocess.run([sys.executable, "-m", "gateway", "keys", *args, "-c", gateway.config_path],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)


def test_the_cli_drives_the_admin_api(gateway_factory, providers):
    gateway = keys_gateway(gateway_factory, providers)
    made = cli(gateway, "create", "--tenant", "team-c", "--alias", "batch", "--models", "gpt-*", "claude-*",
               "--rpm", "30", "--expires", "30d", "--metadata", "owner=bob", "--json")
    assert made.returncode == 0, made.stderr
    answer = json.loads(made.stdout)
    kid = answer["record"]["kid"]
    assert KEY_PATTERN.fullmatch(answer["key"]) and answer["record"]["models"] == ["gpt-*", "claude-*"]
    assert answer["record"]["limits"]["requests"][0] == {"window": "1m", "count": 30, "burst": None, "shadow": False}
    assert answer["record"]["metadata"] == {"owner": "bob"} and answer["record"]["expires_at"] is not None

    human = cli(gateway, "create", "--tenant", "team-c")
    assert human.returncode == 0 and human.stdout.startswith("key: gg-") and "shown this once" in human.stdout
    listing = cli(gateway, "list", "--tenant", "team-c")
    lines = listing.stdout.splitlines()
    assert listing.returncode == 0 and lines[0].split()[:4] == ["KID", "TENANT", "ALIAS", "STATUS"]
    assert len(lines) == 3 and any(line.startswith(kid) and "batch" in line for line in lines)
    assert "gg-" not in listing.stdout  # no secret in a listing
    assert cli(gateway, "block", kid).returncode == 0
    shown = cli(gateway, "show", kid)
    assert "status:" in shown.stdout and "blocked" in shown.stdout
    rotated = cli(gateway, "rotate", kid, "--grace", "1h", "--json")
    assert json.loads(rotated.stdout)["key"].startswith(f"gg-{kid}-")
    assert cli(gateway, "revoke", kid).returncode == 0

    again = cli(gateway, "unblock", kid)
    assert again.returncode == 1 and again.stderr.strip().startswith("keys unblock: 409 conflict:")
    missing = cli(gateway, "show", "AAAAAAAAAAAA")
    assert missing.returncode == 1 and "404 key_not_found" in missing.stderr and "Traceback" not in missing.stderr
    no_token = cli(gateway, "list", token=None)
    assert no_token.returncode == 1 and "401" in no_token.stderr and "GRIDGATE_ADMIN_TOKEN" in no_token.stderr
    nowhere = subprocess.run([sys.executable, "-m", "gateway", "keys", "list", "--admin", "127.0.0.1:1"],
                             cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert nowhere.returncode == 1 and "cannot reach the admin API at 127.0.0.1:1" in nowhere.stderr
