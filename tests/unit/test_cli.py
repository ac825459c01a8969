"""``gridgate`` sub-commands in process: exit codes, messages naming the field, -h everywhere."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from gateway.check import validate_deployment
from gateway.cli import main
from gateway.config import load_config
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


@pytest.mark.parametrize(("block", "problem"), [
    ("    health_check: {interval: 0ms}\n", "clusters[0].health_check.interval: must be >= 100ms"),
    ("    outlier_detection: {max_ejection_percent: 500}\n",
     "clusters[0].outlier_detection.max_ejection_percent: must be <= 100"),
])
def test_check_refuses_a_number_out_of_its_range_naming_the_bound(config_dir, capsys, block, problem):
    (config_dir / "gateway.yaml").write_text(CONFIG.replace('    endpoints: ["127.0.0.1:9001"]\n',
                                                            '    endpoints: ["127.0.0.1:9001"]\n' + block))
    assert run(capsys, "check", "-c", str(config_dir / "gateway.yaml")) == (1, "", problem + "\n")


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


def test_check_reports_a_model_glob_that_matches_no_model_of_the_overlay(config_dir, capsys):
    # The overlay holds model-a. The gateway itself accepts such a rule (overlays change while it runs).
    quota = ("quota:\n  backend: {kind: valkey, url: 'valkey://127.0.0.1:1/0'}\n  rules:\n"
             "    - {name: a, match: {model: 'model-*'}, requests: [{window: 1m, count: 5}]}\n"
             "    - {name: b, match: {model: 'gpt-*'}, requests: [{window: 1m, count: 5}]}\n")
    (config_dir / "gateway.yaml").write_text(CONFIG + quota)
    code, out, err = run(capsys, "check", "-c", str(config_dir / "gateway.yaml"))
    assert (code, out) == (1, "")
    assert err == "quota.rules[1].match.model: 'gpt-*' matches no model of the overlay\n"
    validate_deployment(load_config(str(config_dir / "gateway.yaml")))  # raises nothing


def test_check_reports_an_invalid_overlay(config_dir, capsys):
    shutil.copy(FIXTURES / "invalid-digest.json", config_dir / "overlay.json")
    code, _, err = run(capsys, "check", "-c", str(config_dir / "gateway.yaml"))
    assert code == 1
    assert err.startswith("routing.overlay_file: ") and "digest_mismatch" in err


def test_check_reports_overlay_clusters_this_gateway_lacks(config_dir, capsys):
    # The gateway would skip such candidates at run time; under review they are a problem.
    (config_dir / "gateway.yaml").write_text(CONFIG.replace("cluster-a", "cluster-b"))
    code, out, err = run(capsys, "check", "-c", str(config_dir / "gateway.yaml"))
    assert code == 1 and out == ""
    assert err == (f"routing.overlay_file: {config_dir / 'overlay.json'}: candidates[0].cluster: 'cluster-a' is not "
                   "a configured cluster; such candidates are never selected\n")


def test_check_reports_inline_candidates_with_unknown_clusters(config_dir, capsys):
    inline = CONFIG.replace("  overlay_file: overlay.json\n", "  candidates:\n" + "".join(
        f"    - {{kind: inference_model, name: m, site: s, cluster: {name}}}\n" for name in ("cluster-a", "x", "x")))
    (config_dir / "gateway.yaml").write_text(inline)
    code, _, err = run(capsys, "check", "-c", str(config_dir / "gateway.yaml"))
    assert code == 1
    assert err.startswith("routing.candidates: candidates[1].cluster: 'x' is not a configured cluster "
                          "(and 1 more candidates)")


def test_check_reports_unset_secrets_unless_no_env(config_dir, capsys, monkeypatch):
    monkeypatch.delenv("GG_TEST_SECRET", raising=False)
    (config_dir / "gateway.yaml").write_text(CONFIG.replace(
        '    endpoints: ["127.0.0.1:9001"]\n',
        '    endpoints: ["127.0.0.1:9001"]\n    upstream_auth: {value_env: GG_TEST_SECRET}\n'))
    path = str(config_dir / "gateway.yaml")
    assert run(capsys, "check", "-c", path) == (
        1, "", "clusters[0].upstream_auth.value_env: environment variable GG_TEST_SECRET is not set\n")
    assert run(capsys, "check", "--no-env", "-c", path) == (0, "ok\n", "")
    monkeypatch.setenv("GG_TEST_SECRET", "bad\nvalue")
    assert "holds characters not allowed" in run(capsys, "check", "-c", path)[2]
    monkeypatch.setenv("GG_TEST_SECRET", "sk-good")
    assert run(capsys, "check", "-c", path) == (0, "ok\n", "")


def test_check_yaml_errors_carry_file_line_and_column(config_dir, capsys):
    path = config_dir / "gateway.yaml"
    path.write_text(CONFIG + "workers: x: y\n")
    assert run(capsys, "check", "-c", str(path)) == (
        1, "", f"{path}:7:11: invalid YAML: mapping values are not allowed here\n")


def test_check_worker_count_in_words(config_dir, capsys):
    (config_dir / "gateway.yaml").write_text(CONFIG + "workers: two\n")
    assert run(capsys, "check", "-c", str(config_dir / "gateway.yaml")) == (
        1, "", "workers: expected an integer or auto, got 'two'\n")


@pytest.fixture
def tls_files(tmp_path: Path) -> tuple[Path, Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not available")
    files = []
    for name in ("one", "two"):
        cert, key = tmp_path / f"{name}.crt", tmp_path / f"{name}.key"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-days", "1", "-subj", "/CN=gw.test", "-keyout", str(key), "-out", str(cert)],
                       check=True, capture_output=True)
        files += [cert, key]
    return files[0], files[1], files[3]  # cert one, its key, a key that does not match it


@pytest.mark.parametrize(
    ("tls", "expected"),
    [
        ("{cert_file: one.crt, key_file: one.key}", None),
        ("{cert_file: absent.crt, key_file: one.key}", "server_tls.cert_file: cannot read {dir}/absent.crt: "
                                                        "No such file or directory"),
        ("{cert_file: one.key, key_file: one.key}", "server_tls.cert_file: {dir}/one.key holds no PEM certificate"),
        ("{cert_file: one.crt, key_file: one.crt}", "server_tls.key_file: {dir}/one.crt holds no PEM private key"),
        ("{cert_file: one.crt, key_file: two.key}", "server_tls: {dir}/one.crt and {dir}/two.key do not load as a "
                                                     "certificate and its key: KEY_VALUES_MISMATCH"),
    ],
)
def test_check_loads_the_listener_certificate(config_dir, tls_files, tls, expected, capsys):
    cert_dir = tls_files[0].parent
    (cert_dir / "overlay.json").write_bytes((config_dir / "overlay.json").read_bytes())
    (cert_dir / "gateway.yaml").write_text(CONFIG + f"server_tls: {tls}\n")
    code, out, err = run(capsys, "check", "-c", str(cert_dir / "gateway.yaml"))
    if expected is None:
        assert (code, out, err) == (0, "ok\n", "")
    else:
        assert (code, err) == (1, expected.format(dir=cert_dir) + "\n")


def test_check_loads_upstream_ca_files(config_dir, tls_files, capsys):
    cert, key, _ = tls_files
    (config_dir / "gateway.yaml").write_text(CONFIG.replace(
        '    endpoints: ["127.0.0.1:9001"]\n', f'    endpoints: ["127.0.0.1:9001"]\n    tls: {{ca_file: {cert}}}\n'))
    assert run(capsys, "check", "-c", str(config_dir / "gateway.yaml")) == (0, "ok\n", "")
    (config_dir / "gateway.yaml").write_text(CONFIG.replace(
        '    endpoints: ["127.0.0.1:9001"]\n', f'    endpoints: ["127.0.0.1:9001"]\n    tls: {{ca_file: {key}}}\n'))
    code, _, err = run(capsys, "check", "-c", str(config_dir / "gateway.yaml"))
    assert code == 1 and err.startswith(f"clusters[0].tls.ca_file: cannot load {key}: ")


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
def test_every_command_accepts_h_and_describes_itself(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "-h"])
    assert exit_info.value.code == 0
    usage, description, *_ = capsys.readouterr().out.split("\n\n")
    assert usage.startswith(" ".join(["usage: gridgate", *argv]))
    assert description[0].isupper() and not description.startswith(("options:", "positional arguments:"))


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"gridgate {metadata.version('gridgate')}\n"


def test_the_cli_and_check_load_no_data_plane_module():
    # Layers import downward only (DESIGN): `gridgate check` must work where the data plane cannot load.
    probe = ("import sys; from gateway.cli import main, cmd_check; import gateway.check; "
             "print(sorted(m for m in sys.modules if m.startswith(('workers', 'uvloop', 'h11'))))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout == "[]\n"


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("-", None),
        ("access.log", None),
        ("logs", "access_log.path: {dir}/logs is a directory"),
        ("missing/access.log", "access_log.path: directory {dir}/missing does not exist"),
        ("locked/access.log", "access_log.path: cannot create {dir}/locked/access.log: directory {dir}/locked "
                              "is not writable"),
    ],
)
def test_check_reports_an_access_log_it_cannot_write(config_dir, path, expected, capsys):
    (config_dir / "logs").mkdir()
    (config_dir / "locked").mkdir(mode=0o500)
    if expected is not None and "locked" in path and os.access(config_dir / "locked", os.W_OK):
        pytest.skip("running as root: every directory is writable")
    (config_dir / "gateway.yaml").write_text(CONFIG + f"access_log: {{path: {path}}}\n")
    code, out, err = run(capsys, "check", "-c", str(config_dir / "gateway.yaml"))
    if expected is None:
        assert (code, out, err) == (0, "ok\n", "")
        assert not (config_dir / "access.log").exists()  # checking creates nothing
    else:
        assert (code, err) == (1, expected.format(dir=config_dir) + "\n")
