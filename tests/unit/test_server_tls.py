"""The listener's TLS context: what it accepts, and a reload that only new handshakes see."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from pathlib import Path

import pytest

from gateway.http.tls import ReloadableServerTls, server_tls_context

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not available")


def certificate(directory: Path, name: str) -> tuple[str, str]:
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-days", "1", "-subj", f"/CN={name}", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return str(cert), str(key)


def handshake(server_context: ssl.SSLContext, client_context: ssl.SSLContext) -> ssl.SSLObject:
    """A whole handshake in memory; returns the client's end."""
    client_in, client_out, server_in, server_out = (ssl.MemoryBIO() for _ in range(4))
    client = client_context.wrap_bio(client_in, client_out, server_hostname="gw.test")
    server = server_context.wrap_bio(server_in, server_out, server_side=True)
    for _ in range(10):
        done = 0
        for end, outgoing, peer_in in ((client, client_out, server_in), (server, server_out, client_in)):
            try:
                end.do_handshake()
                done += 1
            except ssl.SSLWantReadError:
                pass
            peer_in.write(outgoing.read())
        if done == 2:
            return client
    raise AssertionError("handshake did not finish")


def client_for(cert: str) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=cert)
    context.check_hostname = False  # the test certificates name no host
    context.set_alpn_protocols(["http/1.1"])
    return context


def test_context_is_tls_1_2_or_newer_with_http_1_1(tmp_path):
    cert, key = certificate(tmp_path, "one")
    context = server_tls_context(cert, key)
    assert context.minimum_version == ssl.TLSVersion.TLSv1_2
    assert context.options & ssl.OP_NO_RENEGOTIATION
    assert handshake(context, client_for(cert)).selected_alpn_protocol() == "http/1.1"


def test_reload_reaches_new_handshakes_and_a_bad_pair_keeps_the_old_certificate(tmp_path):
    first_cert, first_key = certificate(tmp_path, "first")
    second_cert, second_key = certificate(tmp_path, "second")
    live_cert, live_key = tmp_path / "live.crt", tmp_path / "live.key"
    shutil.copy(first_cert, live_cert)
    shutil.copy(first_key, live_key)
    tls = ReloadableServerTls(str(live_cert), str(live_key))
    assert handshake(tls.context, client_for(first_cert))

    shutil.copy(second_cert, live_cert)  # a certificate whose key is not there yet
    assert "KEY_VALUES_MISMATCH" in (tls.reload() or "")
    assert handshake(tls.context, client_for(first_cert))  # still the first one
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(tls.context, client_for(second_cert))

    shutil.copy(second_key, live_key)
    assert tls.reload() is None
    assert handshake(tls.context, client_for(second_cert))  # the listener's context, the new certificate
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(tls.context, client_for(first_cert))
