"""JWT bearer tokens through a real gateway and real mock providers (docs/identity.md): a good token is
served at the provider of its model, every bad token is 401 ``invalid_token`` naming its check before
anything reaches a provider, and API keys keep working beside tokens."""

from __future__ import annotations

import json
import os
import time

from gateway.identity.auth import hash_api_key
from tests.harness import Client, candidate, chat, envelope, mock_served, raw_exchange, status_of, wait_until
from tests.jwt_idp import SigningKey, claims, hmac_with_public_key, jwks, unsigned_token

ISS = "https://idp.example.com"


def _bearer(token: str) -> list[tuple[str, str]]:
    return [("Authorization", f"Bearer {token}")]


def _issuer(**overrides: object) -> dict[str, object]:
    return {"name": "corp", "issuer": ISS, "audience": ["gridgate"], "jwks_file": "jwks.json",
            "algorithms": ["RS256", "ES256"], "tenant_claim": "org", "models_claim": "models", **overrides}


def _gateway(gateway_factory, mock_provider, key: SigningKey, **issuer: object):
    p, q = mock_provider("p"), mock_provider("q")
    gateway = gateway_factory({"p": [p.address], "q": [q.address]},
                              envelope([candidate("m", "p"), candidate("n", "q")]), start=False,
                              extra={"auth": {"keys": [{"tenant": "keyed", "key": hash_api_key("sk-plain")}],
                                              "jwt": [_issuer(**issuer)]},
                                     "access_log": {"enabled": True, "path": "access.log"}})
    with open(os.path.join(gateway.directory, "jwks.json"), "wb") as handle:
        handle.write(jwks(key))
    return gateway.start(), p, q


def test_good_tokens_are_served_at_their_models_provider_and_bad_ones_are_401(gateway_factory, mock_provider):
    rsa = SigningKey("RS256", "k1")
    gateway, p, q = _gateway(gateway_factory, mock_provider, rsa)
    token = rsa.sign(claims(ISS, models=["m", "n"]))
    before = (mock_served(p), mock_served(q))
    assert chat(gateway.port, "m", headers=_bearer(token)).status == 200
    assert chat(gateway.port, "n", headers=_bearer(token)).status == 200
    assert (mock_served(p), mock_served(q)) == (before[0] + 1, before[1] + 1)
    # API keys still work beside tokens; an unknown key is still invalid_api_key.
    assert chat(gateway.port, "m", headers=_bearer("sk-plain")).status == 200
    assert chat(gateway.port, "m", headers=_bearer("sk-other")).json()["error"]["code"] == "invalid_api_key"

    now = int(time.time())
    bad = {
        "alg": unsigned_token({"alg": "none", "kid": "k1"}, claims(ISS)),
        "alg ": hmac_with_public_key(rsa, claims(ISS)),
        "kid": SigningKey("RS256", "k9").sign(claims(ISS)),
        "signature": SigningKey("RS256", "k1").sign(claims(ISS)),
        "iss": rsa.sign(claims("https://other.example.com")),
        "aud": rsa.sign(claims(ISS, aud="not-us")),
        "exp": rsa.sign(claims(ISS, exp=now - 120)),
        "nbf": rsa.sign(claims(ISS, nbf=now + 120)),
        "tenant_claim": rsa.sign(claims(ISS, org=None)),
        "size": rsa.sign(claims(ISS, padding="x" * 9000)),
    }
    served = mock_served(p)
    for check, bad_token in bad.items():
        client = Client(gateway.port)
        try:
            answer = client.request("POST", "/v1/chat/completions", {"model": "m", "messages": []},
                                    _bearer(bad_token) if check != "size" else [("X-Api-Key", bad_token)])
        finally:
            client.close()
        if check == "size" and answer.status == 431:
            continue  # the head's own bound may refuse the header first: never served either way
        error = answer.json()["error"]
        assert answer.status == 401, (check, answer.status, answer.body)
        assert error["code"] == "invalid_token" and f"({check.strip()})" in error["message"], (check, error)
        assert bad_token[:30] not in answer.body.decode()
        assert 'error="invalid_token"' in answer.headers["www-authenticate"]
    assert mock_served(p) == served  # nothing refused reached a provider


