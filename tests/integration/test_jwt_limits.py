"""A JWT subject's own limits from its token's claims (``limits_from_claims``, docs/identity.md "Limits from
claims") through a real gateway, a real mock provider and the bundled Valkey: they are key-level limits
like an API key's (the same 429 and limit headers), counted per subject, and a claim the gateway cannot
use leaves the configured limits in force (counted), never a 500."""

from __future__ import annotations

import json
import os
import uuid

from tests.harness import Client, candidate, chat, envelope, metric_value, mock_served, wait_until
from tests.jwt_idp import SigningKey, claims, jwks

ISS = "https://idp.example.com"


def _bearer(token: str) -> list[tuple[str, str]]:
    return [("Authorization", f"Bearer {token}")]


def _gateway(gateway_factory, provider, key: SigningKey, valkey_url: str, tenant: str):
    issuer = {"name": "corp", "issuer": ISS, "audience": ["gridgate"], "jwks_file": "jwks.json",
              "algorithms": ["ES256"], "tenant_claim": "org",
              "limits": {"requests": [{"window": "1m", "count": 5}]},  # every subject's, unless its claim says
              "limits_from_claims": {"requests_per_minute": "gridgate.rpm", "tokens_per_minute": "gridgate.tpm"}}
    quota = {"backend": {"kind": "valkey", "url": valkey_url}, "reservation_timeout": "10s", "lease": None,
             "rules": [{"name": f"r-{tenant}", "match": {"tenant": tenant}, "requests": [{"window": "1m", "count": 100}]}]}
    gateway = gateway_factory({"p": [provider.address]}, envelope([candidate("m", "p")]), start=False, workers=2,
                              extra={"auth": {"jwt": [issuer]}, "quota": quota})
    with open(os.path.join(gateway.directory, "jwks.json"), "wb") as handle:
        handle.write(jwks(key))
    return gateway.start()


def test_a_subject_limited_by_its_claim_gets_429_and_its_tenant_peer_does_not(gateway_factory, mock_provider,
                                                                              valkey_url):
    key = SigningKey("ES256", "e1")
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    provider = mock_provider("p")
    gateway = _gateway(gateway_factory, provider, key, valkey_url, tenant)
    small = key.sign(claims(ISS, org=tenant, sub="batch-job", gridgate={"rpm": 2, "tpm": 5000}))
    large = key.sign(claims(ISS, org=tenant, sub="assistant", gridgate={"rpm": 50}))
    served = mock_served(provider)
    first = chat(gateway.port, "m", headers=_bearer(small), max_tokens=10)
    assert first.status == 200
    assert (first.headers["x-ratelimit-limit-requests"], first.headers["x-ratelimit-remaining-requests"]) == ("2", "1")
    assert first.headers["x-ratelimit-limit-tokens"] == "5000"  # the claim's token budget
    assert chat(gateway.port, "m", headers=_bearer(small), max_tokens=10).status == 200
    refused = chat(gateway.port, "m", headers=_bearer(small), max_tokens=10)
    assert refused.status == 429
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert "key requests 2/1m" in refused.json()["error"]["message"]
    assert 1 <= int(refused.headers["retry-after"]) <= 30  # a slot every 30 s
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    # The other subject of the same tenant has its own (claimed) 50 a minute: ten requests, no 429.
    statuses = [chat(gateway.port, "m", headers=_bearer(large)).status for _ in range(10)]
    assert statuses == [200] * 10, statuses
    assert mock_served(provider) - served == 12
    client = Client(gateway.port)
    try:
        me = json.loads(client.request("GET", "/v1/gridgate/key", None, _bearer(small)).body)
    finally:
        client.close()
    assert me["limits"]["requests"][0] | {"burst": None} == {"window": "1m", "count": 2, "burst": None, "shadow": False}
    assert me["limits"]["budgets"][0]["tokens"] == 5000


def test_an_unusable_limit_claim_keeps_the_configured_limits_and_is_counted(gateway_factory, mock_provider,
                                                                            valkey_url):
    key = SigningKey("ES256", "e1")
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    gateway = _gateway(gateway_factory, mock_provider("p"), key, valkey_url, tenant)
    bad = [{"rpm": "lots"}, {"rpm": 0}, {"rpm": -3}, {"rpm": 10**12}, {"rpm": True}, {"rpm": [7]}]
    for index, value in enumerate(bad):  # each its own subject: the configured 5 a minute applies to each
        token = key.sign(claims(ISS, org=tenant, sub=f"svc-{index}", gridgate=value))
        answers = [chat(gateway.port, "m", headers=_bearer(token)) for _ in range(6)]
        assert [a.status for a in answers] == [200] * 5 + [429], (value, [a.status for a in answers])
        assert answers[0].headers["x-ratelimit-limit-requests"] == "5"
        assert "key requests 5/1m" in answers[-1].json()["error"]["message"]
    digits = key.sign(claims(ISS, org=tenant, sub="svc-digits", gridgate={"rpm": "1"}))  # a string of digits is read
    assert [chat(gateway.port, "m", headers=_bearer(digits)).status for _ in range(2)] == [200, 429]
    # Counted once per verified token (each token is verified once per worker: at most twice here).
    wait_until(lambda: metric_value(gateway.admin_port, "gridgate_jwt_limit_claims_ignored_total") >= len(bad),
               "the unusable claims counted")
    assert metric_value(gateway.admin_port, "gridgate_jwt_limit_claims_ignored_total") <= 2 * len(bad)
    wait_until(lambda: "claim 'gridgate.rpm' is not a whole number" in gateway.log(), "the claim logged")
    assert gateway.log().count("claim 'gridgate.rpm' is not a whole number") <= 2  # once per worker
