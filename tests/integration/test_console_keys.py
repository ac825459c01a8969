"""The console's keys, spend and requests pages over a real gateway with managed keys (no browser): a
key made on the page works on the data plane, a revoke refuses it, spend and the request's route
evidence appear, every change is audited under the token's name, and scopes hide what they must."""

from __future__ import annotations

import json
import os
import re
import time

from tests.harness import candidate, envelope, wait_until
from tests.integration.test_console_security import OPS, TOKENS, VIEWER, Session, call, sign_in

PRICES = {"m": {"input": 1000, "output": 2000}}  # USD per million tokens: the mock's usage costs cents


def keys_gateway(gateway_factory, providers, **extra):
    names = ("provider-a", "provider-b", "provider-c")
    return gateway_factory({name: [providers[name].address] for name in names},
                           envelope([candidate("m", name, 0) for name in names]),
                           extra={"admin": {"tokens": TOKENS}, "auth": {}, "pricing": {"overrides": PRICES},
                                  "quota": {"backend": {"kind": "embedded"}, "rules": [  # metered: priced, counted
                                      {"name": "team-a", "match": {"tenant": "team-a"},
                                       "budgets": [{"window": "1h", "tokens": 1000000}]}]}, **extra})


def chat(gateway, key: str) -> int:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "a prompt never shown"}]})
    return call(gateway.port, "POST", "/v1/chat/completions", body,
                {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}).status


def test_a_key_made_on_the_page_serves_shows_its_spend_and_requests_and_a_revoke_refuses_it(gateway_factory, providers):
    gateway = keys_gateway(gateway_factory, providers)
    ops = Session(gateway.admin_port, OPS)
    created = ops.post("/console/keys/create", {"tenant": "team-a", "alias": "ci", "models": "m", "rpm": "600"})
    assert created.status == 200, created.body
    page = created.body.decode()
    key = re.search(r'<code id="new-key">([^<]+)</code>', page).group(1)
    kid = key.split("-")[1]
    assert "shown this once" in page
    assert key not in ops.get("/console/keys").body.decode()  # never again
    wait_until(lambda: chat(gateway, key) == 200, "the new key to serve", 10)
    for _ in range(4):
        assert chat(gateway, key) == 200

    def keys_view():
        return ops.get("/console/api/keys").json()["view"]

    (tenant,) = keys_view()["tenants"]
    assert tenant["name"] == "team-a" and [k["kid"] for k in tenant["key_rows"]] == [kid]
    assert tenant["key_rows"][0]["status"] == "active" and tenant["key_rows"][0]["limits"] == "600 req / 1m"
    spent = wait_until(lambda: (v := keys_view())["spend"] and v["spend"]["requests"] >= 5 and v, "spend to appear", 10)
    assert spent["spend"]["total"] != "$0" and spent["tenants"][0]["spend"]["requests"] >= 5
    assert '<rect class="bar"' in ops.get("/console/keys").body.decode()
    (budget,) = spent["tenants"][0]["budgets"]
    assert (budget["owner"], budget["what"], budget["limit"]) == ("rule team-a", "tokens / 3600 s", 1000000)
    assert 0 < budget["remaining"] < 1000000
    (left,) = spent["tenants"][0]["key_rows"][0]["left"]  # the key's own limit, what is left of it now
    assert (left["owner"], left["what"], left["limit"]) == (f"key {kid}", "requests / 60 s", 600)
    assert 590 <= left["remaining"] <= 600  # five requests taken, their slots coming back at 10/s
    assert re.search(r'<span class="limit-left" data-what="requests / 60 s">\d+ of 600 requests / 60 s, full in',
                     ops.get("/console/keys").body.decode())

    requests = wait_until(lambda: [r for r in ops.get("/console/api/requests").json()["view"]["requests"]
                                   if r["tenant"] == "team-a"], "the requests to be reported", 5)
    newest = requests[0]
    assert (newest["model"], newest["status"], newest["group"], newest["attempts"]) == ("m", 200, 0, 1)
    assert newest["provider"] in ("provider-a", "provider-b", "provider-c") and newest["cost"].startswith("$")
    assert newest["tokens_prompt"] and newest["latency_ms"] > 0
    requests_page = ops.get("/console/requests").body.decode()
    assert "a prompt never shown" not in requests_page and key not in requests_page

    revoked = ops.post(f"/console/keys/{kid}/revoke")
    assert revoked.status == 303 and revoked.headers["location"] == "/console/keys"
    wait_until(lambda: chat(gateway, key) == 401, "the revoked key to be refused", 5)
    assert keys_view()["tenants"][0]["key_rows"][0]["status"] == "revoked"
    audit = call(gateway.admin_port, "GET", "/admin/audit", headers={"Authorization": f"Bearer {OPS}"}).json()
    assert [(e["action"], e["actor"]) for e in audit["data"] if e["kid"] == kid] == [("create", "ops"), ("revoke", "ops")]


