"""What a request is charged (docs/configuration.md, "What a request is charged"), end to end: real
gateways, real mock providers (or a scripted upstream where the mock cannot say it), the bundled
Valkey, and the ledger's used tokens read back from /admin/quota."""

from __future__ import annotations

import gzip
import json
import socket
import socketserver
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import pytest

from gateway.request.estimate import estimate_prompt_tokens
from tests.harness import admin_get, candidate, chat, envelope, metric_value, mock_served, wait_until

FAST_RETRY = {"attempts": 3, "deadline": "10s", "backoff": {"base": "1ms", "max": "5ms"}}
DEFAULT_MAX_TOKENS = 10
FAST_LEASE = {"ttl": "100ms"}  # blocks as by default, but given back 0.1 s after their last request
HI = [{"role": "user", "content": "hi"}]


def metered(gateway_factory, valkey_url: str, clusters: dict[str, list[str]], *, routing: dict | None = None,
            tokens: int = 10_000_000, timeout: str = "2m", lease: dict | None = None, **rule: Any):
    """A gateway whose one quota rule meters every request (tenant ``anonymous``); the providers are
    tried in the order of ``clusters``. Worker-held blocks live ``FAST_LEASE`` unless ``lease`` says:
    what a block did not use goes back when it ends, and ``ledger`` waits for that (the default 1 s)."""
    config: dict[str, Any] = {
        "backend": {"kind": "valkey", "url": valkey_url}, "reservation_timeout": timeout,
        "rules": [{"name": f"r-{uuid.uuid4().hex[:8]}", "budgets": [{"window": "1d", "tokens": tokens}],
                   "estimate": {"default_max_tokens": DEFAULT_MAX_TOKENS}, **rule}],
        "lease": FAST_LEASE if lease is None else lease,
    }
    overlay = envelope([candidate("m", name) for name in clusters], mode="deterministic")
    return gateway_factory(clusters, overlay, extra={"quota": config, "routing": {"retry": FAST_RETRY, **(routing or {})}})


def estimate(max_tokens: int | None = None, **fields: Any) -> int:
    """The reservation of ``chat(port, "m", ...)`` with these fields (the harness sends json.dumps)."""
    body = {"model": "m", "messages": HI, **fields}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return estimate_prompt_tokens(len(json.dumps(body))) + (DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens)


def ledger(gateway, timeout: float = 10.0) -> dict:
    """The tenant's first window once nothing is reserved any more (settling is off the response path)."""
    deadline = time.monotonic() + timeout
    while True:
        report = json.loads(admin_get(gateway.admin_port, "/admin/quota?tenant=anonymous")[2])
        window = report["rules"][0]["windows"][0]
        if window["reserved"] == 0 or time.monotonic() > deadline:
            return {**window, "in_flight": report["rules"][0]["in_flight"]}
        time.sleep(0.02)


def used(gateway) -> int:
    return ledger(gateway)["used"]


def dechunk(data: bytes) -> bytes:
    """The payload of a chunked body, as far as it arrived."""
    out, pos = [], 0
    while (end := data.find(b"\r\n", pos)) >= 0:
        size, start = int(data[pos:end], 16), end + 2
        out.append(data[start:start + size])
        pos = start + size + 2
        if size == 0 or pos > len(data):
            break
    return b"".join(out)


# -- a provider that answers exactly what a test scripts (the mock cannot put usage in an error) ---------

class ScriptedUpstream:
    """A one-request-per-connection HTTP/1.1 server: ``respond(head, body)`` returns the response bytes."""

    def __init__(self, respond: Callable[[bytes, bytes], bytes]) -> None:
        self.requests: list[bytes] = []
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = self.request.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                head, _, body = data.partition(b"\r\n\r\n")
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(body) < length:
                    body += self.request.recv(65536)
                outer.requests.append(head)
                self.request.sendall(respond(head, body))

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextmanager
def scripted(respond: Callable[[bytes, bytes], bytes]) -> Iterator[ScriptedUpstream]:
    upstream = ScriptedUpstream(respond)
    try:
        yield upstream
    finally:
        upstream.stop()


