"""`gridgate providers verify` against real mock providers: a conformant one passes every check, and each
switchable non-conformance is caught by its own check and by no other."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.cli import EXIT_NONCONFORMANT, EXIT_OK, main
from loadtest.mock_provider import MockProviderHandle, start_mock_provider_process

WINDOW = 2048
ALL_SURFACES = ["chat", "completions", "embeddings", "responses", "messages"]
# Each fault of loadtest/mock_conformance.py and the one check made to catch it.
CAUGHT_BY = {"short_context": "context_window", "no_stream_usage": "stream_usage",
             "wrong_error_shape": "error_shapes", "no_tools": "tools", "no_done": "chat_stream"}


@pytest.fixture(scope="module")
def strict_mock() -> Iterator[MockProviderHandle]:
    """A mock that keeps every promise: a key, an enforced window, tools and JSON mode."""
    with start_mock_provider_process(0, "strict", models="pool-model", context_window=WINDOW,
                                     api_key="sekret-key") as handle:
        yield handle


def set_faults(mock: MockProviderHandle, faults: str) -> None:
    request = urllib.request.Request(f"{mock.base_url}/admin/config", json.dumps({"nonconformance": faults}).encode(),
                                     method="POST")
    with urllib.request.urlopen(request, timeout=5) as answer:
        assert answer.status == 200


def write_config(tmp_path, mock: MockProviderHandle, **cluster: Any) -> str:
    config = {
        "clusters": [{"name": "pool-a", "endpoints": [mock.address],
                      "upstream_auth": {"value_env": "VERIFY_TEST_KEY"}, **cluster}],
        "routing": {
            "candidates": [{"kind": "inference_model", "name": "pool-model", "site": "inline", "cluster": "pool-a",
                            "fresh": True, "admission_state": "new_and_existing", "rank": 0, "stable_id": "a"}],
            "models": [{"match": {"capability": "pool-*"}, "context_window": WINDOW,
                        "features": ["tools", "json_schema"]}],
        },
    }
    path = tmp_path / "gateway.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return str(path)


def verify(capsys, path: str, *extra: str) -> tuple[int, dict[str, Any]]:
    args = ["providers", "verify", "-c", path, "--json", *extra]
    for surface in ALL_SURFACES:
        args += ["--surface", surface]
    code = main(args)
    return code, json.loads(capsys.readouterr().out)


def statuses(report: dict[str, Any]) -> dict[str, str]:
    (endpoint,) = report["endpoints"]
    return {check["check"]: check["status"] for check in endpoint["checks"]}


def test_conformant_provider_passes_every_check(strict_mock, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("VERIFY_TEST_KEY", "sekret-key")
    set_faults(strict_mock, "")
    code, report = verify(capsys, write_config(tmp_path, strict_mock))
    assert code == EXIT_OK
    assert report["conformant"] is True
    found = statuses(report)
    assert found.pop("tls") == "skipped"  # plain HTTP here: tests/integration/test_providers_verify_tls.py
    assert set(found.values()) == {"pass"}
    assert report["tokens"] > WINDOW  # the context-window check's prompts dominate, and they are counted


@pytest.mark.parametrize("fault", sorted(CAUGHT_BY))
def test_each_nonconformance_fails_its_check_and_only_it(fault, strict_mock, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("VERIFY_TEST_KEY", "sekret-key")
    set_faults(strict_mock, fault)
    try:
        code, report = verify(capsys, write_config(tmp_path, strict_mock))
    finally:
        set_faults(strict_mock, "")
    assert code == EXIT_NONCONFORMANT
    failed = {name for name, status in statuses(report).items() if status == "fail"}
    assert failed == {CAUGHT_BY[fault]}


def test_wrong_credential_and_missing_secret(strict_mock, tmp_path, capsys, monkeypatch) -> None:
    path = write_config(tmp_path, strict_mock)
    monkeypatch.delenv("VERIFY_TEST_KEY", raising=False)
    assert main(["providers", "verify", "-c", path]) == 1
    assert "upstream_auth.value_env: VERIFY_TEST_KEY is not set" in capsys.readouterr().err
    monkeypatch.setenv("VERIFY_TEST_KEY", "not-the-key")
    code, report = verify(capsys, path)
    assert code == EXIT_NONCONFORMANT
    assert statuses(report)["models"] == "fail"  # every check that sends the credential is refused


def test_unclaimed_features_and_undeclared_window_are_skipped(strict_mock, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("VERIFY_TEST_KEY", "sekret-key")
    path = write_config(tmp_path, strict_mock)
    config = json.loads(open(path).read())
    config["routing"]["models"] = []
    open(path, "w").write(json.dumps(config))
    code = main(["providers", "verify", "-c", path, "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == EXIT_OK
    found = statuses(report)
    assert {found[name] for name in ("tools", "json_mode", "context_window", "responses", "messages")} == {"skipped"}


def test_refused_endpoint_fails_without_a_traceback(tmp_path, capsys, monkeypatch) -> None:
    from tests.harness import refused_port

    monkeypatch.setenv("VERIFY_TEST_KEY", "k")
    dead = type("Dead", (), {"address": f"127.0.0.1:{refused_port()}"})()
    code = main(["providers", "verify", "-c", write_config(tmp_path, dead), "--timeout", "2"])
    out = capsys.readouterr().out
    assert code == EXIT_NONCONFORMANT
    assert "connection refused" in out and "0 of 1 endpoints conformant" in out
