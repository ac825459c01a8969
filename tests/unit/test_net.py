"""The one address parser and the one TLS client-context builder."""

from __future__ import annotations

import ssl

import pytest

from gateway.net import client_tls_context, parse_host_port


@pytest.mark.parametrize(("text", "expected"), [
    ("127.0.0.1:8080", ("127.0.0.1", 8080)),
    ("provider.example:443", ("provider.example", 443)),
    ("[::1]:9001", ("::1", 9001)),
    ("0.0.0.0:65535", ("0.0.0.0", 65535)),
])
def test_host_port_parses(text: str, expected: tuple[str, int]) -> None:
    assert parse_host_port(text) == expected


@pytest.mark.parametrize("text", ["localhost", ":80", "host:", "host:0", "host:65536", "host:8o", "host:-1"])
def test_malformed_addresses_are_refused_naming_the_address(text: str) -> None:
    with pytest.raises(ValueError, match="expected host:port") as info:
        parse_host_port(text)
    assert repr(text) in str(info.value)


def test_tls_context_verifies_by_default_and_can_be_told_not_to() -> None:
    strict = client_tls_context()
    assert strict.verify_mode == ssl.CERT_REQUIRED and strict.check_hostname
    lax = client_tls_context(verify=False)
    assert lax.verify_mode == ssl.CERT_NONE and not lax.check_hostname


def test_tls_context_with_a_missing_ca_file_fails_loudly(tmp_path) -> None:
    with pytest.raises(OSError):
        client_tls_context(ca_file=str(tmp_path / "missing.pem"))
