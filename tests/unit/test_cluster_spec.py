"""The one config -> cluster spec mapping, and the endpoints' shared-memory keys."""

from __future__ import annotations

import pytest

from gateway.cluster.spec import (
    ClusterSpec,
    EndpointSpec,
    HealthCheckSpec,
    OutlierSpec,
    TlsSpec,
    all_endpoint_ids,
    cluster_specs_from_config,
)
from gateway.config import parse_config

CONFIG = """
clusters:
  - name: plain
    endpoints: ["10.0.0.1:8000", {address: "10.0.0.2:8000", weight: 3}]
  - name: hashed
    endpoints: ["10.0.1.1:8000"]
    load_balancer_strategy: {maglev: {header: X-User-Id}}
    tls: true
    health_check: {type: tcp, interval: 500ms, timeout: 200ms, healthy_threshold: 1, unhealthy_threshold: 4}
    outlier_detection: {consecutive_failures: 7, base_ejection: 1m, max_ejection_percent: 20}
  - name: secure
    endpoints: ["[::1]:8443"]
    load_balancer_strategy: least_connections
    tls: {sni: api.example, ca_file: /etc/ca.pem, verify: false}
    health_check: {}
routing: {overlay_file: o.json}
"""


def test_config_clusters_map_onto_specs_in_config_order() -> None:
    plain, hashed, secure = cluster_specs_from_config(parse_config(CONFIG))
    assert plain == ClusterSpec("plain", (EndpointSpec("10.0.0.1:8000", 1), EndpointSpec("10.0.0.2:8000", 3)))
    assert hashed.strategy == "maglev" and hashed.hash_header == "X-User-Id"
    assert hashed.tls == TlsSpec()
    assert hashed.health_check == HealthCheckSpec(type="tcp", interval_s=0.5, timeout_s=0.2, healthy_threshold=1,
                                                  unhealthy_threshold=4)
    assert hashed.outlier == OutlierSpec(consecutive_failures=7, base_ejection_s=60.0, max_ejection_percent=20)
    assert secure.strategy == "least_connections" and secure.hash_header is None
    assert secure.tls == TlsSpec(sni="api.example", ca_file="/etc/ca.pem", verify=False)
    assert secure.health_check == HealthCheckSpec()
    assert plain.tls is None and plain.health_check is None and plain.outlier is None


def test_a_hash_strategy_without_a_header_keys_on_the_path() -> None:
    text = 'clusters: [{name: c, endpoints: ["h:1"], load_balancer_strategy: {consistent_hash: {}}}]\n' \
           "routing: {overlay_file: o.json}\n"
    (spec,) = cluster_specs_from_config(parse_config(text))
    assert spec.strategy == "consistent_hash" and spec.hash_header is None


def test_endpoint_ids_and_slots_follow_endpoint_order() -> None:
    specs = cluster_specs_from_config(parse_config(CONFIG))
    assert all_endpoint_ids(specs) == ["plain/10.0.0.1:8000", "plain/10.0.0.2:8000", "hashed/10.0.1.1:8000",
                                       "secure/[::1]:8443"]
    plain = specs[0]
    assert plain.slots({"plain/10.0.0.2:8000": 7, "plain/10.0.0.1:8000": 3, "other/x:1": 0}) == [3, 7]
    with pytest.raises(KeyError, match="plain/10.0.0.2:8000"):
        plain.slots({"plain/10.0.0.1:8000": 3})
