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


def test_quota_lease_is_on_by_default_and_off_with_null_or_enabled_false():
    from gateway.quota.gate import lease_spec

    default = parse_config(BASE + f"quota: {{{QUOTA_RULES}}}\n").quota
    assert default.lease is not None and lease_spec(default) is not None
    assert (default.lease.tokens, default.lease.requests, default.lease.ttl, default.lease.headroom) == (
        None, None, 1.0, 10)  # sizes follow what blocks use
    assert lease_spec(parse_config(BASE + f"quota: {{lease: null, {QUOTA_RULES}}}\n").quota) is None
    assert lease_spec(parse_config(BASE + f"quota: {{lease: {{enabled: false}}, {QUOTA_RULES}}}\n").quota) is None
    lease = parse_config(BASE + f"quota: {{lease: {{tokens: 5000}}, {QUOTA_RULES}}}\n").quota.lease
    assert lease is not None and (lease.tokens, lease.ttl, lease.headroom) == (5000, 1.0, 10)  # as before: fixed
    assert problems(BASE + f"quota: {{lease: {{tokens: 0}}, {QUOTA_RULES}}}\n") == [
        "quota.lease.tokens: must be >= 1"]
    assert problems(BASE + f"quota: {{lease: {{requests: 0}}, {QUOTA_RULES}}}\n") == [
        "quota.lease.requests: must be >= 1"]
    assert problems(BASE + f"quota: {{lease: {{tokens: 10, ttl: 2m}}, {QUOTA_RULES}}}\n") == [
        "quota.lease.ttl: must be <= 1m"]
    assert problems(BASE + f"quota: {{lease: {{tokens: 10, headroom: 0}}, {QUOTA_RULES}}}\n") == [
        "quota.lease.headroom: must be >= 1"]


KEY_A = "sha256:" + "a" * 64
KEY_B = "sha256:" + "b" * 64


@pytest.mark.parametrize(("limit", "problem"), [
    ("{window: 1m, count: 0}", "quota.rules[0].requests[0].count: must be >= 1"),
    ("{window: 1m, count: -5}", "quota.rules[0].requests[0].count: must be >= 1"),
    ("{window: 500ms, count: 5}", "quota.rules[0].requests[0].window: must be >= 1s"),
    ("{window: 2d, count: 5}", "quota.rules[0].requests[0].window: must be <= 1d"),
    ("{window: 1500ms, count: 5}", "quota.rules[0].requests[0].window: must be whole seconds (1s..1d)"),
    ("{window: 1m, count: 5, burst: 0}", "quota.rules[0].requests[0].burst: must be >= 1"),
    ("{window: 1s, count: 2000000}", "quota.rules[0].requests[0].count: more than 1000000 requests per second "
                                     "cannot be metered"),
    ("{window: 1m, count: 5, shadow: maybe}", "quota.rules[0].requests[0].shadow: expected true or false, got 'maybe'"),
])
def test_a_bad_request_limit_is_a_config_error_naming_the_field(limit: str, problem: str) -> None:
    assert problems(BASE + f"quota: {{rules: [{{name: r, requests: [{limit}]}}]}}\n") == [problem]


def test_a_rule_may_hold_request_limits_alone_and_burst_defaults_to_count() -> None:
    quota = parse_config(BASE + "quota: {rules: [{name: r, requests: [{window: 1m, count: 60}]}]}\n").quota
    assert quota.rules[0].requests[0].burst is None and quota.rules[0].budgets == []
    from gateway.quota.rules import rules_from_config

    (rule,) = rules_from_config(quota)
    assert (rule.requests[0].count, rule.requests[0].burst, rule.requests[0].window_s) == (60, 60, 60)
    assert problems(BASE + "quota: {rules: [{name: r}]}\n") == [
        "quota.rules[0].budgets: a rule needs budgets, requests, spend or max_in_flight"]


def test_key_limits_need_an_alias_a_quota_block_and_unique_aliases() -> None:
    limits = "limits: {requests: [{window: 1m, count: 60}]}"
    quota = "quota: {rules: [{name: r, budgets: [{window: 1m, tokens: 5}]}]}\n"
    assert problems(BASE + f"auth: {{keys: [{{tenant: a, key: '{KEY_A}', {limits}}}]}}\n" + quota) == [
        "auth.keys[0].limits: the key needs an alias (its name in counters, messages and /admin/quota)"]
    assert problems(BASE + f"auth: {{keys: [{{tenant: a, key: '{KEY_A}', alias: ci, {limits}}}]}}\n") == [
        "auth.keys[0].limits: needs the quota block (limits are counted in its backend)"]
    assert problems(BASE + f"auth: {{keys: [{{tenant: a, key: '{KEY_A}', alias: ci}}, "
                           f"{{tenant: b, key: '{KEY_B}', alias: ci}}]}}\n") == [
        "auth.keys[1].alias: duplicate alias 'ci' (auth.keys[0] has it)"]
    assert problems(BASE + f"auth: {{keys: [{{tenant: a, key: '{KEY_A}', alias: 'two words'}}]}}\n")[0].startswith(
        "auth.keys[0].alias: 1..128 characters")
    assert problems(BASE + f"auth: {{keys: [{{tenant: a, key: '{KEY_A}', alias: ci, limits: {{requests: ["
                           "{window: 1m, count: 5}, {window: 60s, count: 9}]}}]}\n" + quota) == [
        "auth.keys[0].limits.requests: two request limits with the same window"]
    assert problems(BASE + f"auth: {{keys: [{{tenant: a, key: '{KEY_A}', alias: ci, limits: {{requests: ["
                           "{window: 1m, count: 0}]}}]}\n" + quota) == [
        "auth.keys[0].limits.requests[0].count: must be >= 1"]
    # With a quota block and no rule at all, key limits alone meter what they name.
    config = parse_config(BASE + f"auth: {{keys: [{{tenant: a, key: '{KEY_A}', alias: ci, {limits}}}]}}\n"
                                 "quota: {}\n")
    assert config.quota.rules == [] and config.auth.keys[0].limits.requests[0].count == 60
    assert problems(BASE + "quota: {}\n") == [
        "quota.rules: required (no rule and no key with limits: nothing to meter)"]


def test_a_key_glob_needs_auth_and_may_name_managed_keys() -> None:
    keys = f"auth: {{keys: [{{tenant: a, key: '{KEY_A}', alias: ci-bot}}]}}\n"
    rule = "quota: {{rules: [{{name: r, match: {{key: '{glob}'}}, requests: [{{window: 1m, count: 5}}]}}]}}\n"
    assert parse_config(BASE + keys + rule.format(glob="ci-*")).quota.rules[0].match.key == "ci-*"
    # No configured alias matches: the glob may name managed keys' kids or aliases (docs/keys.md).
    assert parse_config(BASE + keys + rule.format(glob="cd-*")).quota.rules[0].match.key == "cd-*"
    assert problems(BASE + rule.format(glob="ci-*")) == [
        "quota.rules[0].match.key: there is no auth block, so no request has a key"]
    assert problems(BASE + "quota: {rules: [{name: r, match: {model: ''}, requests: [{window: 1m, count: 5}]}]}\n") == [
        "quota.rules[0].match.model: must not be empty (omit it to match any)"]
