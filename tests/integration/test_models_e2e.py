"""Aliases and fallback chains across models (docs/models.md) through real gateways and mock providers.

Model ``big`` is served by cluster ``big-a``, ``small`` by ``small-a`` (and ``huge`` by ``huge-a`` where a
test needs a third model); the chain under test is ``big -> small`` unless a test says otherwise. The mock
providers echo the ``model`` of the body they received, so a response's ``model`` says what the gateway
sent upstream.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any

import pytest

from tests.harness import Client, candidate, chat, envelope, metric_value, mock_served, request, wait_until

FAST_RETRY = {"attempts": 3, "deadline": "10s", "backoff": {"base": "1ms", "max": "5ms"}}
KEY = "sk-models-e2e"
AUTH = [("Authorization", f"Bearer {KEY}")]


def overlay(*models: str) -> dict:
    return envelope([candidate(model, f"{model}-a") for model in models], mode="deterministic")


def models_gateway(loopback_gateway_factory, providers: dict[str, Any], models: dict, **extra: Any):
    """A gateway serving each model of ``providers`` from its own cluster, with the ``models`` block."""
    retry = {**FAST_RETRY, **extra.pop("retry", {})}
    config = {"routing": {"retry": retry, **extra.pop("routing", {})}, "models": models,
              "access_log": {"path": "access.log"}, **extra}
    gateway = loopback_gateway_factory({f"{model}-a": [handle.address] for model, handle in providers.items()},
                              overlay(*providers), extra=config)
    return gateway, os.path.join(gateway.directory, "access.log")


def log_line(path: str, request_id: str, timeout: float = 5.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(path, "rb") as handle:
                for raw in handle:
                    if raw.startswith(b"{"):
                        line = json.loads(raw)
                        if line.get("request_id") == request_id:
                            return line
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"no access line for {request_id}")
        time.sleep(0.02)


def fallbacks_metric(gateway, source: str, target: str, reason: str) -> float:
    return metric_value(gateway.admin_port,
                        f'gridgate_fallbacks_total{{from="{source}",reason="{reason}",to="{target}"}}')


FAILURES = {
    "unavailable": {"fail_rate": 1.0, "fail_status": 503},
    "rate_limited": {"fail_rate": 1.0, "fail_status": 429},
    "first_byte_timeout": {"stall_rate": 1.0, "stall_ms": 5000},
}


@pytest.mark.parametrize("reason", sorted(FAILURES))
def test_a_failing_first_model_is_served_by_the_next_one(reason, mock_provider, gateway_factory):
    big, small = mock_provider("big", **FAILURES[reason]), mock_provider("small")
    gateway, log = models_gateway(gateway_factory, {"big": big, "small": small},
                                  {"fallbacks": {"big": {"chain": ["small"]}}},
                                  retry={"first_byte_timeout": "300ms"})
    response = chat(gateway.port, "big", headers=[("X-Request-Id", f"fb-{reason}")])
    assert response.status == 200, response.body
    assert response.headers["x-gridgate-model"] == "small"
    assert response.headers["x-gridgate-fallback-hops"] == "1"
    assert response.headers["x-gridgate-provider"] == "small-a"
    assert response.headers["x-gridgate-attempts"] == "2"  # one attempt budget for the whole chain
    assert response.json()["model"] == "small"  # the upstream body names the model that serves
    assert mock_served(small) == 1
    line = log_line(log, f"fb-{reason}")
    assert (line["capability"], line["served_model"], line["fallback_hops"], line["fallback_reasons"]) == (
        "big", "small", 1, [reason])
    assert fallbacks_metric(gateway, "big", "small", reason) == 1


def test_a_reason_the_chain_does_not_list_never_moves_the_request(mock_provider, loopback_gateway_factory):
    big, small = mock_provider("big", fail_rate=1.0, fail_status=503), mock_provider("small")
    gateway, _ = models_gateway(loopback_gateway_factory, {"big": big, "small": small},
                                {"fallbacks": {"big": {"chain": ["small"], "on": ["rate_limited"]}}})
    response = chat(gateway.port, "big")
    assert response.status == 503
    assert response.headers["x-gridgate-fallback-hops"] == "0"
    assert mock_served(small) == 0


@pytest.mark.parametrize("status", [400, 401, 403])
def test_client_errors_never_fall_back(status, mock_provider, loopback_gateway_factory):
    big, small = mock_provider("big", fail_rate=1.0, fail_status=status), mock_provider("small")
    gateway, _ = models_gateway(loopback_gateway_factory, {"big": big, "small": small},
                                {"fallbacks": {"big": {"chain": ["small"]}}})
    response = chat(gateway.port, "big")
    assert response.status == status
    assert f"injected_{status}".encode() in response.body  # the provider's own answer, as it came
    assert mock_served(small) == 0


@pytest.mark.parametrize("code", ["context_length_exceeded", "content_filter"])
def test_a_provider_refusal_with_a_listed_code_moves_on_at_once(code, mock_provider, loopback_gateway_factory):
    small = mock_provider("small", fail_rate=1.0, fail_status=400, fail_code=code)
    small_b = mock_provider("small-b")  # another provider of the same model: never tried for such a refusal
    big = mock_provider("big")
    overlay_doc = envelope([candidate("small", "small-a"), candidate("small", "small-b", group=1),
                            candidate("big", "big-a")], mode="deterministic")
    gateway = loopback_gateway_factory({"small-a": [small.address], "small-b": [small_b.address], "big-a": [big.address]},
                              overlay_doc, extra={"routing": {"retry": FAST_RETRY},
                                                  "models": {"fallbacks": {"small": {"chain": ["big"]}}},
                                                  "access_log": {"path": "access.log"}})
    response = chat(gateway.port, "small", headers=[("X-Request-Id", code)])
    assert response.status == 200, response.body
    assert response.headers["x-gridgate-model"] == "big"
    assert (mock_served(small_b), mock_served(big)) == (0, 1)
    assert log_line(os.path.join(gateway.directory, "access.log"), code)["fallback_reasons"] == [code]


def test_a_provider_refusal_the_chain_does_not_list_is_relayed(mock_provider, loopback_gateway_factory):
    small = mock_provider("small", fail_rate=1.0, fail_status=400, fail_code="content_filter")
    big = mock_provider("big")
    gateway, _ = models_gateway(loopback_gateway_factory, {"small": small, "big": big},
                                {"fallbacks": {"small": {"chain": ["big"], "on": ["context_length_exceeded"]}}})
    response = chat(gateway.port, "small")
    assert response.status == 400
    assert response.json()["error"]["code"] == "content_filter"
    assert mock_served(big) == 0


def test_a_too_long_prompt_is_served_by_the_long_context_model(mock_provider, loopback_gateway_factory):
    small, big = mock_provider("small"), mock_provider("big")
    gateway, log = models_gateway(
        loopback_gateway_factory, {"small": small, "big": big}, {"fallbacks": {"small": {"chain": ["big"]}}},
        routing={"models": [{"match": {"capability": "small"}, "context_window": 500},
                            {"match": {"capability": "big"}, "context_window": 100000}]})
    long_prompt = "word " * 2000
    response = chat(gateway.port, "small", headers=[("X-Request-Id", "too-long")],
                    messages=[{"role": "user", "content": long_prompt}])
    assert response.status == 200, response.body
    assert response.headers["x-gridgate-model"] == "big"
    assert response.json()["model"] == "big"
    assert (mock_served(small), mock_served(big)) == (0, 1)
    assert log_line(log, "too-long")["fallback_reasons"] == ["context_length_exceeded"]
    short = chat(gateway.port, "small")  # a prompt that fits stays on its model
    assert short.headers["x-gridgate-model"] == "small"
    assert short.headers["x-gridgate-fallback-hops"] == "0"


def test_a_model_the_tenant_may_not_use_is_skipped_never_served(mock_provider, gateway_factory):
    big = mock_provider("big", fail_rate=1.0, fail_status=503)
    small, huge = mock_provider("small"), mock_provider("huge")
    key_hash = "sha256:" + hashlib.sha256(KEY.encode()).hexdigest()
    gateway, log = models_gateway(
        gateway_factory, {"big": big, "small": small, "huge": huge},
        {"fallbacks": {"big": {"chain": ["small", "huge"]}}},
        auth={"keys": [{"tenant": "team-a", "key": key_hash}]},
        tenants=[{"tenant": "team-a", "allowed_capabilities": ["big", "huge"]}])
    response = chat(gateway.port, "big", headers=[*AUTH, ("X-Request-Id", "skip")])
    assert response.status == 200, response.body
    assert response.headers["x-gridgate-model"] == "huge"
    assert (mock_served(small), mock_served(huge)) == (0, 1)
    line = log_line(log, "skip")
    assert (line["fallback_hops"], line["fallback_skipped"], line["served_model"]) == (1, 1, "huge")
    assert metric_value(gateway.admin_port, 'gridgate_fallback_skipped_total{from="big",to="small"}') == 1
    assert fallbacks_metric(gateway, "big", "huge", "unavailable") == 1
    # Asking for the forbidden model itself is refused, as before.
    assert chat(gateway.port, "small", headers=AUTH).status == 403


def test_max_hops_bounds_the_walk(mock_provider, loopback_gateway_factory):
    big = mock_provider("big", fail_rate=1.0, fail_status=503)
    small = mock_provider("small", fail_rate=1.0, fail_status=503)
    huge = mock_provider("huge")
    gateway, _ = models_gateway(loopback_gateway_factory, {"big": big, "small": small, "huge": huge},
                                {"fallbacks": {"big": {"chain": ["small", "huge"], "max_hops": 1}}},
                                retry={"attempts": 5})
    response = chat(gateway.port, "big")
    assert response.status == 503
    assert response.headers["x-gridgate-fallback-hops"] == "1"
    assert mock_served(huge) == 0


def stream(port: int, model: str) -> tuple[int, dict[str, str], bytes]:
    client = Client(port)
    try:
        response = client.request("POST", "/v1/chat/completions", {
            "model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}]})
        return response.status, response.headers, response.body
    finally:
        client.close()


def test_a_stream_falls_back_before_its_first_byte_like_a_non_stream(mock_provider, loopback_gateway_factory):
    big, small = mock_provider("big", fail_rate=1.0, fail_status=429), mock_provider("small")
    gateway, _ = models_gateway(loopback_gateway_factory, {"big": big, "small": small},
                                {"fallbacks": {"big": {"chain": ["small"]}}})
    status, headers, body = stream(gateway.port, "big")
    assert status == 200
    assert headers["x-gridgate-model"] == "small"
    assert headers["content-type"].startswith("text/event-stream")
    assert b'"model": "small"' in body or b'"model":"small"' in body
    assert body.rstrip().endswith(b"data: [DONE]")


def test_a_stream_cut_after_its_first_byte_is_not_retried(mock_provider, loopback_gateway_factory):
    big, small = mock_provider("big", mid_reset_rate=1.0), mock_provider("small")
    gateway, log = models_gateway(loopback_gateway_factory, {"big": big, "small": small},
                                  {"fallbacks": {"big": {"chain": ["small"]}}})
    client = Client(gateway.port)
    try:
        client.send("POST", "/v1/chat/completions", {"model": "big", "stream": True,
                    "messages": [{"role": "user", "content": "hi"}]}, [("X-Request-Id", "cut")])
        response = client.receive()
    finally:
        client.close()
    assert response.status == 200
    assert response.headers["x-gridgate-model"] == "big"
    assert b"upstream_reset" in response.body  # the stream ends with an error event, never silently
    assert mock_served(small) == 0
    line = log_line(log, "cut")
    assert (line["served_model"], line.get("fallback_hops", 0), line["error"]) == ("big", 0, "upstream_reset")


def test_the_whole_chain_shares_one_deadline(mock_provider, loopback_gateway_factory):
    """Both models stall; each attempt's first-byte timeout (1.4 s) alone would let the chain run 2.8 s:
    the one deadline (2 s) ends it at 2 s."""
    big = mock_provider("big", stall_rate=1.0, stall_ms=10000)
    small = mock_provider("small", stall_rate=1.0, stall_ms=10000)
    gateway, log = models_gateway(loopback_gateway_factory, {"big": big, "small": small},
                                  {"fallbacks": {"big": {"chain": ["small"]}}},
                                  retry={"deadline": "2s", "first_byte_timeout": "1400ms"})
    started = time.monotonic()
    response = chat(gateway.port, "big", headers=[("X-Request-Id", "deadline")])
    elapsed = time.monotonic() - started
    print(f"chain of two stalled models, deadline 2s, first_byte_timeout 1.4s: answered in {elapsed:.3f}s")
    assert response.status == 504
    assert response.headers["x-gridgate-model"] == "small"  # it did move: the deadline ended the second try
    assert 1.9 <= elapsed < 2.5
    assert log_line(log, "deadline")["fallback_reasons"] == ["first_byte_timeout"]


def test_aliases_resolve_and_list(mock_provider, loopback_gateway_factory):
    small, big = mock_provider("small"), mock_provider("big")
    gateway, log = models_gateway(loopback_gateway_factory, {"small": small, "big": big},
                                  {"aliases": {"fast": "small", "secret": {"target": "big", "hidden": True}}})
    response = chat(gateway.port, "fast", headers=[("X-Request-Id", "alias")])
    assert response.status == 200, response.body
    assert response.headers["x-gridgate-model"] == "small"
    assert response.json()["model"] == "small"  # the upstream body names the target
    line = log_line(log, "alias")
    assert (line["capability"], line["requested_model"], line["served_model"]) == ("small", "fast", "small")
    status, _, body = request("127.0.0.1", gateway.port, "GET", "/v1/models")
    assert status == 200 and b"\"data\"" in body, body
    listed = {entry["id"] for entry in json.loads(body)["data"]}
    assert status == 200 and listed == {"small", "big", "fast"}  # "secret" is hidden
    for name in ("fast", "secret"):
        status, _, body = request("127.0.0.1", gateway.port, "GET", f"/v1/models/{name}")
        assert status == 200 and json.loads(body)["id"] == name
    assert request("127.0.0.1", gateway.port, "GET", "/v1/models/nope")[0] == 404
    plain = chat(gateway.port, "big")  # no alias, no chain: no model headers
    assert plain.status == 200 and "x-gridgate-model" not in plain.headers


def test_an_alias_with_a_chain_walks_it(mock_provider, gateway_factory):
    big, small = mock_provider("big", fail_rate=1.0, fail_status=503), mock_provider("small")
    gateway, _ = models_gateway(gateway_factory, {"big": big, "small": small},
                                {"aliases": {"default": "big"}, "fallbacks": {"default": {"chain": ["small"]}}})
    response = chat(gateway.port, "default")
    assert response.status == 200
    assert response.headers["x-gridgate-model"] == "small"
    assert fallbacks_metric(gateway, "big", "small", "unavailable") == 1


def test_a_chain_is_admitted_once_and_charged_what_its_attempts_cost(valkey_url, mock_provider, gateway_factory):
    """One admission for the whole chain; the first model's 429 costs nothing (a 4xx), the serving model
    its usage; the reservation settles once, for both attempts."""
    from gateway.identity.auth import hash_api_key

    big, small = mock_provider("big", fail_rate=1.0, fail_status=429), mock_provider("small", tokens=5)
    quota = {"backend": {"kind": "valkey", "url": valkey_url}, "reservation_timeout": "2s",
             "rules": [{"name": "models-chain", "budgets": [{"window": "1h", "tokens": 100000}],
                        "estimate": {"default_max_tokens": 10}}]}
    gateway, _ = models_gateway(gateway_factory, {"big": big, "small": small},
                                {"fallbacks": {"big": {"chain": ["small"]}}},
                                auth={"keys": [{"tenant": "t-chain", "key": hash_api_key("sk-chain")}]}, quota=quota)
    response = chat(gateway.port, "big", headers=[("Authorization", "Bearer sk-chain")])
    assert response.status == 200 and response.headers["x-gridgate-model"] == "small"
    admitted = 'gridgate_quota_decisions_total{reason="admitted"}'  # published on the worker's heartbeat
    wait_until(lambda: metric_value(gateway.admin_port, admitted) >= 1, "the admission counted")
    usage = response.json()["usage"]["total_tokens"]
    deadline = time.monotonic() + 5
    while True:  # settled off the response path: the 429 cost nothing, the serving model its usage
        report = json.loads(request("127.0.0.1", gateway.admin_port, "GET", "/admin/quota?tenant=t-chain")[2])
        window = report["rules"][0]["windows"][0]
        if window["reserved"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert (window["reserved"], window["used"]) == (0, usage)
    assert metric_value(gateway.admin_port, admitted) == 1


def test_a_chain_model_the_overlay_does_not_serve_is_skipped(mock_provider, loopback_gateway_factory):
    big, small = mock_provider("big", fail_rate=1.0, fail_status=503), mock_provider("small")
    gateway, log = models_gateway(loopback_gateway_factory, {"big": big, "small": small},
                                  {"fallbacks": {"big": {"chain": ["ghost", "small"], "max_hops": 1}}})
    response = chat(gateway.port, "big", headers=[("X-Request-Id", "ghost")])
    assert response.status == 200, response.body
    assert response.headers["x-gridgate-model"] == "small"
    line = log_line(log, "ghost")
    assert (line["fallback_hops"], line["fallback_skipped"]) == (1, 1)
