"""The managed-keys config keys: admin.tokens, auth.store, auth.key_table_capacity (docs/keys.md)."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, managed_keys_enabled, parse_config

BASE = 'clusters: [{name: a, endpoints: ["127.0.0.1:9001"]}]\nrouting: {overlay_file: o.json}\n'
DIGEST = "sha256:" + "a" * 64
QUOTA = "quota: {rules: [{name: r, budgets: [{window: 1m, tokens: 10}]}]}\n"


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(BASE + text)
    return info.value.problems


def test_defaults_keep_managed_keys_off_and_the_admin_api_tokenless():
    config = parse_config(BASE)
    assert config.admin.tokens == [] and not managed_keys_enabled(config)
    config = parse_config(BASE + "auth: {keys: []}\n")
    assert config.auth.store is None and config.auth.key_table_capacity == 100_000
    assert not managed_keys_enabled(config)  # no store: YAML keys only
    assert managed_keys_enabled(parse_config(BASE + "auth: {store: {}}\n"))  # embedded by default
    assert managed_keys_enabled(parse_config(BASE + "auth: {}\n" + QUOTA))  # the quota's Valkey


def test_an_admin_listener_off_loopback_needs_tokens():
    assert problems("admin: {listen: '0.0.0.0:9901'}\n") == [
        "admin.listen: off loopback the admin listener needs admin.tokens (it would serve every admin page to "
        "anyone who can reach it)"]
    assert problems("admin: {listen: 'admin.internal:9901'}\n")[0].startswith("admin.listen:")
    for loopback in ("127.0.0.1:9901", "127.0.0.2:9901", "'[::1]:9901'", "localhost:9901"):
        parse_config(BASE + f"admin: {{listen: {loopback}}}\n")
    config = parse_config(BASE + f"admin: {{listen: '0.0.0.0:9901', tokens: [{{name: ops, key: '{DIGEST}', "
                                 "scopes: [keys:read]}]}\n")
    assert config.admin.tokens[0].scopes == ["keys:read"]


@pytest.mark.parametrize(("text", "problem"), [
    ("admin: {tokens: [{name: ops, key: plaintext}]}\n",
     "admin.tokens[0].key: must be 'sha256:<64 lowercase hex>' (see `gridgate keys hash`)"),
    (f"admin: {{tokens: [{{name: ops, key: '{DIGEST}', scopes: [keys:delete]}}]}}\n",
     "admin.tokens[0].scopes[0]: expected keys:read, keys:write, quota:read or spend:read, got 'keys:delete'"),
    (f"admin: {{tokens: [{{name: ops, key: '{DIGEST}'}}, {{name: ops, key: 'sha256:{'b' * 64}'}}]}}\n",
     "admin.tokens[1].name: duplicate token name 'ops'"),
    (f"admin: {{tokens: [{{name: a, key: '{DIGEST}'}}, {{name: b, key: '{DIGEST}'}}]}}\n",
     "admin.tokens[1].key: the same token as admin.tokens[0]"),
    ("auth: {store: {kind: valkey}}\n", "auth.store.url: must be set with kind valkey (e.g. valkey://host:6379/0)"),
    ("auth: {store: {kind: valkey, url: 'http://x'}}\n", "auth.store.url: unsupported scheme http://"),
    ("auth: {store: {url: 'valkey://x:1/0'}}\n", "auth.store.url: only with kind valkey"),
    ("auth: {store: {}}\n" + QUOTA, "auth.store: with a quota block the keys live in the quota backend's Valkey"),
    ("auth: {key_table_capacity: 0}\n", "auth.key_table_capacity: must be >= 1"),
])
def test_bad_keys_config_names_the_field(text, problem):
    assert any(line.startswith(problem) for line in problems(text)), problems(text)


def test_tenant_policies_may_name_tenants_that_only_managed_keys_have():
    text = "tenants: [{tenant: team-z, allowed_capabilities: ['*']}]\n"
    assert problems(text + "auth: {keys: []}\n") == ["tenants[0].tenant: 'team-z' has no key in auth.keys"]
    parse_config(BASE + text + "auth: {store: {}}\n")
