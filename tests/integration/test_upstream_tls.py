"""Upstream TLS: SNI, a configured CA file, verification on by default."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import threading

import pytest

from tests.harness import candidate, chat, envelope

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not available")


@pytest.fixture
def tls_server(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=provider.test",
         "-addext", "subjectAltName=DNS:provider.test", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    seen_sni: list[str | None] = []
    context.sni_callback = lambda sock, name, ctx: seen_sni.append(name)

    def serve() -> None:
        while True:
            try:
                raw, _ = listener.accept()
            except OSError:
                return
            try:
                with context.wrap_socket(raw, server_side=True) as conn:
                    conn.recv(65536)
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n"
                                 b"Connection: close\r\n\r\n{\"tls\": 1}\n")
            except (ssl.SSLError, OSError):
                raw.close()

    threading.Thread(target=serve, daemon=True).start()
    yield listener.getsockname()[1], str(cert), seen_sni
    listener.close()


def test_tls_upstream_with_ca_file_and_sni(gateway_factory, tls_server):
    port, cert, seen_sni = tls_server
    gateway = gateway_factory({"secure": [f"127.0.0.1:{port}"]}, envelope([candidate("m", "secure")]),
                              cluster_options={"tls": {"sni": "provider.test", "ca_file": cert}})
    response = chat(gateway.port, "m")
    assert response.status == 200
    assert response.body == b'{"tls": 1}\n'
    assert seen_sni[-1] == "provider.test"


def test_tls_upstream_with_untrusted_certificate_is_502(gateway_factory, tls_server):
    port, _, _ = tls_server
    gateway = gateway_factory({"secure": [f"127.0.0.1:{port}"]}, envelope([candidate("m", "secure")]),
                              cluster_options={"tls": {"sni": "provider.test"}})
    response = chat(gateway.port, "m")
    assert response.status == 502
    assert response.json()["error"]["type"] == "upstream_error"
