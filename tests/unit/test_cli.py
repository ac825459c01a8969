"""``gridgate`` sub-commands in process: exit codes, messages naming the field, -h everywhere."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from pathlib import Path

import pytest

from gateway.cli import main
from tests.contract_fixtures import OVERLAY_FIXTURES

# The normative fixtures live next to the repository (CONTRACT §4: ../shared/contract/overlay-v1).
FIXTURES = OVERLAY_FIXTURES
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())["fixtures"]

CONFIG = """\
listen: "127.0.0.1:18080"
clusters:
  - name: cluster-a
    endpoints: ["127.0.0.1:9001"]
routing:
  overlay_file: overlay.json
"""


@pytest.fixture
def config_dir(tmp_path: Path) -> Path:
    shutil.copy(FIXTURES / "valid-minimal.json", tmp_path / "overlay.json")
    (tmp_path / "gateway.yaml").write_text(CONFIG)
    return tmp_path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_check_valid_config_prints_ok(config_dir, capsys):
    assert run(capsys, "check", "-c", str(config_dir / "gateway.yaml")) == (0, "ok\n", "")


def test_check_names_the_bad_field(config_dir, capsys):
    (config_dir / "gateway.yaml").write_text(CONFIG.replace("127.0.0.1:18080", "no-port-here"))
    code, out, err = run(capsys, "check", "-c", str(config_dir / "gateway.yaml"))
    assert code == 1 and out == ""
    assert err.startswith("listen: ") and err.count("\n") == 1


def test_check_names_the_unknown_key(config_dir, capsys):
    (config_dir / "gateway.yaml").write_text(CONFIG + "surprise: true\n")
    code, _, err = run(capsys, "check", "-c", str(config_dir / "gateway.yaml"))
    assert code == 1
    assert err == "surprise: unknown key\n"


def test_check_reports_quota_rules_the_workers_would_refuse(config_dir, capsys):
    quota = ("quota:\n  backend: {kind: valkey, url: 'valkey://127.0.0.1:1/0'}\n  rules:\n"
             "    - {name: r, budgets: [{window: 1m, tokens: 5}, {window: 60s, tokens: 9}]}\n"
             "    - {name: r, budgets: [{window: 1h, tokens: 5}]}\n")
    (config_dir / "gateway.yaml").write_text(CONFIG + quota)
    code, out, err = run(capsys, "check", "-c", str(config_dir / "gateway.yaml"))
    assert code == 1 and out == ""
    assert "quota.rules[0].budgets: two budgets with the same window" in err
    assert "quota.rules[1].name: duplicate rule name 'r'" in err


def test_check_reports_an_invalid_overlay(config_dir, capsys):
    shutil.copy(FIXTURES / "invalid-digest.json", config_dir / "overlay.json")
    code, _, err = run(capsys, "check", "-c", str(config_dir / "gateway.yaml"))
    assert code == 1
    assert err.startswith("routing.overlay_file: ") and "digest_mismatch" in err


def test_check_reports_a_missing_file(tmp_path, capsys):
    code, _, err = run(capsys, "check", "-c", str(tmp_path / "absent.yaml"))
    assert code == 1 and "cannot read" in err


@pytest.mark.parametrize("name", sorted(n for n, f in MANIFEST.items() if "revision" in f))
def test_overlay_digest_matches_the_manifest(name, capsys):
    assert run(capsys, "overlay", "digest", str(FIXTURES / name)) == (0, MANIFEST[name]["revision"] + "\n", "")


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_overlay_validate_follows_the_manifest(name, capsys):
    code, out, err = run(capsys, "overlay", "validate", str(FIXTURES / name))
    expected = MANIFEST[name]
    if expected["expected"].startswith("accept"):
        assert (code, out, err) == (0, "ok\n", "")
    else:
        assert code == 1 and err.startswith(expected["reason"] + ":")


def test_overlay_validate_enforces_the_configs_expected_scope(config_dir, capsys):
    (config_dir / "gateway.yaml").write_text(CONFIG + "  expected_overlay_scope: {network: other-net}\n")
    code, _, err = run(
        capsys, "overlay", "validate", str(FIXTURES / "valid-minimal.json"), "-c", str(config_dir / "gateway.yaml")
    )
    assert code == 1 and err.startswith("scope_mismatch:")


def test_overlay_digest_of_a_non_json_file(tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{nope")
    code, _, err = run(capsys, "overlay", "digest", str(tmp_path / "bad.json"))
    assert code == 1 and "malformed_structure" in err


def test_keys_hash_reads_stdin(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("s3cret-key\n"))
    expected = "sha256:" + hashlib.sha256(b"s3cret-key").hexdigest()
    assert run(capsys, "keys", "hash") == (0, expected + "\n", "")


def test_keys_hash_without_a_key_is_an_error(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("\n"))
    code, out, err = run(capsys, "keys", "hash")
    assert code == 1 and out == "" and "no API key" in err


def test_control_with_a_gateway_config_names_the_spec_problems(config_dir, capsys):
    # A gateway config is not a control-plane spec: exit 1 with field-named problems, no traceback.
    code, out, err = run(capsys, "control", "-c", str(config_dir / "gateway.yaml"))
    assert code == 1 and out == ""
    assert "Traceback" not in err and ":" in err


@pytest.mark.parametrize(
    "argv",
    [[], ["run"], ["check"], ["overlay"], ["keys"], ["bogus"], ["run", "-c", "x", "--workers", "0"],
     ["run", "-c", "x", "--listen", "nohost"]],
)
def test_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2


@pytest.mark.parametrize(
    "argv",
    [[], ["run"], ["check"], ["overlay"], ["overlay", "digest"], ["overlay", "validate"], ["control"], ["keys"],
     ["keys", "hash"]],
)
def test_every_command_accepts_h(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "-h"])
    assert exit_info.value.code == 0
    assert "usage: gridgate" in capsys.readouterr().out
