"""HTTPS on the listener (``server_tls``): keep-alive over TLS, failed handshakes, a certificate reload."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time

import h11
import pytest

from tests.harness import candidate, envelope

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not available")


def make_certificate(directory, name: str) -> tuple[str, str]:
    cert, key = os.path.join(directory, f"{name}.crt"), os.path.join(directory, f"{name}.key")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "1",
         "-subj", f"/CN={name}", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", key, "-out", cert],
        check=True, capture_output=True,
    )
    return cert, key


class TlsClient:
    """A keep-alive HTTPS client on one socket, trusting ``ca_file`` only."""

    def __init__(self, port: int, ca_file: str) -> None:
        context = ssl.create_default_context(cafile=ca_file)
        context.set_alpn_protocols(["http/1.1"])
        self.sock = context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10),
                                        server_hostname="127.0.0.1")
        self.conn = h11.Connection(h11.CLIENT)

    def chat(self, request_id: str) -> tuple[int, dict[str, str], bytes]:
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
        self.sock.sendall(self.conn.send(h11.Request(method="POST", target="/v1/chat/completions", headers=[
            ("host", "127.0.0.1"), ("content-length", str(len(body))), ("x-request-id", request_id)]))
            + self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage()))
        status, headers, chunks = 0, {}, []
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(self.sock.recv(65536))
            elif isinstance(event, h11.Response):
                status, headers = event.status_code, {k.decode(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                self.conn.start_next_cycle()
                return status, headers, b"".join(chunks)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def tls_gateway(tmp_path, providers, gateway_factory):
    cert, key = make_certificate(str(tmp_path), "first")
    overlay = envelope([candidate("m", "provider-a")])
    gateway = gateway_factory({"provider-a": [providers["provider-a"].address]}, overlay,
                              extra={"server_tls": {"cert_file": cert, "key_file": key}})
    return gateway, cert, key


def test_keep_alive_requests_over_https(tls_gateway):
    gateway, cert, _ = tls_gateway
    client = TlsClient(gateway.port, cert)
    try:
        assert client.sock.selected_alpn_protocol() == "http/1.1"
        assert client.sock.version() in ("TLSv1.2", "TLSv1.3")
        for number in range(3):
            status, headers, body = client.chat(f"tls-{number}")
            assert (status, headers["x-request-id"], headers["x-gridgate-provider"]) == (200, f"tls-{number}",
                                                                                        "provider-a")
            assert json.loads(body)["object"] == "chat.completion"
    finally:
        client.close()


def test_failed_handshakes_do_not_disturb_other_connections(tls_gateway):
    gateway, cert, _ = tls_gateway
    client = TlsClient(gateway.port, cert)
    try:
        assert client.chat("before")[0] == 200
        for garbage in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # plain HTTP to the HTTPS port
                        b"\x16\x03\x01\x00\x05\x01\x00\x00\x01\x00"):  # a mangled ClientHello
            with socket.create_connection(("127.0.0.1", gateway.port), timeout=5) as plain:
                plain.sendall(garbage)
                try:
                    answer = plain.recv(65536)
                except ConnectionResetError:
                    answer = b""
                assert b"HTTP/1.1" not in answer  # the handshake failed: no HTTP was spoken
        assert client.chat("after")[0] == 200  # the same keep-alive connection still serves
        fresh = TlsClient(gateway.port, cert)
        assert fresh.chat("fresh")[0] == 200
        fresh.close()
    finally:
        client.close()
    assert "Traceback" not in gateway.log()


def test_sighup_serves_a_new_certificate_to_new_connections(tmp_path, tls_gateway):
    gateway, cert, key = tls_gateway
    old = TlsClient(gateway.port, cert)
    assert old.chat("old-1")[0] == 200
    new_cert, new_key = make_certificate(str(tmp_path), "second")
    shutil.copy(new_cert, cert + ".tmp")
    shutil.copy(new_key, key + ".tmp")
    os.replace(key + ".tmp", key)
    os.replace(cert + ".tmp", cert)
    gateway.signal(signal.SIGHUP)

    deadline = time.monotonic() + 10
    while True:
        try:
            client = TlsClient(gateway.port, new_cert)  # verifies against the new certificate only
            break
        except ssl.SSLCertVerificationError:
            assert time.monotonic() < deadline, gateway.log()
            time.sleep(0.05)
    try:
        assert client.chat("new")[0] == 200
        assert old.chat("old-2")[0] == 200  # the connection opened before the reload keeps serving
    finally:
        client.close()
        old.close()
    assert "cannot reload" not in gateway.log()
    # The log says the certificate was reloaded, and which one serves now (as openssl prints it).
    fingerprint = subprocess.run(["openssl", "x509", "-noout", "-fingerprint", "-sha256", "-in", new_cert],
                                 check=True, capture_output=True, text=True).stdout.strip().split("=", 1)[1]
    assert f"server_tls certificate {cert} reloaded (sha256 {fingerprint}, was " in gateway.log()
