"""The config loader: defaults, durations, and one field-named line per problem."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, parse_config
from gateway.yaml_config import parse_duration

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
    assert config.server_tls is None and config.tenants == []
    assert config.limits.max_requests_per_connection == 1000
    assert (config.access_log.enabled, config.access_log.path, config.access_log.sample) == (True, "-", 1.0)


def test_routing_policy_defaults_follow_the_contract():
    routing = parse_config(BASE).routing
    assert (routing.retry.attempts, routing.retry.deadline, routing.retry.first_byte_timeout) == (3, 30, None)
    assert (routing.retry.backoff.base, routing.retry.backoff.max) == (0.01, 0.5)
    assert (routing.cooling.default, routing.cooling.max) == (5, 300)
    assert routing.picker == "overlay" and routing.stable_hash_key == ["tenant", "session"]
    assert routing.models == [] and routing.pin_header == "X-Gridgate-Pin"


def test_routing_policy_and_tenants_parse():
    config = parse_config(
        'clusters: [{name: a, endpoints: ["h:1"]}]\nauth: {keys: [{tenant: t1, key: "sha256:' + "0" * 64 + '"}]}\n'
        "routing:\n  overlay_file: o\n  picker: stable_hash\n  stable_hash_key: [tenant, 'header:X-User']\n"
        "  retry: {attempts: 1, deadline: 5s, backoff: {base: 0ms, max: 0ms}, first_byte_timeout: 2s}\n"
        "  models: [{match: {capability: 'gpt-*', cluster: a}, context_window: 8192, features: [tools, vision],"
        " region: eu, traffic_weight: 3}]\n"
        "tenants: [{tenant: t1, allowed_capabilities: ['gpt-*'], may_pin: true, priority: batch}]\n"
    )
    model = config.routing.models[0]
    assert (model.match.capability, model.match.cluster, model.context_window) == ("gpt-*", "a", 8192)
    assert model.features == ["tools", "vision"] and model.region == "eu" and model.traffic_weight == 3
    tenant = config.tenants[0]
    assert tenant.allowed_capabilities == ["gpt-*"] and tenant.allowed_regions is None  # None: no restriction
    assert tenant.may_pin and tenant.priority == "batch"
    assert config.routing.retry.first_byte_timeout == 2


def test_relative_files_resolve_against_the_config_directory():
    config = parse_config(BASE + "server_tls: {cert_file: c.pem, key_file: /abs/k.pem}\n", base_dir="/etc/gg")
    assert config.file_path(config.server_tls.cert_file) == "/etc/gg/c.pem"
    assert config.file_path(config.server_tls.key_file) == "/abs/k.pem"


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
        ("server_tls: {cert_file: c.pem}\n", "server_tls.key_file: required key is missing"),
        ("server_tls: {cert_file: '', key_file: k}\n", "server_tls.cert_file: must name a file"),
        ("limits: {max_requests_per_connection: 0}\n", "limits.max_requests_per_connection: must be >= 1"),
        ("access_log: {sample: 1.5}\n", "access_log.sample: must be between 0.0 and 1.0"),
        ("access_log: {path: ''}\n", "access_log.path: must be '-'"),
        ("access_log: {enabled: maybe}\n", "access_log.enabled: expected true or false, got 'maybe'"),
        ("routing: {overlay_file: o, retry: {attempts: 0}}\n", "routing.retry.attempts: must be >= 1"),
        ("routing: {overlay_file: o, retry: {deadline: 0s}}\n", "routing.retry.deadline: must be >= 10ms"),
        ("routing: {overlay_file: o, retry: {first_byte_timeout: 0ms}}\n", "routing.retry.first_byte_timeout: must be >= 10ms"),
        ("routing: {overlay_file: o, retry: {backoff: {base: 1s, max: 10ms}}}\n",
         "routing.retry.backoff.max: must be >= base"),
        ("routing: {overlay_file: o, cooling: {default: 10m}}\n", "routing.cooling.max: must be >= default"),
        ("routing: {overlay_file: o, picker: fastest}\n",
         "routing.picker: expected least_loaded, overlay, stable_hash or weighted, got 'fastest'"),
        ("routing: {overlay_file: o, stable_hash_key: [tenant, user]}\n",
         "routing.stable_hash_key[1]: 'user' is not tenant, session, request_id or header:<Name>"),
        ("routing: {overlay_file: o, stable_hash_key: ['header:']}\n", "routing.stable_hash_key[0]:"),
        ("routing: {overlay_file: o, stable_hash_key: [session, session]}\n",
         "routing.stable_hash_key[1]: 'session' is listed twice"),
        ("routing: {overlay_file: o, stable_hash_key: []}\n", "routing.stable_hash_key: must name at least one"),
        ("routing: {overlay_file: o, pin_header: 'X Pin'}\n", "routing.pin_header: not a valid header name"),
        ("routing: {overlay_file: o, models: [{context_window: 5}]}\n",
         "routing.models[0].match: required key is missing"),
        ("routing: {overlay_file: o, models: [{match: {capability: m, cluster: zz}}]}\n",
         "routing.models[0].match.cluster: unknown cluster 'zz'"),
        ("routing: {overlay_file: o, models: [{match: {capability: m}, features: [tools, telepathy]}]}\n",
         "routing.models[0].features[1]: expected audio, embeddings, json_schema, tools or vision, got 'telepathy'"),
        ("routing: {overlay_file: o, models: [{match: {capability: m}, context_window: 0}]}\n",
         "routing.models[0].context_window: must be >= 1"),
        ("routing: {overlay_file: o, models: [{match: {capability: m}, traffic_weight: 0}]}\n",
         "routing.models[0].traffic_weight: must be 1..1000"),
        ("tenants: [{tenant: t, priority: urgent}]\n",
         "tenants[0].priority: expected batch or interactive, got 'urgent'"),
        ("tenants: [{tenant: t, allowed_regions: []}]\n",
         "tenants[0].allowed_regions: must not be empty (omit the key for no restriction)"),
        ("tenants: [{tenant: t}, {tenant: t}]\n", "tenants[1].tenant: duplicate tenant 't'"),
        ("tenants: [{allowed_regions: [eu]}]\n", "tenants[0].tenant: required key is missing"),
        ("tenants: [{tenant: t}]\nauth: {keys: [{tenant: u, key: 'sha256:" + "0" * 64 + "'}]}\n",
         "tenants[0].tenant: 't' has no key in auth.keys"),
    ],
)
def test_errors_name_the_field(extra, expected):
    text = BASE.replace("routing: {overlay_file: o.json}\n", "") if extra.startswith("routing") else BASE
    found = problems(text + extra)
    assert any(line.startswith(expected) for line in found), found


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ("workers: two\n", "workers: expected an integer or auto, got 'two'"),
        ("workers: 1.5\n", "workers: expected an integer or auto, got 1.5"),
        ("listen: 8080\n", "listen: expected a string, got 8080"),
        ("admin: [a]\n", "admin: expected a mapping, got a list"),
        ("timeouts: {keepalive_idel: 5s}\n", "timeouts.keepalive_idel: unknown key (did you mean keepalive_idle?)"),
        ("tenants: {tenant: t}\n", "tenants: expected a list, got a mapping"),
        ("server_tls: true\n", "server_tls: expected a mapping or null, got true"),
    ],
)
def test_type_errors_speak_yaml(extra, expected):
    assert problems(BASE + extra) == [expected]


def test_cluster_field_errors_are_precise():
    found = problems('clusters: [{name: a, endpoints: [{address: "h:1", weight: 0}]}]\nrouting: {overlay_file: o}\n')
    assert found == ["clusters[0].endpoints[0].weight: must be 1..1000"]
    found = problems('clusters: [{name: a, endpoints: ["h:1"], load_balancer_strategy: fastest}]\n'
                     "routing: {overlay_file: o}\n")
    assert found[0].startswith("clusters[0].load_balancer_strategy: 'fastest' is not one of")


def test_an_error_inside_a_mapping_of_your_keys_names_the_key():
    # msgspec says `[...]` for a key of a mapping; the line names the key that failed, quoted
    found = problems('clusters: [{name: a, endpoints: ["h:1"], load_balancer_strategy: {maglev: {headr: X}}}]\n'
                     "routing: {overlay_file: o}\n")
    assert found == ['clusters[0].load_balancer_strategy["maglev"].headr: unknown key (did you mean header?)']
    found = problems(BASE + 'pricing: {overrides: {"ok-*": {input: 1, output: 1}, "gpt-4.1*": {input: 1, output: [2]}}}\n')
    assert found == ['pricing.overrides["gpt-4.1*"].output: expected a string, an integer or a number, got a list']


def test_duplicate_clusters_are_reported():
    text = 'clusters: [{name: a, endpoints: ["h:1"]}, {name: a, endpoints: ["h:2"]}]\nrouting: {overlay_file: o}\n'
    assert problems(text) == ["clusters[1].name: duplicate cluster name 'a'"]


def test_an_unset_secret_is_not_a_schema_problem(monkeypatch):
    # The environment is judged by gateway.check (so `gridgate check --no-env` can skip it), not the schema.
    monkeypatch.delenv("GG_TEST_SECRET", raising=False)
    text = 'clusters: [{name: a, endpoints: ["h:1"], upstream_auth: {value_env: GG_TEST_SECRET}}]\n'
    assert parse_config(text + "routing: {overlay_file: o}\n").clusters[0].upstream_auth.value_env == "GG_TEST_SECRET"


def test_invalid_yaml_is_one_line_with_line_and_column():
    assert problems("clusters: [\n") == [
        "(line 2, column 1): invalid YAML: expected the node content, but found '<stream end>' "
        "(while parsing a flow node)"
    ]
    with pytest.raises(ConfigError) as info:
        parse_config("routing:\n  overlay_file: [a\n  bad: 1\n", source="/etc/gridgate.yaml")
    assert info.value.problems[0].startswith("/etc/gridgate.yaml:3:")


def test_inline_candidates_replace_the_overlay_file():
    inline = 'clusters: [{name: a, endpoints: ["h:1"]}]\nrouting: {candidates: [{kind: inference_model, name: m}]}\n'
    assert parse_config(inline).routing.candidates == [{"kind": "inference_model", "name": "m"}]
    both = 'clusters: [{name: a, endpoints: ["h:1"]}]\nrouting: {overlay_file: o.json, candidates: []}\n'
    assert problems(both)[0].startswith("routing.candidates: give either")
    neither = 'clusters: [{name: a, endpoints: ["h:1"]}]\nrouting: {}\n'
    assert problems(neither)[0].startswith("routing.overlay_file: required")


QUOTA_RULES = "rules: [{name: r, budgets: [{window: 1m, tokens: 5}]}]"


@pytest.mark.parametrize(
    "url", ["valkey+cluster://10.0.0.1:6379", "valkeys+cluster://:pw@node.example:6380", "rediss://h:1/0",
            "unix:///run/valkey.sock"],
)
def test_quota_backend_urls_the_ledger_speaks_are_accepted(url):
    config = parse_config(BASE + f"quota: {{backend: {{kind: valkey, url: '{url}'}}, {QUOTA_RULES}}}\n")
    assert config.quota is not None and config.quota.backend.url == url


@pytest.mark.parametrize(
    ("url", "expected"),
    [("http://h:1", "quota.backend.url: unsupported scheme http:// (use one of valkey://"),
     ("valkeys+cluster://node.example", "quota.backend.url: valkeys+cluster:// needs host:port")],
)
def test_quota_backend_url_problems_are_named(url, expected):
    found = problems(BASE + f"quota: {{backend: {{kind: valkey, url: '{url}'}}, {QUOTA_RULES}}}\n")
    assert any(line.startswith(expected) for line in found), found


def test_quota_breaker_timings_have_defaults_and_are_checked():
    quota = parse_config(BASE + f"quota: {{{QUOTA_RULES}}}\n").quota
    assert quota is not None and (quota.breaker.failures, quota.breaker.probe_interval) == (3, 0.1)
    tuned = parse_config(BASE + f"quota: {{breaker: {{failures: 1, probe_interval: 50ms}}, {QUOTA_RULES}}}\n")
    assert tuned.quota is not None and (tuned.quota.breaker.failures, tuned.quota.breaker.probe_interval) == (1, 0.05)
    assert problems(BASE + f"quota: {{breaker: {{failures: 0}}, {QUOTA_RULES}}}\n") == [
        "quota.breaker.failures: must be >= 1"]
    assert problems(BASE + f"quota: {{breaker: {{probe_interval: 1ms}}, {QUOTA_RULES}}}\n") == [
        "quota.breaker.probe_interval: must be >= 10ms"]


def test_quota_lease_is_off_by_default_and_its_fields_are_checked():
    assert parse_config(BASE + f"quota: {{{QUOTA_RULES}}}\n").quota.lease is None
    lease = parse_config(BASE + f"quota: {{lease: {{tokens: 5000}}, {QUOTA_RULES}}}\n").quota.lease
    assert lease is not None and (lease.tokens, lease.ttl, lease.headroom) == (5000, 1.0, 10)
    assert problems(BASE + f"quota: {{lease: {{tokens: 0}}, {QUOTA_RULES}}}\n") == [
        "quota.lease.tokens: must be >= 1"]
    assert problems(BASE + f"quota: {{lease: {{tokens: 10, ttl: 2m}}, {QUOTA_RULES}}}\n") == [
        "quota.lease.ttl: must be <= 1m"]
    assert problems(BASE + f"quota: {{lease: {{tokens: 10, headroom: 0}}, {QUOTA_RULES}}}\n") == [
        "quota.lease.headroom: must be >= 1"]
    assert problems(BASE + f"quota: {{lease: {{ttl: 1s}}, {QUOTA_RULES}}}\n")[0].startswith("quota.lease")
