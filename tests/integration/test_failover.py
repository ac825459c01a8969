"""Provider failover (docs/routing.md#failover) through a real gateway and real mock providers.

A provider's failure before any response byte moves the request to the next provider; the client
sees one answer, with ``x-gridgate-attempts`` saying how many providers were tried.
"""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from loadtest.fault_proxy import FaultProxyThread
from tests.harness import Client, admin_get, candidate, chat, envelope, mock_served, refused_port, request

FAST_RETRY = {"routing": {"retry": {"attempts": 3, "deadline": "10s", "backoff": {"base": "1ms", "max": "5ms"}}}}


def deterministic(*clusters: str, groups: list[int] | None = None) -> dict:
    """An overlay trying ``clusters`` in this order (deterministic picker: the first usable one first)."""
    return envelope([candidate("m", name, group=(groups[i] if groups else 0)) for i, name in enumerate(clusters)],
                    mode="deterministic")


def admin_config(handle, **settings) -> None:
    status, _, body = request("127.0.0.1", handle.port, "POST", "/admin/config", settings)
    assert status == 200, body


FAILURES = {
    "refused": {},
    "reset_before_head": {"reset_rate": 1.0},
    "502": {"fail_rate": 1.0, "fail_status": 502},
    "503": {"fail_rate": 1.0, "fail_status": 503},
    "504": {"fail_rate": 1.0, "fail_status": 504},
    "429": {"fail_rate": 1.0, "fail_status": 429},
    "first_byte_timeout": {"stall_rate": 1.0, "stall_ms": 5000},
}


@pytest.mark.parametrize("kind", sorted(FAILURES))
def test_each_failure_kind_fails_over_inside_one_request(kind, mock_provider, loopback_gateway_factory):
    good = mock_provider("good")
    bad_address = f"127.0.0.1:{refused_port()}" if kind == "refused" else mock_provider("bad", **FAILURES[kind]).address
    extra = {"routing": {"retry": {**FAST_RETRY["routing"]["retry"], "first_byte_timeout": "300ms"}}}
    gateway = loopback_gateway_factory({"bad": [bad_address], "good": [good.address]}, deterministic("bad", "good"),
                              extra=extra)
    started = time.monotonic()
    response = chat(gateway.port, "m")
    assert response.status == 200, response.body
    assert response.headers["x-gridgate-provider"] == "good"
    assert response.headers["x-gridgate-attempts"] == "2"
    assert b'"choices"' in response.body
    assert mock_served(good) == 1
    assert time.monotonic() - started < 3  # the stall was cut by first_byte_timeout, not read_timeout


def test_connect_timeout_fails_over_inside_one_request(mock_provider, gateway_factory):
    good = mock_provider("good")
    hole = FaultProxyThread(good.address).start()  # a black hole in front of a real provider
    try:
        hole.set_fault(on_connect="blackhole")
        gateway = gateway_factory({"bad": [hole.address], "good": [good.address]}, deterministic("bad", "good"),
                                  extra=FAST_RETRY, cluster_options={"connect_timeout": "300ms"})
        started = time.monotonic()
        response = chat(gateway.port, "m")
        assert response.status == 200 and response.headers["x-gridgate-provider"] == "good"
        assert response.headers["x-gridgate-attempts"] == "2"
        assert 0.25 < time.monotonic() - started < 3
    finally:
        hole.stop()


def test_a_black_holed_endpoint_attracts_only_a_handful_of_concurrent_requests(mock_provider, gateway_factory):
    healthy = [mock_provider(f"healthy-{n}", latency_ms=20) for n in range(4)]
    hole = FaultProxyThread(healthy[0].address).start()
    try:
        hole.set_fault(on_connect="blackhole")
        gateway = gateway_factory(
            {"p": [hole.address, *(h.address for h in healthy)]}, deterministic("p"), extra=FAST_RETRY,
            cluster_options={"connect_timeout": "2s", "load_balancer_strategy": "least_connections"},
        )
        with ThreadPoolExecutor(50) as pool:
            statuses = list(pool.map(lambda _: chat(gateway.port, "m").status, range(50)))
        assert statuses.count(200) == 50
        endpoints = json.loads(admin_get(gateway.admin_port, "/admin/endpoints")[2])["clusters"][0]["endpoints"]
        black_holed = next(e for e in endpoints if e["address"] == hole.address)
        picks = sum(black_holed["failures"].values())
        # Its hanging connects count as in flight, so it gets no more than its share of the 50 (10), not
        # every pick (its in-flight count would otherwise stay 0 while the connects hang).
        assert 1 <= picks <= 12, black_holed
    finally:
        hole.stop()