def http_response(status: int, body: bytes, *headers: bytes) -> bytes:
    return (b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n"
            % (status, len(body)) + b"".join(h + b"\r\n" for h in headers) + b"\r\n" + body)


# -- charge only for work done (issue 21, item 7) ---------------------------------------------------------

def test_a_provider_4xx_without_usage_costs_nothing(valkey_url, mock_provider, gateway_factory):
    handle = mock_provider("p")
    gateway = metered(gateway_factory, valkey_url, {"p": [handle.address]})
    assert chat(gateway.port, "m", headers=[("X-Mock-Status", "400")], max_tokens=500).status == 400
    assert used(gateway) == 0  # was the estimate (521 in the issue's example)


def test_a_request_every_provider_answered_429_costs_nothing(valkey_url, mock_provider, gateway_factory):
    handles = {name: mock_provider(name, fail_rate=1.0, fail_status=429) for name in ("a", "b", "c")}
    gateway = metered(gateway_factory, valkey_url, {name: [h.address] for name, h in handles.items()})
    response = chat(gateway.port, "m", max_tokens=500)
    assert response.status == 429 and response.headers["x-gridgate-attempts"] == "3"
    assert all(mock_served(h) == 1 for h in handles.values())
    assert used(gateway) == 0


def test_a_5xx_without_usage_costs_the_estimate(valkey_url, mock_provider, gateway_factory):
    handle = mock_provider("p")
    gateway = metered(gateway_factory, valkey_url, {"p": [handle.address]})
    assert chat(gateway.port, "m", headers=[("X-Mock-Status", "500")], max_tokens=500).status == 500
    assert used(gateway) == estimate(500)


def test_a_request_that_failed_over_pays_for_each_attempt(valkey_url, mock_provider, gateway_factory):
    # A 429 (nothing), then a 503 (it may have worked: the estimate), then a 200 with its usage.
    refusing = mock_provider("refusing", fail_rate=1.0, fail_status=429)
    failing = mock_provider("failing", fail_rate=1.0, fail_status=503)
    good = mock_provider("good", tokens=5)
    gateway = metered(gateway_factory, valkey_url, {"refusing": [refusing.address], "failing": [failing.address],
                                                    "good": [good.address]})
    response = chat(gateway.port, "m", max_tokens=500)
    assert response.status == 200 and response.headers["x-gridgate-attempts"] == "3"
    assert used(gateway) == estimate(500) + response.json()["usage"]["total_tokens"]


def test_a_timeout_before_the_head_costs_the_estimate(valkey_url, mock_provider, gateway_factory):
    handle = mock_provider("p")
    gateway = metered(gateway_factory, valkey_url, {"p": [handle.address]},
                      routing={"retry": {**FAST_RETRY, "first_byte_timeout": "300ms"}})
    assert chat(gateway.port, "m", headers=[("X-Mock-Stall-Ms", "3000")], max_tokens=500).status == 504
    assert used(gateway) == estimate(500)


def test_a_stream_cut_by_the_provider_without_usage_costs_the_estimate(valkey_url, mock_provider, gateway_factory):
    handle = mock_provider("p", tokens=4)  # cut after two: what was relayed is less than the estimate
    gateway = metered(gateway_factory, valkey_url, {"p": [handle.address]})
    response = chat(gateway.port, "m", headers=[("X-Mock-Reset", "mid")], max_tokens=500, stream=True)
    assert response.status == 200 and b"upstream_reset" in response.body  # ended with an error event
    assert used(gateway) == estimate(500, stream=True)


