"""The request path in one process (tests/inprocess.py): server -> head gate -> proxy -> forwarding ->
relay -> outcomes, with real mock providers on loopback and the session's real Valkey for the quota.

What every exit of a request leaves behind, read back from the parts themselves: the metrics row (at
the moment the last byte was written, too), the ledger (settled once, with what the attempts cost:
docs/configuration.md, "What a request is charged") and the access line.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from gateway.request.estimate import estimate_prompt_tokens
from tests.harness import candidate, envelope
from tests.inprocess import InProcessGateway, Provider, start_provider, until, value

DEFAULT_MAX_TOKENS = 10
FAST_RETRY = {"attempts": 3, "deadline": "10s", "backoff": {"base": "1ms", "max": "5ms"}}
REQUESTS, FIRST_BYTE = "gridgate_requests_total", "gridgate_upstream_first_byte_seconds_count"


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(scenario())


def quota(valkey_url: str) -> dict[str, Any]:
    """One rule metering every request (tenant ``anonymous``), under a name no other test uses; exact
    (no worker-held blocks: each request's own settlement is read back, docs/limits.md)."""
    return {"backend": {"kind": "valkey", "url": valkey_url}, "lease": None,
            "rules": [{"name": f"r-{uuid.uuid4().hex[:8]}", "budgets": [{"window": "1d", "tokens": 10_000_000}],
                       "estimate": {"default_max_tokens": DEFAULT_MAX_TOKENS}}]}


async def gateway_for(tmp_path: Path, providers: list[Provider], valkey_url: str | None = None,
                      mode: str = "deterministic", **extra: Any) -> InProcessGateway:
    """The providers are candidates of model ``m`` in their order (groups 0, 1, ...)."""
    overlay = envelope([candidate("m", p.name, group=i) for i, p in enumerate(providers)], mode)
    config = {"routing": {"retry": FAST_RETRY}, **extra}
    if valkey_url is not None:
        config["quota"] = quota(valkey_url)
    return await InProcessGateway.start(tmp_path, {p.name: [p.address] for p in providers}, overlay,
                                        quota_url=valkey_url, extra=config)


def estimate(max_tokens: int | None = None, **fields: Any) -> int:
    """The reservation of ``gateway.chat("m", **fields)`` (the client sends json.dumps of its body)."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    allowance = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    return estimate_prompt_tokens(len(json.dumps(body).encode())) + allowance


def only_line(gateway: InProcessGateway) -> dict[str, Any]:
    lines = gateway.access_lines()
    assert len(lines) == 1, lines
    return lines[0]


# -- counted before the last byte ------------------------------------------------------------------------

def test_the_metrics_count_a_response_before_its_last_byte_is_written(tmp_path):
    """A client that reads /metrics right after its answer finds it counted (the flaky e2e check)."""
    async def scenario() -> None:
        provider = await start_provider("p", tokens=5)
        gateway = await gateway_for(tmp_path, [provider])
        try:
            for stream in (False, True):
                client = gateway.connect()
                client.send("POST", "/v1/chat/completions",
                            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream})
                answer = await client.answered()
                assert answer.status == 200 and (b"[DONE]" in answer.body) == stream
                seen = client.transport.seen_when_complete()  # the samples when its last byte was written
                expected = 2.0 if stream else 1.0
                assert value(seen, REQUESTS, cluster="p", code="2xx") == expected
                assert value(seen, FIRST_BYTE, cluster="p") == expected
                assert value(seen, "gridgate_overhead_seconds_count") == expected
        finally:
            await gateway.close()

    run(scenario)


# -- settled once, with what the attempts cost -----------------------------------------------------------

def test_a_served_request_is_charged_its_usage_and_logged_with_every_field(tmp_path, valkey_url):
    async def scenario() -> None:
        provider = await start_provider("p", tokens=7)
        gateway = await gateway_for(tmp_path, [provider], valkey_url)
        try:
            answer = await gateway.chat(max_tokens=100, headers=[("X-Request-Id", "served")])
            usage = answer.json()["usage"]
            assert answer.status == 200 and usage["completion_tokens"] == 7
            window = await gateway.used()
            assert (window["used"], window["reserved"]) == (usage["total_tokens"], 0)
            line = only_line(gateway)
            assert {k: line[k] for k in ("request_id", "status", "provider", "attempts", "endpoint", "error",
                                         "capability", "tenant", "tokens_prompt", "tokens_completion")} == {
                "request_id": "served", "status": 200, "provider": "p", "attempts": 1, "endpoint": provider.address,
                "error": None, "capability": "m", "tenant": "anonymous",
                "tokens_prompt": usage["prompt_tokens"], "tokens_completion": 7}
            assert line["bytes_out"] == len(answer.body) and line["bytes_in"] > 0
            assert 0 < line["overhead_ms"] <= line["first_byte_ms"] <= line["duration_ms"]
            assert value(gateway.samples(), REQUESTS, cluster="p", code="2xx") == 1
        finally:
            await gateway.close()

    run(scenario)


def test_a_provider_4xx_costs_nothing_and_a_5xx_the_estimate(tmp_path, valkey_url):
    async def scenario() -> None:
        provider = await start_provider("p")
        gateway = await gateway_for(tmp_path, [provider], valkey_url)
        try:
            refused = await gateway.chat(max_tokens=300, headers=[("X-Mock-Status", "400")])
            assert refused.status == 400
            assert (await gateway.used())["used"] == 0
            failed = await gateway.chat(max_tokens=300, headers=[("X-Mock-Status", "500")])
            assert failed.status == 500
            window = await gateway.used()
            assert (window["used"], window["reserved"]) == (estimate(300), 0)
            lines = gateway.access_lines()
            assert [(line["status"], line["provider"], line["error"]) for line in lines] == [
                (400, "p", None), (500, "p", None)]  # the provider's answers, passed through
            samples = gateway.samples()
            assert value(samples, REQUESTS, cluster="p", code="4xx") == 1
            assert value(samples, REQUESTS, cluster="p", code="5xx") == 1
        finally:
            await gateway.close()

    run(scenario)


def test_failover_serves_from_the_next_provider_and_charges_each_attempt(tmp_path, valkey_url):
    async def scenario() -> None:
        busy = await start_provider("busy", fail_rate=1.0, fail_status=503, retry_after="7")
        good = await start_provider("good", tokens=4)
        gateway = await gateway_for(tmp_path, [busy, good], valkey_url)
        try:
            answer = await gateway.chat(max_tokens=200)
            assert (answer.status, answer.headers["x-gridgate-provider"], answer.headers["x-gridgate-attempts"]) == (
                200, "good", "2")
            assert (busy.served, good.served) == (1, 1)
            # The 503 may have worked: the estimate; the 200: its usage.
            assert (await gateway.used())["used"] == estimate(200) + answer.json()["usage"]["total_tokens"]
            line = only_line(gateway)
            assert (line["provider"], line["attempts"], line["endpoint"], line["error"]) == (
                "good", 2, good.address, None)
            samples = gateway.samples()
            assert value(samples, "gridgate_provider_failovers_total", cluster="busy") == 1
            assert value(samples, "gridgate_provider_cooled_total", cluster="busy") == 1
            assert value(samples, FIRST_BYTE, cluster="busy") is None  # held, never relayed
            assert value(samples, REQUESTS, cluster="good", code="2xx") == 1
            # A held answer is not the request's: only the answer the client got is counted.
            assert not any(value(samples, REQUESTS, cluster="busy", code=code) for code in ("2xx", "4xx", "5xx"))
        finally:
            await gateway.close()

    run(scenario)


def test_every_provider_failing_is_the_last_one_s_answer_and_costs_what_each_attempt_did(tmp_path, valkey_url):
    async def scenario() -> None:
        limited = await start_provider("limited", fail_rate=1.0, fail_status=429)
        busy = await start_provider("busy", fail_rate=1.0, fail_status=503)
        gateway = await gateway_for(tmp_path, [limited, busy], valkey_url)
        try:
            answer = await gateway.chat(max_tokens=200)
            assert (answer.status, answer.headers["x-gridgate-provider"], answer.headers["x-gridgate-attempts"]) == (
                503, "busy", "2")
            assert answer.json()["error"]["code"] == "upstream_unavailable"
            assert (await gateway.used())["used"] == estimate(200)  # the 429 nothing, the 503 the estimate
            line = only_line(gateway)
            assert (line["status"], line["provider"], line["attempts"], line["error"]) == (
                503, "busy", 2, "upstream_unavailable")
            assert value(gateway.samples(), REQUESTS, cluster="busy", code="5xx") == 1
        finally:
            await gateway.close()

    run(scenario)


def test_a_stream_the_provider_cuts_ends_with_an_error_event_and_costs_the_estimate(tmp_path, valkey_url):
    async def scenario() -> None:
        provider = await start_provider("p", tokens=6)
        gateway = await gateway_for(tmp_path, [provider], valkey_url)
        try:
            answer = await gateway.chat(max_tokens=300, stream=True, headers=[("X-Mock-Reset", "mid")])
            assert answer.status == 200 and b"upstream_reset" in answer.body and b"[DONE]" not in answer.body
            assert (await gateway.used())["used"] == estimate(300, stream=True)
            line = only_line(gateway)
            assert (line["status"], line["error"], line["bytes_out"]) == (200, "upstream_reset", len(answer.body))
        finally:
            await gateway.close()

    run(scenario)


def test_a_client_gone_before_the_answer_is_499_and_costs_the_estimate(tmp_path, valkey_url):
    async def scenario() -> None:
        provider = await start_provider("p", latency_ms=3000)
        gateway = await gateway_for(tmp_path, [provider], valkey_url)
        try:
            client = gateway.connect()
            client.send("POST", "/v1/chat/completions",
                        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 300})
            await until(lambda: provider.state.in_flight == 1, "the request reached the provider")
            clusters = gateway.path.clusters
            assert clusters.inflight(0) == 1  # the endpoint lease is held while the attempt runs
            client.hang_up()
            window = await until_settled(gateway)
            assert clusters.inflight(0) == 0  # and given back when it ends
            assert window["used"] == estimate(300)  # the provider may be working on it
            line = only_line(gateway)
            assert (line["status"], line["error"], line["provider"], line["endpoint"], line["attempts"]) == (
                499, "client_closed", "p", provider.address, 1)
            samples = gateway.samples()
            assert not any(value(samples, REQUESTS, cluster=cluster, code=code)  # nothing was answered
                           for cluster in ("p", "gateway") for code in ("2xx", "4xx", "5xx"))
        finally:
            await gateway.close()

    run(scenario)


def test_a_client_gone_in_the_middle_of_a_stream_pays_one_token_per_event_it_was_sent(tmp_path, valkey_url):
    async def scenario() -> None:
        provider = await start_provider("p", tokens=400, tokens_per_s=200)
        gateway = await gateway_for(tmp_path, [provider], valkey_url)
        try:
            client = gateway.connect()
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
            client.send("POST", "/v1/chat/completions", body)
            await until(lambda: (a := client.answer()) is not None and a.body.count(b"data:") >= 60, "60 events")
            client.hang_up()
            relayed = client.answer().body  # type: ignore[union-attr]
            window = await until_settled(gateway)
            # No usage arrived: the prompt plus the events relayed, more than the estimate (prompt + 10).
            assert window["used"] == estimate_prompt_tokens(len(json.dumps(body))) + relayed.count(b"data:")
            assert window["used"] > estimate(stream=True)
            line = only_line(gateway)
            assert (line["status"], line["error"], line["bytes_out"]) == (200, "client_closed", len(relayed))
            assert value(gateway.samples(), REQUESTS, cluster="p", code="2xx") == 1
        finally:
            await gateway.close()

    run(scenario)


def test_a_stream_still_open_at_the_graceful_deadline_ends_with_an_error_event_and_its_line_says_so(
        tmp_path, valkey_url):
    async def scenario() -> None:
        provider = await start_provider("p", tokens=400, tokens_per_s=200)
        gateway = await gateway_for(tmp_path, [provider], valkey_url)
        try:
            client = gateway.connect()
            client.send("POST", "/v1/chat/completions",
                        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                         "max_tokens": 1000})
            await until(lambda: (a := client.answer()) is not None and a.body.count(b"data:") >= 20, "20 events")
            await gateway.state.cut_remaining()
            answer = await client.answered()
            assert b"gateway_shutdown" in answer.body and b"[DONE]" not in answer.body
            assert (await until_settled(gateway))["used"] == estimate(1000, stream=True)  # no usage arrived
            line = only_line(gateway)
            assert (line["status"], line["error"]) == (200, "gateway_shutdown")
        finally:
            await gateway.close()

    run(scenario)


async def until_settled(gateway: InProcessGateway) -> dict[str, Any]:
    """The ledger's window once the request's reservation is settled (its handler ends on its own)."""
    deadline = asyncio.get_running_loop().time() + 10
    while True:
        window = await gateway.used()
        if window["reserved"] == 0:
            return window
        assert asyncio.get_running_loop().time() < deadline, window
        await asyncio.sleep(0.01)


# -- answers the gateway makes itself ----------------------------------------------------------------------

def test_gateway_made_answers_are_counted_and_logged_once(tmp_path, valkey_url):
    async def scenario() -> None:
        provider = await start_provider("p")
        gateway = await gateway_for(tmp_path, [provider], valkey_url)
        try:
            unknown = await gateway.chat("no-such-model", headers=[("X-Request-Id", "unknown")])
            outside = await gateway.request("POST", "/v1/admin/keys", {}, [("X-Request-Id", "outside")])
            listing = await gateway.request("GET", "/v1/models", headers=[("X-Request-Id", "listing")])
            assert (unknown.status, outside.status, listing.status) == (404, 404, 200)
            by_id = {line["request_id"]: line for line in gateway.access_lines()}
            assert (by_id["unknown"]["status"], by_id["unknown"]["error"], by_id["unknown"]["capability"]) == (
                404, "model_not_found", "no-such-model")
            assert (by_id["outside"]["status"], by_id["outside"]["error"]) == (404, "route_not_allowed")
            assert (by_id["listing"]["status"], by_id["listing"]["path"], by_id["listing"]["bytes_out"]) == (
                200, "/v1/models", len(listing.body))
            samples = gateway.samples()
            assert value(samples, REQUESTS, cluster="gateway", code="4xx") == 2
            assert value(samples, REQUESTS, cluster="gateway", code="2xx") == 1
            assert (await gateway.used())["used"] == 0 and provider.served == 0
        finally:
            await gateway.close()

    run(scenario)
