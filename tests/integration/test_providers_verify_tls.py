"""`gridgate providers verify` over HTTPS: a real mock provider serving a certificate of a test CA
(tests/pki.py). The `tls` check passes with the right CA and server name, fails with another CA (naming
the CA file), and fails naming the server name (SNI) when the certificate does not match it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.cli import EXIT_NONCONFORMANT, EXIT_OK, main
from loadtest.mock_provider import MockProviderHandle, start_mock_provider_process
from tests.pki import Authority


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> tuple[Authority, Authority]:
    directory = tmp_path_factory.mktemp("pki")
    return Authority(directory, "provider-ca"), Authority(directory, "other-ca")


@pytest.fixture(scope="module")
def https_mock(pki) -> Iterator[MockProviderHandle]:
    cert, key = pki[0].issue("provider", dns=("provider.test",), server=True)
    with start_mock_provider_process(0, "secure", models="pool-model", tls_cert=cert, tls_key=key) as handle:
        yield handle


def _verify(tmp_path, capsys, mock: MockProviderHandle, tls: Any) -> tuple[int, dict[str, dict[str, Any]]]:
    config = {
        "clusters": [{"name": "secure", "endpoints": [mock.address], "tls": tls if tls is not None else False}],
        "routing": {"candidates": [{"kind": "inference_model", "name": "pool-model", "site": "inline",
                                    "cluster": "secure", "fresh": True, "admission_state": "new_and_existing",
                                    "rank": 0, "stable_id": "s"}]},
    }
    path = tmp_path / "gateway.yaml"
    path.write_text(json.dumps(config))
    code = main(["providers", "verify", "-c", str(path), "--json"])
    (endpoint,) = json.loads(capsys.readouterr().out)["endpoints"]
    return code, {check["check"]: check for check in endpoint["checks"]}


def test_right_ca_and_server_name_pass(tmp_path, capsys, pki, https_mock) -> None:
    code, checks = _verify(tmp_path, capsys, https_mock, {"sni": "provider.test", "ca_file": pki[0].ca_file})
    assert checks["tls"]["status"] == "pass", checks["tls"]
    assert "server name provider.test" in checks["tls"]["reason"] and pki[0].ca_file in checks["tls"]["reason"]
    assert checks["tls"]["details"]["version"].startswith("TLSv1")
    assert all(c["status"] != "fail" for c in checks.values()), checks  # every other check ran over the TLS
    assert code == EXIT_OK


def test_another_ca_fails_naming_the_ca_file(tmp_path, capsys, pki, https_mock) -> None:
    code, checks = _verify(tmp_path, capsys, https_mock, {"sni": "provider.test", "ca_file": pki[1].ca_file})
    reason = checks["tls"]["reason"]
    assert checks["tls"]["status"] == "fail" and "not trusted by tls.ca_file" in reason and pki[1].ca_file in reason
    assert "unable to get local issuer certificate" in reason
    assert code == EXIT_NONCONFORMANT


def test_a_certificate_for_another_name_fails_naming_the_sni(tmp_path, capsys, pki, https_mock) -> None:
    code, checks = _verify(tmp_path, capsys, https_mock, {"sni": "elsewhere.test", "ca_file": pki[0].ca_file})
    reason = checks["tls"]["reason"]
    assert checks["tls"]["status"] == "fail", checks["tls"]
    assert "does not match the server name 'elsewhere.test' (SNI" in reason and "mismatch" in reason.lower()
    assert code == EXIT_NONCONFORMANT


def test_verify_false_passes_and_says_so(tmp_path, capsys, pki, https_mock) -> None:
    code, checks = _verify(tmp_path, capsys, https_mock, {"sni": "elsewhere.test", "verify": False})
    assert checks["tls"]["status"] == "pass" and "NOT verified" in checks["tls"]["reason"]
    assert code == EXIT_OK


def test_plain_http_skips_the_tls_check(tmp_path, capsys) -> None:
    with start_mock_provider_process(0, "plain", models="pool-model") as plain:
        code, checks = _verify(tmp_path, capsys, plain, None)
    assert checks["tls"]["status"] == "skipped" and code == EXIT_OK