def test_every_provider_failing_gives_one_clear_error_with_the_last_retry_after(mock_provider, loopback_gateway_factory):
    first = mock_provider("first", fail_rate=1.0, fail_status=502)
    second = mock_provider("second", fail_rate=1.0, fail_status=503)
    gateway = loopback_gateway_factory({"first": [first.address], "second": [second.address]},
                              deterministic("first", "second"), extra=FAST_RETRY)
    response = chat(gateway.port, "m")
    assert response.status == 503
    assert response.headers["x-gridgate-attempts"] == "2"
    assert response.headers["x-gridgate-provider"] == "second"
    assert response.headers["retry-after"] == "1"  # the mock's Retry-After on its 503
    error = response.json()["error"]
    assert error["code"] == "upstream_unavailable" and error["message"] == "second: answered 503"
    assert mock_served(first) == 1 and mock_served(second) == 1


def test_all_refused_names_the_provider_in_plain_words(gateway_factory):
    dead = f"127.0.0.1:{refused_port()}"
    gateway = gateway_factory({"provider-a": [dead]}, deterministic("provider-a"), extra=FAST_RETRY)
    response = chat(gateway.port, "m")
    assert response.status == 502
    assert response.json()["error"]["message"] == "provider-a: connection refused"
    assert response.headers["x-gridgate-provider"] == "provider-a"
    assert response.headers["x-gridgate-attempts"] == "1"
    _, _, metrics = admin_get(gateway.admin_port, "/metrics")
    assert b'gridgate_requests_total{cluster="provider-a",code="5xx"} 1.0' in metrics


def test_a_client_error_from_a_provider_is_returned_once_and_never_retried(mock_provider, loopback_gateway_factory):
    bad = mock_provider("bad", fail_rate=1.0, fail_status=400)
    good = mock_provider("good")
    gateway = loopback_gateway_factory({"bad": [bad.address], "good": [good.address]}, deterministic("bad", "good"),
                              extra=FAST_RETRY)
    response = chat(gateway.port, "m")
    assert response.status == 400 and response.json()["error"]["code"] == "injected_400"
    assert response.headers["x-gridgate-attempts"] == "1"
    assert mock_served(bad) == 1 and mock_served(good) == 0


def test_429_cools_the_provider_in_every_worker_until_retry_after(mock_provider, gateway_factory):
    limited = mock_provider("limited", fail_rate=1.0, fail_status=429)  # the mock sends Retry-After: 1
    good = mock_provider("good")
    gateway = gateway_factory({"limited": [limited.address], "good": [good.address]},
                              deterministic("limited", "good"), workers=2, extra=FAST_RETRY)
    first = chat(gateway.port, "m")
    assert first.status == 200 and first.headers["x-gridgate-attempts"] == "2"
    cooled_at = time.monotonic()
    admin_config(limited, fail_rate=0.0)  # healthy again, but cooled for a second
    served_before = mock_served(limited)
    pids = set()
    while time.monotonic() - cooled_at < 0.7:  # fresh connections: both workers answer some
        response = chat(gateway.port, "m")
        assert response.status == 200 and response.headers["x-gridgate-provider"] == "good"
        assert response.headers["x-gridgate-attempts"] == "1"
        pids.add(response.headers.get("x-request-id", "")[:12])
    assert mock_served(limited) == served_before  # skipped by every worker while cooled
    assert len(pids) == 2  # request ids carry a per-process prefix: both workers were asked
    time.sleep(max(0.0, 1.4 - (time.monotonic() - cooled_at)))
    after = [chat(gateway.port, "m").headers["x-gridgate-provider"] for _ in range(4)]
    assert "limited" in after  # the cooling ended: it serves again


def test_a_stream_cut_midway_ends_with_an_error_event_and_is_not_retried(mock_provider, loopback_gateway_factory):
    cut = mock_provider("cut", mid_reset_rate=1.0, tokens=40)
    good = mock_provider("good")
    gateway = loopback_gateway_factory({"cut": [cut.address], "good": [good.address]}, deterministic("cut", "good"),
                              extra=FAST_RETRY)
    response = chat(gateway.port, "m", stream=True)
    assert response.status == 200
    assert b'"error"' in response.body and b"upstream_reset" in response.body
    assert mock_served(good) == 0


