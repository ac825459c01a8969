"""Client certificates (mTLS): the certificate -> tenant mapping, the listener's TLS context with
client auth, the config block and ``gridgate check``'s field-named problems."""

from __future__ import annotations

import shutil
import ssl
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.config import ConfigError, parse_config
from gateway.http.client_certs import ClientTrust
from gateway.http.tls import ReloadableServerTls
from gateway.identity.auth import KeyIdentity
from gateway.identity.client_cert import MAX_IDENTITIES, CertificateTenants, certificate_values
from tests.contract_fixtures import OVERLAY_FIXTURES
from tests.pki import Authority
from tests.unit.test_server_tls import handshake

SPIFFE = "spiffe://example.org/ns/prod/sa/svc-a"
PEERCERT = {  # as SSLObject.getpeercert() decodes a verified certificate
    "subject": ((("organizationName", "Example"),), (("commonName", "outer"),), (("commonName", "svc-a"),)),
    "subjectAltName": (("DNS", "svc-a.prod.internal"), ("URI", SPIFFE), ("DNS", "svc-a.example.org")),
}


def test_values_are_read_most_specific_first():
    assert certificate_values(PEERCERT, "subject_cn") == ["svc-a", "outer"]
    assert certificate_values(PEERCERT, "san_uri") == [SPIFFE]
    assert certificate_values(PEERCERT, "san_dns") == ["svc-a.prod.internal", "svc-a.example.org"]
    assert certificate_values({"subject": ()}, "san_dns") == []


def test_without_a_map_the_value_is_the_tenant_and_one_identity_serves_every_connection():
    tenants = CertificateTenants("subject_cn")
    identity = tenants.identify(PEERCERT)
    assert isinstance(identity, KeyIdentity)
    assert (identity.tenant, identity.alias, identity.via, identity.kid) == ("svc-a", "svc-a", "mtls", None)
    assert tenants.identify(dict(PEERCERT)) is identity
    assert tenants.identify(None) is None and tenants.identify({}) is None  # no certificate


def test_a_map_picks_the_first_value_it_knows_and_refuses_a_certificate_it_does_not():
    tenants = CertificateTenants("san_dns", {"svc-a.example.org": "team-a"})
    identity = tenants.identify(PEERCERT)
    assert (identity.tenant, identity.alias) == ("team-a", "svc-a.example.org")
    assert CertificateTenants("san_uri", {"spiffe://other": "x"}).identify(PEERCERT) == (
        f"the client certificate's SAN URI {SPIFFE!r} maps to no tenant")
    assert CertificateTenants("san_uri").identify({"subject": PEERCERT["subject"]}) == (
        "the client certificate has no SAN URI")
    long = {"subject": (((("commonName", "x" * 300),),))}
    assert CertificateTenants("subject_cn", {"a": "b"}).identify(long).endswith("x" * 200 + "...' maps to no tenant")


def test_the_identity_table_is_bounded():
    tenants = CertificateTenants("subject_cn")
    for number in range(MAX_IDENTITIES + 5):
        tenants.identify({"subject": ((("commonName", f"cn-{number}"),),)})
    assert len(tenants._identities) == MAX_IDENTITIES
    late = {"subject": ((("commonName", "late"),),)}
    assert tenants.identify(late).tenant == "late" and tenants.identify(late) is not tenants.identify(late)


@pytest.fixture
def pki(tmp_path: Path):
    ca, other = Authority(tmp_path, "clients"), Authority(tmp_path, "others")
    server = ca.issue("server", server=True, dns=("gw.test",))
    return ca, other, server


def client(ca: Authority, cert: tuple[str, str] | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=ca.ca_file)
    context.check_hostname = False
    if cert is not None:
        context.load_cert_chain(*cert)
    return context


@pytest.mark.parametrize("required", [True, False])
def test_handshakes_verify_client_certificates_and_count_the_refused(pki, tmp_path, required):
    ca, other, server = pki
    revoked = ca.issue("revoked")
    ca.revoke(revoked[0])
    crl = ca.write_crl(tmp_path / "crl.pem")
    tls = ReloadableServerTls(*server, ClientTrust(ca.ca_file, crl, required))
    assert handshake(tls.context, client(ca, ca.issue("good")))
    refused = [ca.issue("expired", expired=True), other.issue("stranger"), revoked] + ([None] if required else [])
    for cert in refused:
        with pytest.raises(ssl.SSLError):
            handshake(tls.context, client(ca, cert))
    if not required:
        assert handshake(tls.context, client(ca))  # optional: no certificate is a handshake like any other
    assert tls.refusals.counts == {"missing": int(required), "untrusted": 1, "expired": 1, "revoked": 1,
                                   "crl_unavailable": 0}
    assert tls.context.num_tickets == 0  # no resumption around the verification


def test_reload_swaps_the_trusted_cas_and_a_bad_bundle_keeps_the_old_ones(pki, tmp_path):
    ca, other, server = pki
    live = tmp_path / "live-ca.crt"
    shutil.copy(ca.ca_file, live)
    tls = ReloadableServerTls(*server, ClientTrust(str(live)))
    good, stranger = ca.issue("good"), other.issue("stranger")
    assert handshake(tls.context, client(ca, good))
    live.write_text("not a certificate")
    assert tls.reload() is not None
    assert handshake(tls.context, client(ca, good))  # still the first bundle
    shutil.copy(other.ca_file, live)
    assert tls.reload() is None
    assert handshake(tls.context, client(ca, stranger))
    with pytest.raises(ssl.SSLError):
        handshake(tls.context, client(ca, good))