@pytest.mark.parametrize("status", [400, 429, 500, 200])
def test_a_response_that_reports_usage_is_charged_that_usage_whatever_its_status(
        status, valkey_url, gateway_factory):
    body = json.dumps({"error": {"message": "no", "type": "x", "code": "y"},
                       "usage": {"prompt_tokens": 30, "completion_tokens": 3, "total_tokens": 33}}).encode()
    with scripted(lambda head, _: http_response(status, body)) as upstream:
        gateway = metered(gateway_factory, valkey_url, {"p": [upstream.address]},
                          routing={"retry": {**FAST_RETRY, "attempts": 1}})
        assert chat(gateway.port, "m", max_tokens=500).status == status
        assert used(gateway) == 33


# -- a client that hangs up near the end (issue 27, finding 5) ----------------------------------------------

def test_a_client_that_hangs_up_near_the_end_of_a_stream_pays_for_the_tokens_relayed(
        valkey_url, mock_provider, gateway_factory):
    handle = mock_provider("p", tokens=600, tokens_per_s=200)  # three seconds
    gateway = metered(gateway_factory, valkey_url, {"p": [handle.address]})
    payload = json.dumps({"model": "m", "messages": HI, "stream": True}).encode()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: g\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\n\r\n" % len(payload)) + payload
    received, tokens = b"", 0
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as sock:
        sock.sendall(request)
        while tokens < 500:  # most of the stream (half a second before its end), not all of it
            chunk = sock.recv(65536)
            assert chunk, received[-300:]
            received += chunk
            tokens += chunk.count(b'"content"')
        assert b"[DONE]" not in received
    body_bytes = len(dechunk(received.partition(b"\r\n\r\n")[2]))
    assert body_bytes > 50 * tokens  # the SSE framing: some 200 bytes a token
    charged = used(gateway)
    prompt = estimate_prompt_tokens(len(payload))
    # At least the estimate, and every token the client received (one per data event relayed) ...
    assert charged >= estimate(stream=True) and charged >= prompt + tokens
    # ... and not the body bytes' tokens (four bytes a token): 27,000 and more, for 500 tokens relayed.
    assert charged < 2 * (prompt + tokens), (charged, prompt, tokens)


# -- the estimate takes the largest allowance (issue 27, finding 4) -----------------------------------------

def test_a_small_max_tokens_beside_a_large_max_completion_tokens_is_reserved_in_full(
        valkey_url, mock_provider, gateway_factory):
    handle = mock_provider("p", latency_ms=3000)  # all ten are in flight together
    gateway = metered(gateway_factory, valkey_url, {"p": [handle.address]}, tokens=50_000)
    fields = {"max_tokens": 1, "max_completion_tokens": 20_000}
    with ThreadPoolExecutor(10) as pool:
        statuses = list(pool.map(lambda _: chat(gateway.port, "m", **fields).status, range(10)))
    # 50,000 fits two reservations of 20,000 and some prompt: on main all ten were admitted.
    assert sorted(statuses) == [200] * 2 + [429] * 8, statuses


def test_the_responses_api_s_max_output_tokens_is_reserved(valkey_url, mock_provider, gateway_factory):
    handle = mock_provider("p")
    gateway = metered(gateway_factory, valkey_url, {"p": [handle.address]}, tokens=50_000)
    response = chat(gateway.port, "m", max_output_tokens=30_000)
    assert response.status == 200
    assert int(response.headers["x-ratelimit-remaining-tokens"]) < 20_000
    assert used(gateway) < 100  # refunded down to its usage
    assert chat(gateway.port, "m", max_output_tokens=30_000).status == 200  # the first was refunded
    assert chat(gateway.port, "m", max_output_tokens=60_000).status == 429  # can never fit


def test_the_context_window_filter_uses_the_same_largest_allowance(providers, gateway_factory):
    models = [{"match": {"capability": "m"}, "context_window": 10_000}]
    gateway = gateway_factory({"provider-a": [providers["provider-a"].address]},
                              envelope([candidate("m", "provider-a")]), extra={"routing": {"models": models}})
    for fields in ({"max_tokens": 1, "max_completion_tokens": 20_000}, {"max_output_tokens": 20_000}):
        response = chat(gateway.port, "m", **fields)
        assert response.status == 400 and response.json()["error"]["code"] == "context_length_exceeded", fields
    assert chat(gateway.port, "m", max_tokens=1, max_completion_tokens=9_000).status == 200