def test_a_session_bound_to_a_failing_provider_moves_and_stays_moved(mock_provider, loopback_gateway_factory):
    a, b = mock_provider("a"), mock_provider("b")
    overlay = envelope([candidate("m", "a"), candidate("m", "b")], mode="roundRobin")
    extra = {"routing": {**FAST_RETRY["routing"], "session_affinity": {"enabled": True}}}
    gateway = loopback_gateway_factory({"a": [a.address], "b": [b.address]}, overlay, extra=extra)
    session = [("X-Session-Id", "s-1")]
    first = chat(gateway.port, "m", headers=session)
    bound = first.headers["x-gridgate-provider"]
    other = "b" if bound == "a" else "a"
    admin_config(a if bound == "a" else b, fail_rate=1.0, fail_status=502)
    moved = chat(gateway.port, "m", headers=session)
    assert moved.status == 200 and moved.headers["x-gridgate-provider"] == other
    assert moved.headers["x-gridgate-attempts"] == "2"
    admin_config(a if bound == "a" else b, fail_rate=0.0)
    for _ in range(4):
        again = chat(gateway.port, "m", headers=session)
        assert (again.headers["x-gridgate-provider"], again.headers["x-gridgate-affinity"]) == (other, "reused")


def test_failover_goes_to_the_next_group_when_the_group_is_exhausted(mock_provider, loopback_gateway_factory):
    bad1 = mock_provider("bad1", fail_rate=1.0, fail_status=502)
    bad2 = mock_provider("bad2", reset_rate=1.0)
    spare = mock_provider("spare")
    gateway = loopback_gateway_factory({"bad1": [bad1.address], "bad2": [bad2.address], "spare": [spare.address]},
                              deterministic("bad1", "bad2", "spare", groups=[0, 0, 1]), extra=FAST_RETRY)
    response = chat(gateway.port, "m")
    assert response.status == 200 and response.headers["x-gridgate-provider"] == "spare"
    assert response.headers["x-gridgate-attempts"] == "3"
    assert response.headers["x-gridgate-selection-group"] == "1"


def test_an_unconfigured_cluster_in_the_overlay_is_never_selected(mock_provider, loopback_gateway_factory):
    good = mock_provider("good")
    overlay = envelope([candidate("m", "elsewhere"), candidate("m", "good")], mode="roundRobin")
    gateway = loopback_gateway_factory({"good": [good.address]}, overlay)
    statuses = {chat(gateway.port, "m").status for _ in range(6)}
    assert statuses == {200} and mock_served(good) == 6


def test_clients_leaving_mid_stream_leave_nothing_behind(valkey_url, mock_provider, gateway_factory):
    slow = mock_provider("slow", tokens=200, tokens_per_s=50)
    extra = {
        "quota": {"backend": {"kind": "valkey", "url": valkey_url}, "reservation_timeout": "2m",
                  "rules": [{"name": "leavers", "budgets": [{"window": "1h", "tokens": 10_000_000}],
                             "max_in_flight": 500}]},
    }
    gateway = gateway_factory({"slow": [slow.address]}, deterministic("slow"), extra=extra,
                              cluster_options={"max_connections": 100})
    body = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode()
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)) + body

    def leave_mid_stream(_: int) -> bool:
        with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as sock:
            sock.sendall(head)
            first = sock.recv(65536)
            return first.startswith(b"HTTP/1.1 200 ")

    with ThreadPoolExecutor(50) as pool:
        assert all(pool.map(leave_mid_stream, range(100)))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        endpoints = json.loads(admin_get(gateway.admin_port, "/admin/endpoints")[2])
        in_flight = sum(e["in_flight"] for c in endpoints["clusters"] for e in c["endpoints"])
        quota = json.loads(admin_get(gateway.admin_port, "/admin/quota?tenant=anonymous")[2])
        reserved = sum(w["reserved"] for rule in quota["rules"] for w in rule["windows"])
        if in_flight == 0 and reserved == 0:
            break
        time.sleep(0.05)
    assert (in_flight, reserved) == (0, 0)
    # Every one of the 100 pooled connection slots came back: 100 concurrent requests all get one.
    with ThreadPoolExecutor(100) as pool:
        statuses = list(pool.map(lambda _: chat(gateway.port, "m", max_tokens=2).status, range(100)))
    assert statuses.count(200) == 100


def test_keep_alive_connection_survives_a_held_answer(mock_provider, loopback_gateway_factory):
    bad = mock_provider("bad", fail_rate=1.0, fail_status=502)
    good = mock_provider("good")
    gateway = loopback_gateway_factory({"bad": [bad.address], "good": [good.address]}, deterministic("bad", "good"),
                              extra=FAST_RETRY)
    client = Client(gateway.port)
    for _ in range(5):
        response = client.request("POST", "/v1/chat/completions", {"model": "m"})
        assert response.status == 200 and response.headers["x-gridgate-attempts"] == "2"
    client.close()
    assert mock_served(bad) == 5 and mock_served(good) == 5
