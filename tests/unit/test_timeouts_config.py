"""The `timeouts` block: `client_stall` defaults to 60s and must be at least a second (a zero
would cut every stream at its first pause)."""

from __future__ import annotations

import pytest

from gateway.config import parse_config
from gateway.yaml_config import ConfigError

BASE = ("clusters: [{name: a, endpoints: ['127.0.0.1:1']}]\n"
        "routing: {candidates: [{kind: inference_model, name: m, site: s, cluster: a}]}\n")


def test_client_stall_defaults_to_a_minute():
    assert parse_config(BASE).timeouts.client_stall == 60.0


def test_client_stall_takes_a_duration():
    assert parse_config("timeouts: {client_stall: 1500ms}\n" + BASE).timeouts.client_stall == 1.5


@pytest.mark.parametrize("value", ["0s", "0ms"])
def test_client_stall_must_be_positive(value):
    with pytest.raises(ConfigError) as caught:
        parse_config(f"timeouts: {{client_stall: {value}}}\n" + BASE)
    assert "timeouts.client_stall: must be >= 1s" in str(caught.value)
