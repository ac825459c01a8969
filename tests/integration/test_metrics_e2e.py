"""/metrics through a real gateway, real mock providers and the bundled Valkey: the upstream latency
histograms count exactly the responses relayed, failovers and cooling count under the provider that
failed, and the per-tenant token counters grow by the usage the providers reported."""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

from tests.harness import admin_get, candidate, chat, envelope, refused_port
from tests.integration.test_quota_e2e import _auth, _bearer, _quota

FAST_RETRY = {"attempts": 3, "deadline": "10s", "backoff": {"base": "1ms", "max": "5ms"}}
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(admin_port: int) -> Samples:
    """Every sample of /metrics, parsed by prometheus_client: (name, sorted labels) -> value."""
    status, _, body = admin_get(admin_port, "/metrics")
    assert status == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def eventually(admin_port: int, check: Callable[[Samples], bool], timeout: float = 5.0) -> Samples:
    """The scrape once ``check`` holds (counters copied from a worker's heartbeat lag up to a second)."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(admin_port)
        if check(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)


def test_latency_histograms_count_every_relayed_response_under_its_cluster(mock_provider, gateway_factory):
    slow = mock_provider("slow", latency_ms=30, tokens=8, tokens_per_s=100)  # head after 30 ms, 70 ms of tokens
    quick = mock_provider("quick")
    overlay = envelope([candidate("m", "slow"), candidate("n", "quick")])
    gateway = gateway_factory({"slow": [slow.address], "quick": [quick.address]}, overlay, workers=2)
    sent = 6
    for _ in range(sent):  # spread by the kernel over both workers: the scrape sums them
        response = chat(gateway.port, "m", stream=True)
        assert response.status == 200 and response.headers["x-gridgate-provider"] == "slow"
        assert b"data: [DONE]" in response.body
    assert chat(gateway.port, "n").status == 200
    samples = scrape(gateway.admin_port)

    first, duration = "gridgate_upstream_first_byte_seconds", "gridgate_upstream_duration_seconds"
    assert value(samples, f"{first}_count", cluster="slow") == sent
    assert value(samples, f"{duration}_count", cluster="slow") == sent
    assert value(samples, f"{first}_count", cluster="quick") == 1
    assert value(samples, f"{duration}_count", cluster="quick") == 1
    assert value(samples, "gridgate_requests_total", cluster="slow", code="2xx") == sent
    # Every head came after the mock's 30 ms, every stream ended after 70 ms more of tokens.
    assert value(samples, f"{first}_bucket", cluster="slow", le="0.025") == 0
    assert value(samples, f"{first}_sum", cluster="slow") >= sent * 0.03
    assert value(samples, f"{duration}_bucket", cluster="slow", le="0.05") == 0
    assert value(samples, f"{duration}_sum", cluster="slow") >= value(samples, f"{first}_sum", cluster="slow") + sent * 0.05
    assert value(samples, f"{first}_bucket", cluster="slow", le="+Inf") == sent


def test_a_failover_counts_under_the_provider_that_failed_and_only_the_served_response_is_timed(
        mock_provider, gateway_factory):
    busy = mock_provider("busy", fail_rate=1.0, fail_status=503, retry_after="7")
    good = mock_provider("good")
    dead = f"127.0.0.1:{refused_port()}"
    overlay = envelope([candidate("m", "busy", group=0), candidate("m", "good", group=1),
                        candidate("split", "half-dead")], mode="deterministic")
    models = [{"match": {"capability": "m", "cluster": "busy"}, "context_window": 4000}]
    gateway = gateway_factory(
        {"busy": [busy.address], "good": [good.address], "half-dead": [dead, good.address]}, overlay,
        extra={"routing": {"retry": FAST_RETRY, "models": models}},
    )
    moved = chat(gateway.port, "m")
    assert moved.status == 200 and moved.headers["x-gridgate-provider"] == "good"
    assert moved.headers["x-gridgate-attempts"] == "2"
    samples = scrape(gateway.admin_port)
    assert value(samples, "gridgate_provider_failovers_total", cluster="busy") == 1
    assert value(samples, "gridgate_provider_failovers_total", cluster="good") == 0
    assert value(samples, "gridgate_provider_cooled_total", cluster="busy") == 1
    assert value(samples, "gridgate_upstream_first_byte_seconds_count", cluster="good") == 1
    assert value(samples, "gridgate_upstream_first_byte_seconds_count", cluster="busy") is None  # held, not relayed
    assert value(samples, "gridgate_upstream_retries_total") == 0  # a provider failover is not an endpoint retry

    # Too long for busy's context window: filtered out before the picker, so nothing fails over.
    filtered = chat(gateway.port, "m", max_tokens=100_000)
    assert filtered.status == 200 and filtered.headers["x-gridgate-provider"] == "good"
    assert filtered.headers["x-gridgate-attempts"] == "1" and filtered.headers["x-gridgate-filtered"] == "1"
    samples = scrape(gateway.admin_port)
    assert value(samples, "gridgate_route_filtered_total", reason="context_window") == 1
    assert value(samples, "gridgate_route_filtered_total", reason="region") == 0
    assert value(samples, "gridgate_provider_failovers_total", cluster="busy") == 1

    # Inside one provider: a refused endpoint, then the live one (round robin starts on either).
    for _ in range(4):
        response = chat(gateway.port, "split")
        assert response.status == 200 and response.headers["x-gridgate-attempts"] == "1"
    samples = scrape(gateway.admin_port)
    assert value(samples, "gridgate_upstream_retries_total") >= 1
    assert value(samples, "gridgate_provider_failovers_total", cluster="half-dead") == 0
    assert value(samples, "gridgate_upstream_first_byte_seconds_count", cluster="half-dead") == 4


def test_tenant_tokens_grow_by_the_usage_the_provider_reported(valkey_url, mock_provider, gateway_factory):
    handle = mock_provider("p", tokens=12)
    gateway = gateway_factory(
        {"p": [handle.address]}, envelope([candidate("m", "p")]), workers=2,
        extra={"auth": _auth({"team-a": "sk-a", "team-b": "sk-b"}), "quota": _quota(valkey_url, 10**6)},
    )
    reported = {"team-a": [0, 0], "team-b": [0, 0]}
    for tenant, key, count in (("team-a", "sk-a", 3), ("team-b", "sk-b", 2)):
        for n in range(count):
            response = chat(gateway.port, "m", headers=_bearer(key), max_tokens=20,
                            messages=[{"role": "user", "content": "word " * (10 * (n + 1))}])
            assert response.status == 200
            usage = response.json()["usage"]
            reported[tenant][0] += usage["prompt_tokens"]
            reported[tenant][1] += usage["completion_tokens"]
    assert reported["team-a"][1] == 36 and reported["team-a"][0] > reported["team-b"][0] > 0

    def counted(samples: Samples) -> dict[str, list[float | None]]:
        return {tenant: [value(samples, "gridgate_tenant_tokens_total", tenant=tenant, direction=direction)
                         for direction in ("in", "out")] for tenant in ("team-a", "team-b")}

    samples = eventually(gateway.admin_port, lambda s: counted(s) == reported)
    assert counted(samples) == reported
    assert value(samples, "gridgate_tenant_tokens_total", tenant="other", direction="in") == 0


def test_policy_refusals_count_as_gateway_errors_by_status(providers, gateway_factory):
    """403 model_not_allowed and 422 no_eligible_provider are answered by the gateway itself: counted."""
    keys = {"team": "sk-team"}
    models = [{"match": {"capability": "m"}, "features": []}]  # no candidate takes tools
    overlay = envelope([candidate("m", "provider-a"), candidate("other", "provider-a")])
    gateway = gateway_factory({"provider-a": [providers["provider-a"].address]}, overlay, extra={
        "auth": _auth(keys), "tenants": [{"tenant": "team", "allowed_capabilities": ["m"]}],
        "routing": {"models": models},
    })
    forbidden = chat(gateway.port, "other", headers=_bearer("sk-team"))
    assert forbidden.status == 403 and forbidden.json()["error"]["code"] == "model_not_allowed"
    tools = [{"type": "function", "function": {"name": "f"}}]
    for _ in range(2):
        unroutable = chat(gateway.port, "m", headers=_bearer("sk-team"), tools=tools)
        assert unroutable.status == 422 and unroutable.json()["error"]["code"] == "no_eligible_provider"
    samples = scrape(gateway.admin_port)
    assert value(samples, "gridgate_gateway_errors_total", status="403") == 1
    assert value(samples, "gridgate_gateway_errors_total", status="422") == 2
    assert value(samples, "gridgate_requests_total", cluster="gateway", code="4xx") == 3
