"""Client certificates at the head gate (workers/cert_gate.py): which credential wins, a certificate
read once per connection, a certificate that names no tenant. Real HeadGate, Authenticator and
CertificateTenants; a bare slot holder stands in for the server's connection, with a transport that
hands over the peer certificate as the TLS transport does (``get_extra_info("peercert")``)."""

from __future__ import annotations

from gateway.config import parse_config
from gateway.identity.auth import Authenticator, hash_api_key
from gateway.identity.client_cert import CertificateTenants
from gateway.quota.counters import configured_tenants
from gateway.request.headers import HeaderPlan
from gateway.request.routes import RouteTable
from workers.cert_gate import ConnectionCertificates
from workers.head_gate import ANONYMOUS_TENANT, Admitted, HeadGate, HeadRefusal

SVC_A = {"subject": ((("commonName", "svc-a"),),)}
SVC_X = {"subject": ((("commonName", "svc-x"),),)}


class Transport:
    def __init__(self, peercert: dict | None) -> None:
        self.peercert = peercert
        self.reads = 0

    def get_extra_info(self, name: str) -> object:
        assert name == "peercert"
        self.reads += 1
        return self.peercert


class Connection:
    __slots__ = ("auth_memo", "peer_identity", "transport")

    def __init__(self, peercert: dict | None = None) -> None:
        self.auth_memo = None
        self.peer_identity = False
        self.transport = Transport(peercert)


def gate(auth: bool = True) -> HeadGate:
    keys = Authenticator([("team-key", hash_api_key("sk-a"))]) if auth else None
    certificates = ConnectionCertificates(CertificateTenants("subject_cn", {"svc-a": "team-mesh"}))
    return HeadGate(RouteTable("/mcp", [("c", [])], {"c": 0}), keys, HeaderPlan("X-Model"),
                    certificates=certificates)


def ask(front: HeadGate, conn: Connection, key: str | None = None) -> Admitted | HeadRefusal:
    headers = [(b"host", b"g")] + ([(b"authorization", b"Bearer " + key.encode())] if key else [])
    return front(conn, b"POST", b"/v1/chat/completions", headers)


def test_a_known_key_wins_an_unknown_one_or_none_leaves_the_certificate() -> None:
    front, conn = gate(), Connection(SVC_A)
    assert ask(front, conn, "sk-a").tenant == "team-key"  # type: ignore[union-attr]
    for key in (None, "sk-placeholder"):
        admitted = ask(front, conn, key)
        assert type(admitted) is Admitted and admitted.tenant == "team-mesh"
        assert (admitted.key.via, admitted.key.alias) == ("mtls", "svc-a")  # type: ignore[union-attr]
    assert conn.transport.reads == 1  # the certificate is read once per connection


def test_without_a_certificate_the_gate_answers_as_without_mtls() -> None:
    assert ask(gate(), Connection(None)).status == 401  # type: ignore[union-attr]
    assert ask(gate(auth=False), Connection(None)).tenant == ANONYMOUS_TENANT  # type: ignore[union-attr]
    assert ask(gate(auth=False), Connection(SVC_A)).tenant == "team-mesh"  # type: ignore[union-attr]


def test_a_certificate_the_map_lacks_is_403_unless_a_key_identifies_the_request() -> None:
    front, conn = gate(), Connection(SVC_X)
    refusal = ask(front, conn)
    assert type(refusal) is HeadRefusal and (refusal.status, refusal.code) == (403, "certificate_not_mapped")
    assert "'svc-x' maps to no tenant" in refusal.message and refusal.tenant is None
    assert ask(front, conn, "sk-a").tenant == "team-key"  # type: ignore[union-attr]
    assert ask(front, conn).status == 403 and conn.transport.reads == 1  # type: ignore[union-attr]


def test_the_maps_tenants_are_labelled_in_the_metrics() -> None:
    config = parse_config(
        'clusters: [{name: a, endpoints: ["127.0.0.1:9001"]}]\nrouting: {overlay_file: o.json}\n'
        "server_tls: {cert_file: c, key_file: k, client_auth: {ca_file: ca, map: {svc-a: team-mesh, svc-b: other}}}\n")
    assert configured_tenants(config) == ["team-mesh"]  # `other` is the label of every unknown tenant


def test_a_quota_rules_key_glob_matches_the_certificates_value() -> None:
    from gateway.quota.rules import key_matches

    identity = CertificateTenants("san_uri").identify({"subjectAltName": (("URI", "spiffe://example.org/ns/prod/sa/a"),)})
    assert key_matches("spiffe://example.org/ns/prod/*", identity)  # type: ignore[arg-type]
    assert not key_matches("spiffe://example.org/ns/dev/*", identity)  # type: ignore[arg-type]
