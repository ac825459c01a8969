"""The config loader: defaults, durations, and one field-named line per problem."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, parse_config, parse_duration

BASE = 'clusters: [{name: a, endpoints: ["127.0.0.1:9001"]}]\nrouting: {overlay_file: o.json}\n'


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    return info.value.problems


@pytest.mark.parametrize(("text", "seconds"), [("500ms", 0.5), ("30s", 30), ("2m", 120), ("1h", 3600), ("1d", 86400)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


def test_defaults_follow_the_contract():
    config = parse_config(BASE)
    assert config.listen == "127.0.0.1:8080" and config.admin.listen == "127.0.0.1:9901"
    assert config.limits.max_header_bytes == 65536 and config.limits.max_body_bytes == 10485760
    assert config.timeouts.header_read == 10 and config.timeouts.keepalive_idle == 75
    cluster = config.clusters[0]
    assert cluster.load_balancer_strategy == "round_robin" and cluster.max_connections == 256
    assert cluster.read_timeout == 300 and cluster.weighted_endpoints() == [("127.0.0.1:9001", 1)]
    assert config.routing.model_header == "X-Model" and config.routing.route_headers is True
    assert config.auth is None and config.quota is None


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ("bogus: 1\n", "bogus: unknown key"),
        ("timeouts: {header_read: 10}\n", "timeouts.header_read:"),
        ("timeouts: {header_read: 5q}\n", "timeouts.header_read: invalid duration"),
        ("workers: 0\n", "workers:"),
        ("limits: {max_body_bytes: 0}\n", "limits.max_body_bytes: must be >= 1"),
        ("auth: {keys: [{tenant: t, key: plaintext}]}\n", "auth.keys[0].key: must be 'sha256:"),
        ("base_dir: /etc\n", "base_dir: unknown key"),
        ("routing: {overlay_file: o.json, session_affinity: {capacity: 0}}\n",
         "routing.session_affinity.capacity: must be >= 8"),
        ("quota: {backend: {kind: valkey}, rules: [{name: r, budgets: [{window: 1m, tokens: 5}]}]}\n",
         "quota.backend.url: must be"),
        ("routing: {overlay_file: o.json, provider_hop_clusters: [zz]}\n",
         "routing.provider_hop_clusters[0]: unknown cluster"),
    ],
)
def test_errors_name_the_field(extra, expected):
    text = BASE.replace("routing: {overlay_file: o.json}\n", "") if extra.startswith("routing") else BASE
    found = problems(text + extra)
    assert any(line.startswith(expected) for line in found), found


def test_cluster_field_errors_are_precise():
    found = problems('clusters: [{name: a, endpoints: [{address: "h:1", weight: 0}]}]\nrouting: {overlay_file: o}\n')
    assert found == ["clusters[0].endpoints[0].weight: must be 1..1000"]
    found = problems('clusters: [{name: a, endpoints: ["h:1"], load_balancer_strategy: fastest}]\n'
                     "routing: {overlay_file: o}\n")
    assert found[0].startswith("clusters[0].load_balancer_strategy: 'fastest' is not one of")


def test_duplicate_clusters_and_missing_secrets_are_reported(monkeypatch):
    monkeypatch.delenv("GG_TEST_SECRET", raising=False)
    text = ('clusters: [{name: a, endpoints: ["h:1"], upstream_auth: {value_env: GG_TEST_SECRET}}, '
            '{name: a, endpoints: ["h:2"]}]\nrouting: {overlay_file: o}\n')
    found = problems(text)
    assert "clusters[1].name: duplicate cluster name 'a'" in found
    assert any(line.startswith("clusters[0].upstream_auth.value_env: environment variable") for line in found)


def test_invalid_yaml_is_one_line():
    assert problems("clusters: [\n")[0].startswith("(line")


def test_inline_candidates_replace_the_overlay_file():
    inline = 'clusters: [{name: a, endpoints: ["h:1"]}]\nrouting: {candidates: [{kind: inference_model, name: m}]}\n'
    assert parse_config(inline).routing.candidates == [{"kind": "inference_model", "name": "m"}]
    both = 'clusters: [{name: a, endpoints: ["h:1"]}]\nrouting: {overlay_file: o.json, candidates: []}\n'
    assert problems(both)[0].startswith("routing.candidates: give either")
    neither = 'clusters: [{name: a, endpoints: ["h:1"]}]\nrouting: {}\n'
    assert problems(neither)[0].startswith("routing.overlay_file: required")
