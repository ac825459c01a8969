"""Route evidence on the access line (docs/operations.md, "Access log"): what the route considered and
left out, through a real gateway whose providers are really cooled, down, filtered or unknown."""

from __future__ import annotations

import json
import os
from typing import Any

from tests.harness import admin_get, candidate, chat, envelope, refused_port, wait_until
from tests.integration.test_access_log import wait_lines

CHECKS = {"health_check": {"type": "http", "path": "/health", "interval": "200ms", "timeout": "150ms",
                           "healthy_threshold": 1, "unhealthy_threshold": 1}}


def line_of(path: str, request_id: str) -> dict[str, Any]:
    lines = wait_until(lambda: [line for line in wait_lines(path, 1, 0.1) if line["request_id"] == request_id],
                       f"the line of {request_id}")
    return lines[0]


def unhealthy(gateway, cluster: str) -> bool:
    status, _, body = admin_get(gateway.admin_port, "/admin/endpoints")
    report = {c["name"]: c for c in json.loads(body)["clusters"]} if status == 200 else {}
    endpoints = report.get(cluster, {}).get("endpoints", [])
    return bool(endpoints) and all(e["health"] == "unhealthy" for e in endpoints)


def test_excluded_candidates_are_counted_by_reason(mock_provider, gateway_factory):
    cooled, serving, filtered = mock_provider("cooled"), mock_provider("serving"), mock_provider("filtered")
    overlay = envelope([candidate("m", name) for name in ("cooled", "down", "ghost", "filtered", "serving")],
                       "deterministic")
    clusters = {"cooled": [cooled.address], "down": [f"127.0.0.1:{refused_port()}"], "filtered": [filtered.address],
                "serving": [serving.address]}  # "ghost" is not configured here
    gateway = gateway_factory(clusters, overlay, cluster_options=CHECKS, extra={
        "access_log": {"path": "access.log", "evidence_sample": 1.0},
        "routing": {"models": [{"match": {"capability": "m", "cluster": "filtered"}, "context_window": 2000}],
                    "retry": {"attempts": 3, "backoff": {"base": "1ms", "max": "2ms"}},
                    "cooling": {"max": "1m"}},
    })
    path = os.path.join(gateway.directory, "access.log")
    wait_until(lambda: unhealthy(gateway, "down"), "the dead endpoint found unhealthy")
    first = chat(gateway.port, "m", headers=[("X-Request-Id", "first"), ("X-Mock-Status", "429"),
                                             ("X-Mock-Retry-After", "60"), ("X-Mock-Fault-For", "cooled")])
    assert first.status == 200
    line = line_of(path, "first")
    assert line["candidates"] == 5 and line["excluded"] == {"unhealthy": 1, "not_configured": 1}

    big = chat(gateway.port, "m", headers=[("X-Request-Id", "big")], max_tokens=50_000)
    assert (big.status, big.headers["x-gridgate-provider"]) == (200, "serving")
    line = line_of(path, "big")
    assert (line["provider"], line["site"], line["admission_state"]) == ("serving", "site-serving", "new_and_existing")
    assert line["candidates"] == 5
    assert line["excluded"] == {"cooled": 1, "unhealthy": 1, "not_configured": 1, "filtered": 1}
    assert "picker_inputs" not in line  # not least_loaded


def test_least_loaded_shows_the_two_scores_it_compared(providers, loopback_gateway_factory):
    overlay = envelope([candidate("m", "provider-a"), candidate("m", "provider-b")], "roundRobin")
    clusters = {name: [providers[name].address] for name in ("provider-a", "provider-b")}
    gateway = loopback_gateway_factory(clusters, overlay, extra={"access_log": {"path": "access.log", "evidence_sample": 1.0},
                                                        "routing": {"picker": "least_loaded"}})
    path = os.path.join(gateway.directory, "access.log")
    for index in range(6):
        assert chat(gateway.port, "m", headers=[("X-Request-Id", f"ll-{index}")]).status == 200
    lines = [line_of(path, f"ll-{index}") for index in range(6)]
    for line in lines:
        inputs = line["picker_inputs"]
        assert sorted(i["provider"] for i in inputs) == ["provider-a", "provider-b"]
        assert all(i["score"] > 0 for i in inputs)
        winner = min(inputs, key=lambda i: i["score"])  # ties go to the first drawn, which min also keeps
        assert line["provider"] == winner["provider"], line
        assert line["selection_mode"] == "least_loaded"


def test_evidence_sample_zero_leaves_it_out(providers, loopback_gateway_factory):
    overlay = envelope([candidate("m", "provider-a")])
    gateway = loopback_gateway_factory({"provider-a": [providers["provider-a"].address]}, overlay,
                              extra={"access_log": {"path": "access.log", "evidence_sample": 0.0}})
    assert chat(gateway.port, "m", headers=[("X-Request-Id", "plain")]).status == 200
    line = line_of(os.path.join(gateway.directory, "access.log"), "plain")
    assert line["provider"] == "provider-a"
    assert not {"site", "admission_state", "candidates", "excluded", "picker_inputs"} & set(line)


def test_by_default_about_one_line_in_a_hundred_carries_it(providers, loopback_gateway_factory):
    # The default (0.01) keeps the evidence's cost off most requests: of 200 lines, expected 2; 20 or more
    # has a probability below 1e-12. Every line keeps the core fields.
    overlay = envelope([candidate("m", "provider-a")])
    gateway = loopback_gateway_factory({"provider-a": [providers["provider-a"].address]}, overlay,
                              extra={"access_log": {"path": "access.log"}})
    for index in range(200):
        assert chat(gateway.port, "m", headers=[("X-Request-Id", f"d-{index}")]).status == 200
    lines = wait_lines(os.path.join(gateway.directory, "access.log"), 200)
    assert len(lines) == 200 and all(line["provider"] == "provider-a" for line in lines)
    assert sum("site" in line for line in lines) < 20