BASE = 'clusters: [{name: a, endpoints: ["127.0.0.1:9001"]}]\nrouting: {overlay_file: o.json}\n'
TLS = "server_tls: {cert_file: c.pem, key_file: k.pem, client_auth: %s}\n"


def test_config_block_defaults_and_field_named_errors():
    config = parse_config(BASE + TLS % "{ca_file: ca.pem}", base_dir="/etc/gg")
    client_auth = config.server_tls.client_auth
    assert (client_auth.mode, client_auth.tenant_from, client_auth.map, client_auth.crl_file) == (
        "required", "subject_cn", None, None)
    assert client_auth.trust(config.file_path) == ClientTrust("/etc/gg/ca.pem", None, True)
    for block, problem in (
            ("{}", "server_tls.client_auth.ca_file: required key is missing"),
            ("{ca_file: ca.pem, mode: sometimes}", "server_tls.client_auth.mode: expected optional or required, got 'sometimes'"),
            ("{ca_file: ca.pem, tenant_from: email}", "server_tls.client_auth.tenant_from: expected san_dns, san_uri or subject_cn"),
            ("{ca_file: ' '}", "server_tls.client_auth.ca_file: must name a PEM file"),
            ("{ca_file: ca.pem, map: {}}", "server_tls.client_auth.map: list at least one value"),
            ("{ca_file: ca.pem, map: {a: ''}}", "server_tls.client_auth.map: a certificate value and its tenant must not be empty ('a': '')"),
            ("{ca_file: ca.pem, crl: x}", "server_tls.client_auth.crl: unknown key"),
    ):
        with pytest.raises(ConfigError) as info:
            parse_config(BASE + TLS % block)
        assert info.value.problems[0].startswith(problem), info.value.problems


@pytest.mark.parametrize(("client_auth", "expected"), [
    ("{ca_file: clients-ca.crt, crl_file: crl.pem}", None),
    ("{ca_file: absent.crt}", "server_tls.client_auth.ca_file: cannot read {dir}/absent.crt: No such file or directory"),
    ("{ca_file: server.key}", "server_tls.client_auth.ca_file: {dir}/server.key holds no PEM certificate"),
    ("{ca_file: clients-ca.crt, crl_file: clients-ca.crt}",
     "server_tls.client_auth.crl_file: {dir}/clients-ca.crt holds no PEM CRL"),
    ("{ca_file: broken.crt}", "server_tls.client_auth.ca_file: {dir}/broken.crt does not load as CA certificates: "),
])
def test_check_loads_the_client_ca_bundle_and_crls(tmp_path, pki, client_auth, expected, capsys):
    ca, _, _ = pki
    ca.write_crl(tmp_path / "crl.pem")
    (tmp_path / "broken.crt").write_text("-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydA==\n-----END CERTIFICATE-----\n")
    shutil.copy(OVERLAY_FIXTURES / "valid-minimal.json", tmp_path / "overlay.json")
    (tmp_path / "gateway.yaml").write_text(
        'clusters: [{name: cluster-a, endpoints: ["127.0.0.1:9001"]}]\nrouting: {overlay_file: overlay.json}\n'
        f"server_tls: {{cert_file: server.crt, key_file: server.key, client_auth: {client_auth}}}\n")
    code = main(["check", "-c", str(tmp_path / "gateway.yaml")])
    out, err = capsys.readouterr()
    if expected is None:
        assert (code, out, err) == (0, "ok\n", "")
    else:
        assert code == 1 and err.startswith(expected.format(dir=tmp_path)), err


def _session_handshake(server: ssl.SSLContext, client_context: ssl.SSLContext,
                       session: ssl.SSLSession | None = None) -> tuple[ssl.SSLObject, ssl.SSLObject]:
    """A whole handshake in memory offering ``session``: (client's end, server's end). The server's end
    must outlive the next handshake: OpenSSL drops the session of a connection freed unclosed."""
    client_in, client_out, server_in, server_out = (ssl.MemoryBIO() for _ in range(4))
    client_end = client_context.wrap_bio(client_in, client_out, server_hostname="gw.test", session=session)
    server_end = server.wrap_bio(server_in, server_out, server_side=True)
    for _ in range(10):
        for end, outgoing, peer_in in ((client_end, client_out, server_in), (server_end, server_out, client_in)):
            try:
                end.do_handshake()
            except ssl.SSLWantReadError:
                pass
            peer_in.write(outgoing.read())
    return client_end, server_end


def test_a_tls_1_2_session_made_before_a_reload_does_not_resume_after_it(pki):
    ca, _, server = pki
    tls = ReloadableServerTls(*server, ClientTrust(ca.ca_file))
    context = client(ca, ca.issue("good"))
    context.maximum_version = ssl.TLSVersion.TLSv1_2  # TLS 1.3 resumes by tickets, which are off
    first, _kept = _session_handshake(tls.context, context)
    resumed, _also = _session_handshake(tls.context, context, first.session)
    assert resumed.session_reused  # no reload: a resumption is as good as the full handshake it resumes
    assert tls.reload() is None
    after, _server = _session_handshake(tls.context, context, first.session)
    assert not after.session_reused  # a full handshake: verified against the reloaded bundle
    assert _session_handshake(tls.context, context, after.session)[0].session_reused
