"""Config keys for fleet distribution and freshness: routing.overlay_source, routing.overlay_max_age."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, parse_config

CLUSTERS = 'clusters: [{name: a, endpoints: ["127.0.0.1:9001"]}]\n'
SOURCE = "{kind: valkey, url: 'valkey://127.0.0.1:6379/0', key: 'gridgate:overlay:gw'}"


def problems(routing: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(CLUSTERS + f"routing: {routing}\n")
    return info.value.problems


def test_overlay_source_replaces_the_overlay_file_with_defaults() -> None:
    config = parse_config(CLUSTERS + f"routing: {{overlay_source: {SOURCE}}}\n", base_dir="/etc/gridgate")
    source = config.routing.overlay_source
    assert source is not None
    assert (source.kind, source.url, source.key, source.poll_interval, source.cache_file) == (
        "valkey", "valkey://127.0.0.1:6379/0", "gridgate:overlay:gw", 5.0, None)
    assert config.overlay_path() is None
    assert config.routing.overlay_max_age is None


def test_overlay_source_beside_an_overlay_file_and_a_max_age() -> None:
    config = parse_config(CLUSTERS + f"routing: {{overlay_source: {SOURCE}, overlay_file: o.json, "
                                     "overlay_max_age: 10m}\n", base_dir="/srv")
    assert config.overlay_path() == "/srv/o.json"
    assert config.routing.overlay_max_age == 600.0


@pytest.mark.parametrize("routing, expected", [
    ("{overlay_source: {kind: file, url: 'valkey://h:1', key: k}}", "routing.overlay_source.kind: "),
    ("{overlay_source: {kind: valkey, url: 'valkey://h:1'}}", "routing.overlay_source.key: required key is missing"),
    ("{overlay_source: {kind: valkey, url: 'valkey://h:1', key: 'a b'}}",
     "routing.overlay_source.key: must be a key name without spaces"),
    ("{overlay_source: {kind: valkey, url: 'valkey://h:1', key: k, poll_interval: 0s}}",
     "routing.overlay_source.poll_interval: must be >= 100ms"),
    ("{overlay_source: {kind: valkey, url: 'valkey://h:1', key: k, channel: c}}",
     "routing.overlay_source.channel: unknown key"),
    (f"{{overlay_source: {SOURCE}, candidates: []}}", "routing.candidates: give either inline candidates"),
    ("{overlay_file: o.json, overlay_max_age: 0s}", "routing.overlay_max_age: must be >= 1s"),
])
def test_overlay_source_errors_name_the_field(routing: str, expected: str) -> None:
    assert problems(routing)[0].startswith(expected)


def test_gridgate_check_refuses_a_source_url_the_quota_backend_would_refuse_and_a_missing_cache_dir(tmp_path) -> None:
    from gateway.check import check_problems

    config = parse_config(CLUSTERS + "routing: {overlay_source: {kind: valkey, url: 'http://h:1', key: k, "
                                     "cache_file: missing/cache.json}}\n", base_dir=str(tmp_path))
    assert check_problems(config, environ=None) == [
        "routing.overlay_source.url: unsupported scheme http:// (use one of valkey://, valkeys://, redis://, "
        "rediss://, unix://, valkey+cluster://, valkeys+cluster://)",
        f"routing.overlay_source.cache_file: directory {tmp_path}/missing does not exist",
    ]
    good = parse_config(CLUSTERS + f"routing: {{overlay_source: {SOURCE}}}\n", base_dir=str(tmp_path))
    assert check_problems(good, environ=None) == []
