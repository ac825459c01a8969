"""The response cache's pure parts (gateway/cache/key.py, gateway/cache/entry.py, gateway/config/cache.py):
what is cacheable, what the key depends on and what it does not, an entry's stored form, the block's
field-named errors."""

from __future__ import annotations

import json

import pytest
import yaml

from gateway.cache.entry import CacheEntry, decode_entry, encode_entry
from gateway.cache.key import cache_key, is_deterministic, request_bypasses
from gateway.config import ConfigError, parse_config
from gateway.config.cache import Cache, parse_size

CACHE = Cache(enabled=True)
CHAT = {"model": "alias", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}


def key(body: dict | bytes, cache: Cache = CACHE, surface: str = "chat_completions", tenant: str = "a",
        model: str = "m", headers: dict[bytes, bytes] | None = None) -> bytes | None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    found = cache_key(cache, surface, tenant, model, raw, headers or {})
    return None if found is None else found.key


def test_same_request_same_key_whatever_the_spacing_and_member_order() -> None:
    reordered = json.dumps(dict(reversed(list(CHAT.items()))), indent=2).encode()
    assert key(CHAT) == key(reordered) is not None


def test_tenant_model_and_answer_fields_change_the_key() -> None:
    base = key(CHAT)
    assert key(CHAT, tenant="b") != base
    assert key(CHAT, model="other") != base
    assert key({**CHAT, "max_tokens": 5}) != base
    assert key({**CHAT, "messages": [{"role": "user", "content": "ho"}]}) != base
    assert key({**CHAT, "stream": True}) != base
    assert key(CHAT, surface="completions") != base


def test_who_asks_does_not_change_the_key() -> None:
    assert key({**CHAT, "user": "u1", "metadata": {"x": "y"}, "model": "another-alias"}) == key(CHAT)


def test_shared_tenants_share_keys() -> None:
    shared = Cache(enabled=True, tenants="shared")
    assert key(CHAT, shared, tenant="a") == key(CHAT, shared, tenant="b")


def test_key_fields_narrow_the_body_part() -> None:
    narrow = Cache(enabled=True, key_fields=["messages"], only_deterministic=False)
    assert key({**CHAT, "max_tokens": 5}, narrow) == key(CHAT, narrow)
    assert key({**CHAT, "messages": []}, narrow) != key(CHAT, narrow)


def test_messages_answer_headers_join_the_key() -> None:
    body = {"model": "m", "messages": [], "temperature": 0}
    plain = key(body, surface="messages")
    assert key(body, surface="messages", headers={b"anthropic-beta": b"x"}) != plain


def test_only_deterministic_requests_are_cacheable() -> None:
    assert key({**CHAT, "temperature": 0.7}) is None
    assert key({"model": "m", "messages": []}) is None
    assert key({"model": "m", "messages": [], "seed": 7}) is not None
    assert key({"model": "m", "input": "x"}, surface="embeddings") is not None
    assert key({**CHAT, "temperature": 0.7}, Cache(enabled=True, only_deterministic=False)) is not None
    assert not is_deterministic("chat_completions", {"temperature": "0"})


def test_not_cacheable_apis_and_bodies() -> None:
    assert key(CHAT, surface="mcp") is None
    assert key(b"not json") is None
    assert key(b"[1, 2]") is None


def test_bypass_headers() -> None:
    assert request_bypasses(b"no-cache, No-Store", None)
    assert request_bypasses(None, b" Bypass ")
    assert not request_bypasses(b"no-cache", None)
    assert not request_bypasses(None, None)


def test_entry_round_trip_and_unreadable_value() -> None:
    entry = CacheEntry(200, b"text/event-stream", b"data: x\n\n", True, 3, 4, 99, "m")
    assert decode_entry(encode_entry(entry)) == entry
    assert entry.saved_tokens == 7
    assert decode_entry(b"\x01garbage") is None


def test_sizes() -> None:
    assert parse_size("1MiB") == 1 << 20
    assert parse_size("512KiB") == 512 << 10
    assert parse_size(4096) == 4096
    with pytest.raises(ValueError):
        parse_size("1GB")


def config(cache: dict, quota: bool = False) -> str:
    document = {"clusters": [{"name": "a", "endpoints": ["127.0.0.1:1"]}], "routing": {"overlay_file": "o.json"},
                "cache": cache}
    if quota:
        document["quota"] = {"backend": {"kind": "valkey", "url": "valkey://127.0.0.1:1"}, "rules": [{"name": "r", "budgets": [{"window": "1d", "tokens": 1000}]}]}
    return yaml.safe_dump(document)


@pytest.mark.parametrize(("block", "message"), [
    ({"enabled": True, "max_entry": "2GB"}, "cache.max_entry"),
    ({"enabled": True, "ttl": "0s"}, "cache.ttl"),
    ({"enabled": True, "tenants": "everyone"}, "cache.tenants"),
    ({"enabled": True, "key_fields": ["model"]}, "cache.key_fields"),
    ({"enabled": True, "coalesce": {"max_waiters": 0}}, "cache.coalesce.max_waiters"),
    ({"enabled": True, "backend": {"kind": "valkey"}}, "cache.backend"),
    ({"enabled": True}, "cache.backend"),  # no quota block: no Valkey to use
])
def test_config_errors_name_the_field(block: dict, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        parse_config(config(block), ".")
    assert message in str(error.value)


def test_config_accepts_the_quota_valkey_and_a_disabled_block() -> None:
    assert parse_config(config({"enabled": True}, quota=True), ".").cache.enabled
    assert not parse_config(config({"enabled": False}), ".").cache.enabled


def test_local_copies_are_bounded_in_bytes_and_time() -> None:
    from gateway.cache.local import LocalEntries

    entry = CacheEntry(200, None, b"x", False, expires_at=1000.0)
    local = LocalEntries(max_bytes=10, ttl_s=5.0)
    local.put(b"a", entry, 4, now=0.0)
    local.put(b"b", entry, 4, now=0.0)
    assert local.get(b"a", 1.0, 900.0).entry is entry  # a is now the most recently used
    local.put(b"c", entry, 4, now=1.0)  # over 10 bytes: b (least recently used) goes
    assert local.get(b"b", 1.0, 900.0) is None and local.get(b"a", 1.0, 900.0).entry is entry
    assert local.size == 8 and len(local) == 2
    assert local.get(b"c", 6.5, 900.0) is None  # its own ttl (copied at 1.0, 5 s)
    assert local.get(b"a", 2.0, 1000.0) is None  # its entry expired in Valkey
    local.put(b"big", entry, 11, now=0.0)
    assert local.get(b"big", 0.0, 0.0) is None and local.size == 0
