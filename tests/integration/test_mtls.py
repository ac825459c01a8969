"""mTLS on the HTTPS listener (``server_tls.client_auth``): client certificates made in the test
(tests/pki.py), a real gateway process, stdlib ``ssl`` clients; what each certificate gets (status,
the tenant on the access line) and which handshakes fail."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import ssl
import time
import uuid
from pathlib import Path

import h11
import pytest

from tests.harness import candidate, envelope, metric_value, wait_until
from tests.pki import Authority

KEY = "sk-mtls-key"
WORKLOAD = "spiffe://example.org/ns/prod/sa/svc-a"


class MtlsClient:
    """A keep-alive HTTPS client on one socket, presenting ``cert`` (a (cert_file, key_file) pair) or none."""

    def __init__(self, port: int, ca_file: str, cert: tuple[str, str] | None = None) -> None:
        context = ssl.create_default_context(cafile=ca_file)
        context.set_alpn_protocols(["http/1.1"])
        if cert is not None:
            context.load_cert_chain(*cert)
        self.sock = context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10),
                                        server_hostname="127.0.0.1")
        self.conn = h11.Connection(h11.CLIENT)

    def chat(self, request_id: str, headers: list[tuple[str, str]] = ()) -> tuple[int, bytes]:
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
        return self.request("POST", "/v1/chat/completions", body, [("x-request-id", request_id), *headers])

    def request(self, method: str, target: str, body: bytes = b"",
                headers: list[tuple[str, str]] = ()) -> tuple[int, bytes]:
        self.sock.sendall(self.conn.send(h11.Request(method=method, target=target, headers=[
            ("host", "127.0.0.1"), ("content-length", str(len(body))), *headers]))
            + self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage()))
        status, chunks = 0, []
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                data = self.sock.recv(65536)
                if not data:
                    raise ConnectionResetError("closed by the gateway")
                self.conn.receive_data(data)
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                if self.conn.our_state is h11.MUST_CLOSE:
                    self.close()
                else:
                    self.conn.start_next_cycle()
                return status, b"".join(chunks)

    def close(self) -> None:
        self.sock.close()


def one_request(port: int, ca_file: str, cert: tuple[str, str] | None, request_id: str,
                headers: list[tuple[str, str]] = ()) -> tuple[int, bytes]:
    client = MtlsClient(port, ca_file, cert)
    try:
        return client.chat(request_id, headers)
    finally:
        client.close()


def refused_handshake(port: int, ca_file: str, cert: tuple[str, str] | None) -> str:
    """The error a client gets whose certificate the gateway refuses: during the handshake, or (TLS 1.3,
    where the client finishes first) on its first read. Never an HTTP answer."""
    try:
        status, _ = one_request(port, ca_file, cert, "refused")
    except (ssl.SSLError, ConnectionResetError, BrokenPipeError) as error:
        return str(error)
    raise AssertionError(f"the gateway answered {status} instead of refusing the handshake")


class Pki:
    def __init__(self, directory: Path) -> None:
        self.ca = Authority(directory, "clients")
        self.other = Authority(directory, "strangers")
        self.server = self.ca.issue("server", server=True, ips=("127.0.0.1",))
        self.good = self.ca.issue("svc-a", uris=(WORKLOAD,))
        self.cn_only = self.ca.issue("svc-b")  # no SAN URI
        self.unmapped = self.ca.issue("svc-c", uris=("spiffe://example.org/ns/prod/sa/svc-c",))
        self.expired = self.ca.issue("old", uris=(WORKLOAD,), expired=True)
        self.stranger = self.other.issue("stranger", uris=(WORKLOAD,))
        self.revoked = self.ca.issue("revoked", uris=(WORKLOAD,))
        self.ca.revoke(self.revoked[0])
        self.crl_file = self.ca.write_crl(directory / "clients.crl")


@pytest.fixture
def pki(tmp_path):
    return Pki(tmp_path)


def mtls_gateway(gateway_factory, providers, pki: Pki, mode: str, tenant: str = "team-mesh",
                 extra: dict | None = None, **client_auth):
    overlay = envelope([candidate("m", "provider-a")])
    live_ca = os.path.join(os.path.dirname(pki.ca.ca_file), "live-ca.crt")
    shutil.copy(pki.ca.ca_file, live_ca)
    return gateway_factory({"provider-a": [providers["provider-a"].address]}, overlay, extra={
        "server_tls": {"cert_file": pki.server[0], "key_file": pki.server[1], "client_auth": {
            "ca_file": live_ca, "mode": mode, "tenant_from": "san_uri", "map": {WORKLOAD: tenant},
            **client_auth}},
        "auth": {"keys": [{"tenant": "team-key", "key": "sha256:" + hashlib.sha256(KEY.encode()).hexdigest()}]},
        "access_log": {"path": "access.log"},
        **(extra or {}),
    })


def access_lines(gateway, count: int, timeout: float = 10.0) -> dict[str, dict]:
    """The access lines by request id, once ``count`` are written."""
    path = os.path.join(gateway.directory, "access.log")
    deadline = time.monotonic() + timeout
    while True:
        lines = []
        if os.path.exists(path):
            with open(path) as handle:
                lines = [json.loads(line) for line in handle if line.strip()]
        if len(lines) >= count or time.monotonic() > deadline:
            return {line["request_id"]: line for line in lines}
        time.sleep(0.05)


def refusals(gateway) -> dict[str, float]:
    return {reason: metric_value(gateway.admin_port, f'gridgate_client_cert_refusals_total{{reason="{reason}"}}')
            for reason in ("missing", "untrusted", "expired", "revoked", "crl_unavailable")}


def wait_refusals(gateway, expected: dict[str, int]) -> None:
    """The refused handshakes reach /metrics with the worker's next heartbeat (every second)."""
    wait_until(lambda: refusals(gateway) == expected, f"refusal counts {expected}, last {refusals(gateway)}")