def test_model_globs_from_claims_and_the_callers_own_identity(gateway_factory, mock_provider):
    ec = SigningKey("ES256", "e1")
    gateway, p, _ = _gateway(gateway_factory, mock_provider, ec, tenant_claim="realm.org", map={"ORG-7": "acme"})
    token = ec.sign(claims(ISS, sub="svc-42", realm={"org": "ORG-7"}, models="m"))
    assert chat(gateway.port, "m", headers=_bearer(token)).status == 200
    refused = chat(gateway.port, "n", headers=_bearer(token))
    assert refused.status == 403 and "svc-42" in refused.json()["error"]["message"]
    client = Client(gateway.port)
    try:
        me = client.request("GET", "/v1/gridgate/key", None, _bearer(token))
    finally:
        client.close()
    body = json.loads(me.body)
    assert (me.status, body["source"], body["identity"], body["subject"], body["tenant"]) == (
        200, "jwt", "jwt:corp", "svc-42", "acme")
    assert token not in me.body.decode()
    assert chat(gateway.port, "m", headers=_bearer("sk-plain")).status == 200

    def lines() -> list[dict]:
        with open(os.path.join(gateway.directory, "access.log")) as handle:
            return [json.loads(line) for line in handle if line.strip()]

    wait_until(lambda: os.path.exists(os.path.join(gateway.directory, "access.log")) and len(lines()) >= 4,
               "four access lines")
    seen = [(line["tenant"], line["status"], line.get("identity"), line.get("subject")) for line in lines()]
    assert seen[:2] == [("acme", 200, "jwt:corp", "svc-42"), ("acme", 403, "jwt:corp", "svc-42")], seen
    assert seen[-1] == ("keyed", 200, None, None), seen  # an API key's line names neither
    assert not any(token[:40] in line for line in open(os.path.join(gateway.directory, "access.log")))


def test_a_rewritten_key_file_is_followed_without_a_restart(gateway_factory, mock_provider):
    old, new = SigningKey("RS256", "k1"), SigningKey("RS256", "k2")
    gateway, _, _ = _gateway(gateway_factory, mock_provider, old)
    assert chat(gateway.port, "m", headers=_bearer(old.sign(claims(ISS, models=["m"])))).status == 200
    path = os.path.join(gateway.directory, "jwks.json")
    with open(path + ".tmp", "wb") as handle:
        handle.write(jwks(old, new))
    os.replace(path + ".tmp", path)
    fresh = new.sign(claims(ISS, models=["m"]))
    wait_until(lambda: chat(gateway.port, "m", headers=_bearer(fresh)).status == 200, "the new key is used")
    with open(path, "wb") as handle:
        handle.write(b"<html>garbage</html>")  # a broken file keeps the last good set
    time.sleep(0.6)
    assert chat(gateway.port, "m", headers=_bearer(fresh)).status == 200


def test_a_long_token_sent_whole_or_in_small_writes_is_served_and_a_bad_byte_is_refused(gateway_factory, mock_provider):
    # An RS256 token is long enough to be set aside before h11 (gateway/http/credential_line.py): the gateway
    # must read it whole however the head arrives, and still refuse what h11 or the strict checks refuse.
    rsa = SigningKey("RS256", "k1")
    gateway, p, _ = _gateway(gateway_factory, mock_provider, rsa)
    token = rsa.sign(claims(ISS, models=["m"])).encode()
    assert len(token) > 300

    def wire(value: bytes) -> bytes:
        return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nAuthorization: Bearer " + value
                + b"\r\nContent-Type: application/json\r\nContent-Length: 14\r\nConnection: close\r\n\r\n"
                b'{"model": "m"}')

    served = mock_served(p)
    for split in (None, 1, 7):
        raw = raw_exchange(gateway.port, wire(token), split=split, pause=0.0002)
        assert status_of(raw) == 200, (split, raw[:300])
    assert mock_served(p) == served + 3
    forged = token[:-5] + (b"A" if token[-5:-4] != b"A" else b"B") + token[-4:]
    middle = len(token) // 2
    for value, status in ((forged, 401), (token[:middle] + b"\x01" + token[middle:], 400),
                          (token[:middle] + b"\x00" + token[middle:], 400)):
        for split in (None, 7):
            raw = raw_exchange(gateway.port, wire(value), split=split, pause=0.0002)
            assert status_of(raw) == status, (status, split, raw[:300])
            assert token[:40] not in raw
    assert mock_served(p) == served + 3