def test_a_token_without_the_write_scope_sees_no_forms_and_cannot_change_a_key(gateway_factory, providers):
    gateway = keys_gateway(gateway_factory, providers)
    viewer = Session(gateway.admin_port, VIEWER)  # no scopes at all
    page = viewer.get("/console/keys").body.decode()
    assert 'id="create-key"' not in page and "keys:read" in page
    refused = viewer.post("/console/keys/create", {"tenant": "team-a"})
    assert refused.status == 403 and b"lacks the scope keys:write" in refused.body
    refused = viewer.post("/console/keys/AbCdEfGhIjKl/revoke")
    assert refused.status == 403
    assert viewer.post("/console/keys/AbCdEfGhIjKl/explode").status == 404
    audit = call(gateway.admin_port, "GET", "/admin/audit", headers={"Authorization": f"Bearer {OPS}"}).json()
    assert [e["action"] for e in audit["data"]] == ["console_sign_in"]  # the viewer's sign-in; no change


def test_sign_ins_failed_sign_ins_and_sign_outs_are_in_the_audit_log(gateway_factory, providers):
    gateway = keys_gateway(gateway_factory, providers)
    assert sign_in(gateway.admin_port, "not-a-token").status == 401
    viewer = Session(gateway.admin_port, VIEWER)
    assert viewer.post("/console/logout").status == 303
    audit = call(gateway.admin_port, "GET", "/admin/audit", headers={"Authorization": f"Bearer {OPS}"}).json()
    signs = [(e["action"], e["actor"], e["kid"], e["changed"]) for e in audit["data"]
             if e["action"].startswith("console_")]
    assert signs == [("console_sign_in_failed", "", "", {"address": "127.0.0.1"}),
                     ("console_sign_in", "viewer", "", {"address": "127.0.0.1"}),
                     ("console_sign_out", "viewer", "", {"address": "127.0.0.1"})]
    assert "not-a-token" not in json.dumps(audit) and VIEWER not in json.dumps(audit)
    # the hosts follow the same stream: a key made after these entries still serves (no gap, no reload)
    status, made = 0, call(gateway.admin_port, "POST", "/admin/keys", json.dumps({"tenant": "team-a"}),
                           {"Authorization": f"Bearer {OPS}", "Content-Type": "application/json"})
    assert made.status == 201, made.body
    status = wait_until(lambda: chat(gateway, made.json()["key"]) == 200, "the key made after the sign-ins", 10)
    assert status


def test_a_rotation_with_a_grace_keeps_the_old_secret_working_until_it_ends(gateway_factory, providers):
    gateway = keys_gateway(gateway_factory, providers, access_log={"enabled": True, "path": "access.log"})
    ops = Session(gateway.admin_port, OPS)
    created = ops.post("/console/keys/create", {"tenant": "team-a"})
    old = re.search(r'<code id="new-key">([^<]+)</code>', created.body.decode()).group(1)
    kid = old.split("-")[1]
    wait_until(lambda: chat(gateway, old) == 200, "the new key to serve", 10)
    assert 'name="grace" value="0s"' in ops.get("/console/keys").body.decode()  # the page offers a grace
    assert ops.post(f"/console/keys/{kid}/rotate", {"grace": "lots"}).status == 400  # the API's check
    rotated = ops.post(f"/console/keys/{kid}/rotate", {"grace": "3s"})
    assert rotated.status == 200, rotated.body
    new = re.search(r'<code id="new-key">([^<]+)</code>', rotated.body.decode()).group(1)
    assert new != old and new.startswith(f"gg-{kid}-")
    rotated_at = time.monotonic()
    wait_until(lambda: chat(gateway, new) == 200, "the new secret to serve", 5)
    assert chat(gateway, old) == 200  # inside the grace, both open the key
    assert time.monotonic() - rotated_at < 3, "the machine was too slow to check inside the grace"
    wait_until(lambda: chat(gateway, old) == 401, "the old secret to be refused after its grace", 6)
    assert time.monotonic() - rotated_at >= 2.9
    assert chat(gateway, new) == 200

    def lines() -> list[dict]:
        with open(os.path.join(gateway.directory, "access.log")) as handle:
            return [json.loads(line) for line in handle if line.strip()]

    served = wait_until(lambda: (found := [line for line in lines() if line["status"] == 200]) and
                        len(found) >= 5 and found, "the access lines", 5)
    # the current secret's lines have no mark, the previous one's inside its grace say previous_secret
    # (workers write their lines on their own, so the file is not in request order)
    marks = [line.get("identity") for line in served]
    assert set(marks) == {None, "previous_secret"}, marks
    assert not any(secret in json.dumps(lines()) for secret in (old, new, old.split("-")[2], new.split("-")[2]))
    revoked = ops.post(f"/console/keys/{kid}/revoke")
    assert revoked.status == 303
    wait_until(lambda: chat(gateway, new) == 401, "the revoked key to be refused", 5)
