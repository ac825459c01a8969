"""Every numeric key has a range, named in its error: the schema is walked, so a new key cannot skip it.

For each integer, number and duration the schema (``gateway.config.Config``, and the control plane's
``ControlSpec``) accepts, wherever it sits, a complete base document gets that one key set to -1, 0
and a huge value. The huge value and -1 must be refused with a line that starts with the key's path;
0 too, unless the key is listed in ``ZERO_MEANS_SOMETHING`` (and then 0 must be accepted). A key the
base document cannot reach fails the test until the base grows the block that holds it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec.inspect as schema
import pytest
import yaml

from gateway.config import Config, ConfigError, parse_config
from gateway.control.spec import ControlSpec, parse_spec
from gateway.yaml_config import Seconds

Path_ = tuple[str | int, ...]

BASE_CONFIG: dict[str, Any] = {
    "workers": 2,
    "clusters": [{
        "name": "a",
        "endpoints": [{"address": "127.0.0.1:9001"}],
        "health_check": {},
        "outlier_detection": {},
    }],
    "routing": {
        "overlay_file": "overlay.json",
        "overlay_source": {"kind": "valkey", "url": "valkey://127.0.0.1:6379/0", "key": "k"},
        "overlay_max_age": "1h",
        "retry": {"first_byte_timeout": "1s", "backoff": {}},
        "cooling": {},
        "conformance": {},
        "least_loaded": {"latency_prior": "100ms"},
        "session_affinity": {},
        "prefix_affinity": {"slow_first_token": "1s"},
        "models": [{"match": {"capability": "*"}, "context_window": 1000, "traffic_weight": 1}],
    },
    "limits": {},
    "timeouts": {},
    "access_log": {},
    "auth": {"keys": [{"tenant": "t", "key": "sha256:" + "0" * 64, "alias": "a", "limits": {
        "requests": [{"window": "1m", "count": 5, "burst": 5}], "budgets": [{"window": "1m", "tokens": 10}],
        "max_in_flight": 2, "spend": [{"usd": 5, "period": "1d", "alert_at": [0.5]}]}}],
        "jwt": [{"name": "idp", "issuer": "https://idp.example.com", "audience": ["g"], "jwks_file": "k.json",
                 "tenant_claim": "org", "leeway": "30s", "refresh": {}, "limits": {
                     "requests": [{"window": "1m", "count": 5, "burst": 5}], "budgets": [{"window": "1m", "tokens": 10}],
                     "max_in_flight": 2, "spend": [{"usd": 5, "period": "1d", "alert_at": [0.5]}]}}]},
    "quota": {
        "rules": [{"name": "r", "budgets": [{"window": "1m", "tokens": 10}], "estimate": {}, "max_in_flight": 5,
                   "requests": [{"window": "1m", "count": 5, "burst": 5}],
                   "spend": [{"usd": 5, "period": "1d", "alert_at": [0.5]}]}],
        "breaker": {},
        "lease": {"tokens": 10, "requests": 10},
    },
    "pricing": {"overrides": {"private-*": {"input": 1, "output": 2, "cached_input": 0.5, "cache_write": "1",
                                            "reasoning": 2}},
                "alerts_webhook": {"url": "http://127.0.0.1:9/alerts"}},
    "cors": {"allowed_origins": ["https://app.example.com"]},
    "models": {"fallbacks": {"m": {"chain": ["n"], "max_hops": 1}}},
    "tracing": {"endpoint": "http://127.0.0.1:4318"},
    "cache": {"enabled": True, "coalesce": {}, "local": {}, "index": {}},
}

BASE_SPEC: dict[str, Any] = {
    "output": "overlay.json",
    "scope": {"network": "n", "gateway": "g", "namespace": "s", "local_site": "l"},
    "providers": [{"name": "a", "site": "l", "models": ["m"], "health_url": "http://a.test/health",
                   "metrics_url": "http://a.test/metrics"}],
    "publish": {"valkey": {"url": "valkey://127.0.0.1:6379/0", "key": "k", "lease_ttl": "1m"}},
    "refresh": "1h",
    "scoringPolicy": {"strategy": "queueDepth", "queueDepthThreshold": 10, "kvCacheThreshold": 0.9},
    "admission": {"mode": "stabilized"},
}

# Keys for which 0 is a documented setting (docs/configuration.md): they must accept it.
ZERO_MEANS_SOMETHING = {
    "auth.jwt[0].leeway",  # no clock skew allowed
    "auth.jwt[0].refresh.early",  # refresh when the key set's lifetime ends
    "auth.jwt[0].unknown_kid_wait",  # an unknown kid is refused at once
    "clusters[0].outlier_detection.consecutive_failures",  # never eject
    "timeouts.graceful_shutdown",  # cut what is in flight at once
    "pricing.alerts_webhook.retries",  # one attempt per alert, no retry
    "routing.reload_debounce",  # re-read at once
    "routing.retry.backoff.base",  # no pause between attempts
    "quota.rules[0].estimate.default_max_tokens",  # estimate the prompt only
    "access_log.sample",  # log errors only
    "access_log.evidence_sample",  # no route evidence
    "tracing.sample",  # trace only requests whose client trace is sampled
    # a price of 0: the model is free
    "pricing.overrides.*.input",
    "pricing.overrides.*.output",
    "pricing.overrides.*.cached_input",
    "pricing.overrides.*.cache_write",
    "pricing.overrides.*.reasoning",
    "cors.max_age",  # ask before every request
}


def numeric_keys(kind: schema.Type, at: Path_ = ()) -> Iterator[tuple[Path_, str]]:
    """(path, kind) of every numeric key reachable from ``kind``: "int", "number" or "duration"."""
    if isinstance(kind, schema.StructType):
        for field in kind.fields:
            if not (at == () and field.name == "base_dir"):  # set by the loader, never by the file
                yield from numeric_keys(field.type, (*at, field.encode_name))
    elif isinstance(kind, schema.UnionType):
        leaves = {leaf for member in kind.types if (leaf := _numeric(member))}
        if leaves:
            yield at, leaves.pop()
        for member in kind.types:
            if not _numeric(member):
                yield from numeric_keys(member, at)
    elif isinstance(kind, schema.ListType):
        yield from numeric_keys(kind.item_type, (*at, 0))
    elif isinstance(kind, schema.DictType):
        yield from numeric_keys(kind.value_type, (*at, "*"))
    elif leaf := _numeric(kind):
        yield at, leaf


def _numeric(kind: schema.Type) -> str | None:
    if isinstance(kind, schema.CustomType) and kind.cls is Seconds:
        return "duration"
    if isinstance(kind, schema.IntType):
        return "int"
    if isinstance(kind, schema.FloatType):
        return "number"
    return None


def dotted(path: Path_) -> str:
    return "".join(f"[{step}]" if isinstance(step, int) else f".{step}" for step in path).lstrip(".")


def named(base: dict[str, Any], path: Path_) -> str:
    """The key's path as an error names it: a mapping's key (``*``) is the one the base document has,
    quoted (``pricing.overrides["private-*"].input``)."""
    out, node = "", base
    for step in path:
        if step == "*" and isinstance(node, dict) and node:
            step = next(iter(node))
            out += f'["{step}"]'
        else:
            out += f"[{step}]" if isinstance(step, int) else f".{step}"
        node = node[step] if isinstance(node, dict | list) and (isinstance(node, list) or step in node) else {}
    return out.lstrip(".")


def with_value(base: dict[str, Any], path: Path_, value: Any) -> dict[str, Any] | None:
    """A copy of ``base`` with the key at ``path`` set; None when a block on the way is missing."""
    document = copy.deepcopy(base)
    node: Any = document
    for step in path[:-1]:
        if step == "*":
            step = next(iter(node)) if isinstance(node, dict) and node else None
        try:
            node = node[step]
        except (KeyError, IndexError, TypeError):
            return None
        if not isinstance(node, dict | list):
            return None
    if isinstance(node, list) and isinstance(path[-1], int) and path[-1] < len(node):  # a list of numbers
        node[path[-1]] = value
        return document
    if not isinstance(node, dict):
        return None
    node[path[-1]] = value
    return document


VALUES = {"int": (-1, 0, 10**18), "number": (-1.0, 0.0, 1e18), "duration": (None, "0ms", "100000d")}


def problems_for(load: Callable[[str], Any], document: dict[str, Any]) -> list[str]:
    try:
        load(yaml.safe_dump(document))
    except ConfigError as exc:
        return exc.problems
    return []


def range_failures(root: type, base: dict[str, Any], load: Callable[[str], Any]) -> tuple[int, list[str]]:
    """(keys checked, what is wrong) for every numeric key of ``root``."""
    assert problems_for(load, base) == [], "the base document itself must be valid"
    failures: list[str] = []
    keys = list(numeric_keys(schema.type_info(root)))
    for path, kind in keys:
        name = dotted(path)
        negative, zero, huge = VALUES[kind]
        for value, label in ((negative, "-1"), (zero, "0"), (huge, "a huge value")):
            if value is None:
                continue  # a duration cannot be written negative
            document = with_value(base, path, value)
            if document is None:
                failures.append(f"{name}: the base document has no block to hold it; add one")
                break
            found = problems_for(load, document)
            is_named = any(line.startswith(f"{named(base, path)}: ") for line in found)
            if label == "0" and name in ZERO_MEANS_SOMETHING:
                if found:
                    failures.append(f"{name}: 0 is documented as meaningful but refused: {found}")
            elif not is_named:
                failures.append(f"{name}: {value!r} ({label}) is accepted or not named: {found or 'ok'}")
    return len(keys), failures


def test_every_numeric_config_key_has_a_range_named_in_its_error() -> None:
    count, failures = range_failures(Config, BASE_CONFIG, parse_config)
    assert count >= 40  # the walk still finds the keys
    assert not failures, "\n".join(failures)


def test_every_numeric_control_spec_key_has_a_range_named_in_its_error(tmp_path: Path) -> None:
    # The conformance block needs a gateway config with the provider's cluster to be valid at all.
    (tmp_path / "gateway.yaml").write_text('clusters: [{name: a, endpoints: ["127.0.0.1:9"]}]\nrouting: {overlay_file: o.json}\n')
    base = {**BASE_SPEC, "conformance": {"gateway_config": "gateway.yaml"}}
    count, failures = range_failures(ControlSpec, base, lambda text: parse_spec(text, base_dir=str(tmp_path)))
    assert count >= 8
    assert not failures, "\n".join(failures)


def test_the_keys_allowed_zero_exist() -> None:
    names = {dotted(path) for path, _ in numeric_keys(schema.type_info(Config))}
    assert ZERO_MEANS_SOMETHING <= names


@pytest.mark.parametrize(("document", "problem"), [
    ({"clusters": [{"name": "a", "endpoints": ["h:1"], "health_check": {"interval": "0ms"}}]},
     "clusters[0].health_check.interval: must be >= 100ms"),
    ({"clusters": [{"name": "a", "endpoints": ["h:1"], "health_check": {"healthy_threshold": 0}}]},
     "clusters[0].health_check.healthy_threshold: must be >= 1"),
    ({"clusters": [{"name": "a", "endpoints": ["h:1"], "health_check": {"unhealthy_threshold": -3}}]},
     "clusters[0].health_check.unhealthy_threshold: must be >= 1"),
    ({"clusters": [{"name": "a", "endpoints": ["h:1"], "outlier_detection": {"consecutive_failures": -1}}]},
     "clusters[0].outlier_detection.consecutive_failures: must be >= 0"),
    ({"clusters": [{"name": "a", "endpoints": ["h:1"], "outlier_detection": {"max_ejection_percent": 500}}]},
     "clusters[0].outlier_detection.max_ejection_percent: must be <= 100"),
    ({"quota": {"reservation_timeout": "0s", "rules": [{"name": "r", "budgets": [{"window": "1m", "tokens": 1}]}]}},
     "quota.reservation_timeout: must be >= 1s"),
    ({"quota": {"rules": [{"name": "r", "budgets": [{"window": "1m", "tokens": 1}], "max_in_flight": 0}]}},
     "quota.rules[0].max_in_flight: must be >= 1 (omit the key for no limit)"),
    ({"timeouts": {"header_read": "2d"}}, "timeouts.header_read: must be <= 1h"),
])
def test_values_check_used_to_accept_are_refused_naming_the_bound(document: dict[str, Any], problem: str) -> None:
    raw = {"clusters": [{"name": "a", "endpoints": ["h:1"]}], "routing": {"overlay_file": "o.json"}, **document}
    assert problems_for(parse_config, raw) == [problem]
