"""The spend report by JWT subject (``GET /admin/spend?group_by=subject``, ``gridgate spend --group-by
subject``; docs/identity.md "Claim mapping", docs/keys.md "Spend reports"), after real requests of two
subjects of one tenant and an API key of that tenant whose alias is one subject's name, through a real
gateway, a real mock provider and a real bundled Valkey."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

from tests.harness import ROOT, candidate, chat, envelope
from tests.integration.test_access_log import wait_lines
from tests.integration.test_spend_reports import PRICES, SPEND, TOKENS, spend, wait_spend
from tests.jwt_idp import SigningKey, claims, jwks

ISS = "https://idp.example.com"
API_KEY = "sk-acme-alice"


def _gateway(gateway_factory, provider, key: SigningKey, store_url: str):
    issuer = {"name": "corp", "issuer": ISS, "audience": ["gridgate"], "jwks_file": "jwks.json",
              "algorithms": ["ES256"], "tenant_claim": "org"}
    api_key = {"tenant": "acme", "key": "sha256:" + hashlib.sha256(API_KEY.encode()).hexdigest(), "alias": "alice"}
    gateway = gateway_factory({"p": [provider.address]}, envelope([candidate("m", "p")]), start=False, extra={
        "auth": {"jwt": [issuer], "keys": [api_key]},
        "admin": {"tokens": TOKENS},
        "quota": {"backend": {"kind": "valkey", "url": store_url},
                  "rules": [{"name": "all", "budgets": [{"window": "1h", "tokens": 10_000_000}]}]},
        "pricing": {"overrides": {"m": PRICES}},
        "access_log": {"path": "access.log"},
    })
    with open(os.path.join(gateway.directory, "jwks.json"), "wb") as handle:
        handle.write(jwks(key))
    return gateway.start()


def _ask(port: int, credential: str) -> None:
    response = chat(port, "m", headers=[("Authorization", f"Bearer {credential}"), ("X-Mock-Tokens", "12")],
                    messages=[{"role": "user", "content": "hello " * 20}])
    assert response.status == 200, response.body


def test_the_spend_report_groups_by_subject_apart_from_key_aliases(gateway_factory, mock_provider, keys_store):
    key = SigningKey("ES256", "e1")
    gateway = _gateway(gateway_factory, mock_provider("p"), key, keys_store.url)
    alice = key.sign(claims(ISS, org="acme", sub="alice"))
    bob = key.sign(claims(ISS, org="acme", sub="bob"))
    for credential in (alice, alice, bob, API_KEY):
        _ask(gateway.port, credential)
    lines = wait_lines(os.path.join(gateway.directory, "access.log"), 4, timeout=10.0)
    cost = {who: sum(line["cost_nusd"] for line in lines if (line.get("subject") or "key") == who)
            for who in ("alice", "bob", "key")}
    assert all(cost.values()), cost

    by_subject = wait_spend(gateway, "?group_by=subject", 4)
    assert by_subject["group_by"] == "subject"
    assert [(row["subject"], row["identity"], row["requests"], row["cost_nusd"]) for row in by_subject["data"]] == [
        ("-", None, 1, cost["key"]),  # the API key aliased alice is no subject
        ("alice", "jwt:corp", 2, cost["alice"]),
        ("bob", "jwt:corp", 1, cost["bob"]),
    ]
    assert by_subject["totals"]["requests"] == 4
    # group_by=key still names a subject as the key (merged with the alias of the same name), and kid= filters it.
    _, by_key = spend(gateway, "?group_by=key&tenant=acme")
    assert [(row["key"], row["requests"]) for row in by_key["data"]] == [("alice", 3), ("bob", 1)]
    _, only_bob = spend(gateway, "?group_by=subject&kid=bob")
    assert [(row["subject"], row["requests"]) for row in only_bob["data"]] == [("bob", 1)]
    _, by_tenant = spend(gateway, "?group_by=tenant")
    assert [(row["tenant"], row["requests"]) for row in by_tenant["data"]] == [("acme", 4)]

    env = {**os.environ, "GRIDGATE_ADMIN_TOKEN": SPEND}
    command = [sys.executable, "-m", "gateway", "spend", "-c", gateway.config_path, "--group-by", "subject"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=30, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    title, header, *rows, rule, total = done.stdout.splitlines()
    assert title.endswith("by subject")
    assert header.split()[:3] == ["subject", "identity", "requests"]
    assert [row.split()[:3] for row in rows] == [["-", "-", "1"], ["alice", "jwt:corp", "2"], ["bob", "jwt:corp", "1"]]
    assert total.split()[:2] == ["total", "4"]
    assert len({len(line) for line in (header, *rows, total)}) == 1  # aligned
