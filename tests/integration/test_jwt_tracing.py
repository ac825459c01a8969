"""Who a traced request is (docs/tracing.md, docs/identity.md): the request span of a JWT's request carries
its identity, kind, issuer and tenant, never its subject; an API key's request carries its tenant only;
the metrics label the tenant, never the subject. A real gateway, a real mock provider, a real OTLP/HTTP
receiver on loopback (tests/integration/test_tracing.py's)."""

from __future__ import annotations

import hashlib
import json
import os

from tests.harness import candidate, chat, envelope, request, wait_until
from tests.integration.test_tracing import attributes, receiver  # noqa: F401 - receiver is a fixture
from tests.jwt_idp import SigningKey, claims, jwks

ISS = "https://idp.example.com/realms/corp"
API_KEY = "sk-acme-batch"
SUBJECT = "svc-assistant@corp.example"


def _gateway(gateway_factory, provider, key: SigningKey, collector: str):
    issuer = {"name": "corp", "issuer": ISS, "audience": ["gridgate"], "jwks_file": "jwks.json",
              "algorithms": ["ES256"], "tenant_claim": "org"}
    api_key = {"tenant": "globex", "key": "sha256:" + hashlib.sha256(API_KEY.encode()).hexdigest(), "alias": "batch"}
    gateway = gateway_factory({"p": [provider.address]}, envelope([candidate("m", "p")]), start=False, extra={
        "auth": {"jwt": [issuer], "keys": [api_key]},
        "tracing": {"endpoint": collector, "sample": 1.0, "flush_interval": "50ms", "service_name": "gw-jwt"},
    })
    with open(os.path.join(gateway.directory, "jwks.json"), "wb") as handle:
        handle.write(jwks(key))
    return gateway.start()


def _server_span(receiver, request_id: str) -> dict:  # noqa: F811 - the fixture's value
    def found() -> dict | None:
        return next((s for s in receiver.spans if s["kind"] == 2
                     and attributes(s).get("gridgate.request_id") == request_id), None)
    wait_until(lambda: found() is not None, f"the request span of {request_id}")
    return found()  # type: ignore[return-value]


def test_a_jwt_requests_span_names_its_identity_issuer_and_tenant_but_not_its_subject(
        gateway_factory, mock_provider, receiver):  # noqa: F811 - the fixture
    key = SigningKey("ES256", "e1")
    gateway = _gateway(gateway_factory, mock_provider("p"), key, f"http://127.0.0.1:{receiver.port}")
    token = key.sign(claims(ISS, org="acme", sub=SUBJECT))
    assert chat(gateway.port, "m", headers=[("Authorization", f"Bearer {token}"), ("X-Request-Id", "by-jwt")]).status == 200
    assert chat(gateway.port, "m", headers=[("Authorization", f"Bearer {API_KEY}"),
                                            ("X-Request-Id", "by-key")]).status == 200

    by_jwt = attributes(_server_span(receiver, "by-jwt"))
    assert {name: value for name, value in by_jwt.items() if name.startswith(("gridgate.identity", "gridgate.tenant"))} == {
        "gridgate.identity": "jwt:corp", "gridgate.identity.kind": "jwt", "gridgate.identity.issuer": ISS,
        "gridgate.tenant": "acme"}
    by_key = attributes(_server_span(receiver, "by-key"))
    assert by_key["gridgate.tenant"] == "globex"
    assert not [name for name in by_key if name.startswith("gridgate.identity")]  # an API key: its tenant says who
    # The subject is in no span of either trace (nor the token), and in no metric.
    exported = json.dumps(receiver.spans)
    assert SUBJECT not in exported and token not in exported
    _, _, metrics = request("127.0.0.1", gateway.admin_port, "GET", "/metrics")
    assert b'tenant="globex"' in metrics and SUBJECT.encode() not in metrics  # (acme, in no map, is "other")