BEARER = [("authorization", f"Bearer {KEY}")]
UNKNOWN_BEARER = [("authorization", "Bearer sk-placeholder-an-sdk-insists-on")]


def test_required_mode_identifies_by_certificate_and_refuses_handshakes_without_a_good_one(
        gateway_factory, providers, pki):
    gateway = mtls_gateway(gateway_factory, providers, pki, "required", crl_file=pki.crl_file)
    ca = pki.ca.ca_file
    client = MtlsClient(gateway.port, ca, pki.good)
    try:  # keep-alive: the certificate is read once, every request on the connection is its tenant's
        assert [client.chat(f"cert-{n}")[0] for n in range(3)] == [200, 200, 200]
        assert client.chat("cert-and-key", BEARER)[0] == 200  # a key the gateway knows wins
        assert client.chat("cert-and-unknown-key", UNKNOWN_BEARER)[0] == 200  # an unknown one: the certificate
        status, body = client.request("GET", "/v1/gridgate/key")  # who the certificate says it is
        assert status == 200 and {k: v for k, v in json.loads(body).items() if k not in ("remaining", "spend")} == {
            "object": "gridgate.key", "source": "mtls", "identity": "mtls", "subject": WORKLOAD,
            "tenant": "team-mesh", "status": "active", "models": None, "rule": None, "expires_at": None,
            "limits": None}
    finally:
        client.close()
    status, body = one_request(gateway.port, ca, pki.unmapped, "unmapped")
    assert status == 403 and json.loads(body)["error"]["code"] == "certificate_not_mapped"
    assert "spiffe://example.org/ns/prod/sa/svc-c" in json.loads(body)["error"]["message"]
    status, body = one_request(gateway.port, ca, pki.cn_only, "no-uri")
    assert status == 403 and "has no SAN URI" in json.loads(body)["error"]["message"]
    for cert in (None, pki.expired, pki.stranger, pki.revoked, None):
        refused_handshake(gateway.port, ca, cert)
    wait_refusals(gateway, {"missing": 2, "untrusted": 1, "expired": 1, "revoked": 1, "crl_unavailable": 0})

    lines = access_lines(gateway, 8)
    lines.pop(next(rid for rid, line in lines.items() if line["path"] == "/v1/gridgate/key"))
    assert {rid: (line["tenant"], line["status"]) for rid, line in lines.items()} == {
        "cert-0": ("team-mesh", 200), "cert-1": ("team-mesh", 200), "cert-2": ("team-mesh", 200),
        "cert-and-key": ("team-key", 200), "cert-and-unknown-key": ("team-mesh", 200),
        "unmapped": (None, 403), "no-uri": (None, 403)}
    # The certificate's requests name their identity and subject; the key's line is a key's (neither).
    assert {rid: (line.get("identity"), line.get("subject")) for rid, line in lines.items()
            if line["status"] == 200} == {
        "cert-0": ("mtls", WORKLOAD), "cert-1": ("mtls", WORKLOAD), "cert-2": ("mtls", WORKLOAD),
        "cert-and-key": (None, None), "cert-and-unknown-key": ("mtls", WORKLOAD)}
    assert "Traceback" not in gateway.log()


def test_optional_mode_falls_through_to_keys_without_a_certificate(gateway_factory, providers, pki):
    gateway = mtls_gateway(gateway_factory, providers, pki, "optional")
    ca = pki.ca.ca_file
    assert one_request(gateway.port, ca, None, "nothing")[0] == 401  # auth is configured: a key or a certificate
    assert one_request(gateway.port, ca, None, "key-only", BEARER)[0] == 200
    assert one_request(gateway.port, ca, pki.good, "cert-only")[0] == 200
    for cert in (pki.expired, pki.stranger):  # a certificate that is sent must verify, even when optional
        refused_handshake(gateway.port, ca, cert)
    wait_refusals(gateway, {"missing": 0, "untrusted": 1, "expired": 1, "revoked": 0, "crl_unavailable": 0})
    lines = access_lines(gateway, 3)
    assert {rid: (line["tenant"], line["status"]) for rid, line in lines.items()} == {
        "nothing": (None, 401), "key-only": ("team-key", 200), "cert-only": ("team-mesh", 200)}