# -- metered requests ask for an uncompressed answer (issue 27, finding 7) ---------------------------------

def _gzip_when_asked(head: bytes, _: bytes) -> bytes:
    body = json.dumps({"choices": [], "usage": {"prompt_tokens": 39_990, "completion_tokens": 10,
                                                "total_tokens": 40_000}}).encode()
    if b"accept-encoding: gzip" in head.lower():
        return http_response(200, gzip.compress(body), b"content-encoding: gzip")
    return http_response(200, body)


def test_metered_requests_ask_for_identity_so_the_usage_is_read(valkey_url, gateway_factory):
    with scripted(_gzip_when_asked) as upstream:
        gateway = metered(gateway_factory, valkey_url, {"p": [upstream.address]})
        response = chat(gateway.port, "m", headers=[("Accept-Encoding", "gzip, deflate")], max_tokens=5)
        assert response.status == 200 and "content-encoding" not in response.headers
        assert used(gateway) == 40_000  # was 9: the usage in a gzip body is never found
        assert b"accept-encoding: identity" in upstream.requests[-1].lower()


def test_unmetered_requests_keep_the_client_s_accept_encoding(providers, gateway_factory):
    gateway = gateway_factory({"provider-a": [providers["provider-a"].address]}, envelope([candidate("m", "provider-a")]))
    response = chat(gateway.port, "m", headers=[("Accept-Encoding", "gzip"), ("X-Mock-Echo", "1")])
    seen = [value for name, value in response.json()["mock_echo"]["headers"] if name.lower() == "accept-encoding"]
    assert seen == ["gzip"]


# -- a request that outlives quota.reservation_timeout (issue 27, finding 6) -------------------------------

def test_a_stream_longer_than_the_reservation_timeout_keeps_its_slot_and_is_charged_its_usage(
        valkey_url, mock_provider, gateway_factory):
    handle = mock_provider("p", tokens=300, tokens_per_s=100)  # a three-second stream
    gateway = metered(gateway_factory, valkey_url, {"p": [handle.address]}, timeout="1s", max_in_flight=1)
    results: list[Any] = []
    streaming = threading.Thread(target=lambda: results.append(chat(gateway.port, "m", stream=True, max_tokens=500)))
    streaming.start()
    time.sleep(2.0)  # twice the timeout: on main the reservation had expired, and its slot with it
    second = chat(gateway.port, "m", max_tokens=5)
    assert second.status == 429 and second.json()["error"]["message"].startswith("Too many concurrent")
    streaming.join()
    assert results[0].status == 200 and b"[DONE]" in results[0].body
    window = ledger(gateway)
    assert window["in_flight"] == 0
    # The usage (prompt + 300), not the estimate (prompt + 500) it was charged on main.
    assert 300 < window["used"] < estimate(500, stream=True)


def test_a_leased_block_outliving_the_reservation_timeout_is_settled_with_what_its_requests_used(
        valkey_url, mock_provider, gateway_factory):
    handle = mock_provider("p", tokens=300, tokens_per_s=100)  # a three-second stream
    gateway = metered(gateway_factory, valkey_url, {"p": [handle.address]}, timeout="1s",
                      lease={"tokens": 5000, "ttl": "1s", "headroom": 2})
    assert chat(gateway.port, "m", max_tokens=5).status == 200  # the ledger admits; a block is taken
    response = chat(gateway.port, "m", stream=True, max_tokens=500)  # admitted from the block
    assert response.status == 200 and b"[DONE]" in response.body
    wait_until(lambda: metric_value(gateway.admin_port, 'gridgate_quota_leases_total{event="admitted"}') >= 1,
               "the stream admitted from the block")
    # Both requests' usage; on main the block's reservation expired mid-stream: charged all 5,000 more.
    assert used(gateway) < 600
