"""A JWT bearer token and a client certificate on one kept-alive mTLS connection (docs/identity.md, "Which
credential wins"): a verified token identifies its request even on a certificate's connection, each request
by its own token; a request without one is the certificate's; a token that fails is 401 whatever the
certificate says; nothing of one request's identity is left to the next. A real gateway process, a stdlib
``ssl`` client presenting a certificate made in the test (tests/pki.py), tokens of a test IdP."""

from __future__ import annotations

import hashlib
import json
import os

import h11

from tests.integration.test_mtls import KEY, WORKLOAD, MtlsClient, access_lines, mtls_gateway, pki  # noqa: F401
from tests.jwt_idp import SigningKey, claims, jwks

ISS = "https://idp.example.com"


def _gateway(gateway_factory, providers, pki, mode: str, key: SigningKey, directory: str):  # noqa: F811
    key_file = os.path.join(directory, "jwks.json")
    with open(key_file, "wb") as handle:
        handle.write(jwks(key))
    issuer = {"name": "corp", "issuer": ISS, "audience": ["gridgate"], "jwks_file": key_file,
              "algorithms": ["ES256"], "tenant_claim": "org"}
    auth = {"keys": [{"tenant": "team-key", "key": "sha256:" + hashlib.sha256(KEY.encode()).hexdigest()}],
            "jwt": [issuer]}
    return mtls_gateway(gateway_factory, providers, pki, mode, extra={"auth": auth})


def _bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def _who(client: MtlsClient, headers: list[tuple[str, str]] = ()) -> dict:
    status, body = client.request("GET", "/v1/gridgate/key", headers=headers)
    assert status == 200, body
    answer = json.loads(body)
    return {name: answer[name] for name in ("source", "identity", "subject", "tenant")}


def test_each_request_on_a_certificates_connection_is_identified_by_its_own_token(gateway_factory, providers,
                                                                                  pki, tmp_path):  # noqa: F811
    key = SigningKey("ES256", "e1")
    gateway = _gateway(gateway_factory, providers, pki, "required", key, str(tmp_path))
    alice = key.sign(claims(ISS, org="acme", sub="alice"))
    bob = key.sign(claims(ISS, org="globex", sub="bob"))
    expired = key.sign(claims(ISS, org="acme", sub="alice", lifetime=-3600))
    client = MtlsClient(gateway.port, pki.ca.ca_file, pki.good)
    try:  # one connection, one certificate, the credentials changing request by request
        answers = [client.chat("jwt-alice", _bearer(alice)), client.chat("jwt-bob", _bearer(bob)),
                   client.chat("cert-after-jwt"), client.chat("jwt-alice-again", _bearer(alice))]
        assert [status for status, _ in answers] == [200, 200, 200, 200], answers
        status, body = client.chat("expired-jwt", _bearer(expired))  # a token that fails: 401, certificate or not
        assert status == 401, body
        error = json.loads(body)["error"]
        assert error["code"] == "invalid_token" and "(exp)" in error["message"] and expired not in body.decode()
        # Decided on the head, the refusal closes the connection (its body is never read: docs/security.md).
        assert client.conn.our_state is h11.MUST_CLOSE
    finally:
        client.close()
    client = MtlsClient(gateway.port, pki.ca.ca_file, pki.good)  # the same certificate, a new connection
    try:
        assert client.chat("cert-after-refusal")[0] == 200  # the certificate's, nothing of the token left
        assert client.chat("key-on-cert", _bearer(KEY))[0] == 200  # an API key the gateway knows wins too
        assert _who(client, _bearer(bob)) == {"source": "jwt", "identity": "jwt:corp", "subject": "bob",
                                              "tenant": "globex"}
        assert _who(client) == {"source": "mtls", "identity": "mtls", "subject": WORKLOAD, "tenant": "team-mesh"}
    finally:
        client.close()

    lines = access_lines(gateway, 9)
    seen = {rid: (line["status"], line.get("tenant"), line.get("identity"), line.get("subject"))
            for rid, line in lines.items() if line["path"] != "/v1/gridgate/key" or rid == "expired-jwt"}
    assert seen == {
        "jwt-alice": (200, "acme", "jwt:corp", "alice"),
        "jwt-bob": (200, "globex", "jwt:corp", "bob"),
        "cert-after-jwt": (200, "team-mesh", "mtls", WORKLOAD),
        "jwt-alice-again": (200, "acme", "jwt:corp", "alice"),
        "expired-jwt": (401, None, None, None),
        "cert-after-refusal": (200, "team-mesh", "mtls", WORKLOAD),
        "key-on-cert": (200, "team-key", None, None),
    }
    assert "Traceback" not in gateway.log()


def test_a_certificate_only_request_then_a_token_on_one_connection_in_optional_mode(gateway_factory, providers,
                                                                                    pki, tmp_path):  # noqa: F811
    key = SigningKey("ES256", "e1")
    gateway = _gateway(gateway_factory, providers, pki, "optional", key, str(tmp_path))
    token = key.sign(claims(ISS, org="acme", sub="carol"))
    client = MtlsClient(gateway.port, pki.ca.ca_file, pki.good)
    try:
        assert _who(client)["identity"] == "mtls"  # the certificate first: its tenant looked up on this request
        assert _who(client, _bearer(token)) == {"source": "jwt", "identity": "jwt:corp", "subject": "carol",
                                                "tenant": "acme"}
        assert _who(client)["subject"] == WORKLOAD
    finally:
        client.close()
    # Without a certificate (optional mode) the token alone identifies; without either, 401.
    bare = MtlsClient(gateway.port, pki.ca.ca_file, None)
    try:
        assert _who(bare, _bearer(token))["subject"] == "carol"
        status, body = bare.chat("nothing")
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key", body
    finally:
        bare.close()