def test_sighup_reloads_the_client_ca_bundle_for_new_handshakes(gateway_factory, providers, pki):
    gateway = mtls_gateway(gateway_factory, providers, pki, "required")
    ca = pki.ca.ca_file
    before = MtlsClient(gateway.port, ca, pki.good)
    assert before.chat("before")[0] == 200
    refused_handshake(gateway.port, ca, pki.stranger)
    live_ca = os.path.join(os.path.dirname(ca), "live-ca.crt")
    with open(live_ca + ".tmp", "wb") as handle:  # the new bundle trusts the other CA only
        handle.write(open(pki.other.ca_file, "rb").read())
    os.replace(live_ca + ".tmp", live_ca)
    gateway.signal(signal.SIGHUP)

    deadline = time.monotonic() + 10
    while True:
        try:
            assert one_request(gateway.port, ca, pki.stranger, "stranger-after")[0] == 200
            break
        except (ssl.SSLError, ConnectionResetError):
            assert time.monotonic() < deadline, gateway.log()
            time.sleep(0.05)
    refused_handshake(gateway.port, ca, pki.good)  # its CA is no longer trusted for new handshakes
    try:
        assert before.chat("before-still")[0] == 200  # a connection verified before the reload keeps serving
    finally:
        before.close()
    assert "cannot reload" not in gateway.log()


def test_the_certificates_tenant_is_limited_like_a_keys(gateway_factory, providers, pki, valkey_url):
    tenant = f"mesh-{uuid.uuid4().hex[:8]}"
    rules = [{"name": f"r-{tenant}", "match": {"tenant": tenant}, "requests": [{"window": "1m", "count": 2}]},
             {"name": f"other-{tenant}", "requests": [{"window": "1m", "count": 100}]}]
    gateway = mtls_gateway(gateway_factory, providers, pki, "required", tenant, extra={
        "quota": {"backend": {"kind": "valkey", "url": valkey_url}, "reservation_timeout": "10s", "rules": rules}})
    client = MtlsClient(gateway.port, pki.ca.ca_file, pki.good)
    try:
        answers = [client.chat(f"limited-{n}") for n in range(3)]
        assert [status for status, _ in answers] == [200, 200, 429]
        error = json.loads(answers[2][1])["error"]
        assert error["code"] == "rate_limit_exceeded" and f"rule r-{tenant} requests 2/1m" in error["message"]
        assert client.chat("by-key", BEARER)[0] == 200  # the key's tenant has its own limits
    finally:
        client.close()


def test_sighup_rereads_the_crl_and_a_bundle_that_does_not_load_is_rejected(gateway_factory, providers, pki):
    gateway = mtls_gateway(gateway_factory, providers, pki, "required", crl_file=pki.crl_file)
    ca = pki.ca.ca_file
    assert one_request(gateway.port, ca, pki.good, "before-revocation")[0] == 200
    pki.ca.revoke(pki.good[0])  # the good certificate is revoked: a new CRL, then SIGHUP
    pki.ca.write_crl(pki.crl_file + ".tmp")
    os.replace(pki.crl_file + ".tmp", pki.crl_file)
    gateway.signal(signal.SIGHUP)
    wait_until(lambda: _refused(gateway.port, ca, pki.good), "the revoked certificate refused after SIGHUP")
    wait_refusals(gateway, {"missing": 0, "untrusted": 0, "expired": 0, "revoked": 1, "crl_unavailable": 0})

    live_ca = os.path.join(os.path.dirname(ca), "live-ca.crt")
    with open(live_ca + ".tmp", "w") as handle:
        handle.write("-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydA==\n-----END CERTIFICATE-----\n")
    os.replace(live_ca + ".tmp", live_ca)
    gateway.signal(signal.SIGHUP)  # the supervisor checks the files first: the reload is rejected
    wait_until(lambda: "reload rejected" in gateway.log(), "the rejected reload in the log")
    assert "server_tls.client_auth.ca_file" in gateway.log()
    fresh = pki.ca.issue("svc-a-renewed", uris=(WORKLOAD,))  # the CA bundle in service still verifies
    assert one_request(gateway.port, ca, fresh, "after-rejected-reload")[0] == 200


def _refused(port: int, ca_file: str, cert: tuple[str, str]) -> bool:
    try:
        one_request(port, ca_file, cert, "probe")
    except (ssl.SSLError, ConnectionResetError, BrokenPipeError):
        return True
    return False
