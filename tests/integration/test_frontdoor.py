"""The front door, end to end (docs/security.md): only allowed routes reach a provider, and a request
without a valid key is refused on its head, before its body is read. Real gateways, real mock providers;
what a provider saw is read from its own counters."""

from __future__ import annotations

import json
import os
import re
import select
import socket
import time
from typing import Any

import pytest

from gateway.identity.auth import hash_api_key
from loadtest.mock_provider import MockProviderHandle, start_mock_provider_process
from tests.harness import (
    Client,
    Gateway,
    candidate,
    envelope,
    metric_value,
    refused_port,
    request,
    wait_until,
)

KEY_A = "sk-front-team-a"
KEY_PIN = "sk-front-pinner"
AUTH = [("Authorization", f"Bearer {KEY_A}")]
ECHO = "/debug/echo"  # the mock's echo page: a route beyond the defaults, listed for cluster a only
MIB = 1 << 20


def provider_saw(handle: MockProviderHandle) -> dict[str, int]:
    """Every request the mock answered, by page (its own /metrics; this read counts itself, once)."""
    _, _, body = request("127.0.0.1", handle.port, "GET", "/metrics")
    found = re.findall(rb'^mock_requests_served_total\{[^}]*endpoint="([^"]+)"\} (\S+)', body, re.M)
    return {name.decode(): int(float(value)) for name, value in found}


def assert_saw_nothing_since(handle: MockProviderHandle, before: dict[str, int]) -> None:
    after = provider_saw(handle)
    expected = {**before, "metrics": before.get("metrics", 0) + 1}  # the read that produced `after`
    assert after == expected, (before, after)


def _auth(keys: dict[str, str]) -> dict[str, Any]:
    return {"keys": [{"tenant": tenant, "key": hash_api_key(key)} for tenant, key in keys.items()]}


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    """Clusters a and b (model m on both, round robin; only-b on b; an MCP tool on b); a lists the echo
    page and GET /v1/files/* in allowed_routes. Auth on; the access log goes to a file."""
    handles = {name: start_mock_provider_process(0, f"front-{name}") for name in ("a", "b")}
    overlay = envelope([
        candidate("m", "a"), candidate("m", "b"), candidate("only-b", "b"),
        candidate("search", "b", kind="mcp_tool"),
    ], mode="roundRobin")
    gateway = Gateway(str(tmp_path_factory.mktemp("front")), {name: [h.address] for name, h in handles.items()},
                      overlay, extra={
                          "auth": _auth({"team-a": KEY_A, "pinner": KEY_PIN}),
                          "tenants": [{"tenant": "pinner", "may_pin": True}],
                          "access_log": {"path": "access.log"},
                      })
    gateway.config["clusters"][0]["allowed_routes"] = [f"POST {ECHO}", "GET /v1/files/*"]
    gateway.write_config()
    gateway.start()
    yield gateway, handles
    gateway.stop()
    for handle in handles.values():
        handle.stop()


def _error(response_body: bytes) -> dict[str, Any]:
    error = json.loads(response_body)["error"]
    assert set(error) == {"message", "type", "code"}
    return error


REFUSED_ROUTES = [
    ("POST", "/admin/health", b'{"status": 503}'),  # flipped the provider's health before the fix
    ("GET", "/metrics", None),
    ("GET", "/health", None),
    ("POST", "/admin/config", b'{"fail_rate": 1.0}'),
    ("GET", "/v1/files", None),
    ("DELETE", "/v1/files/x", None),
    ("GET", "/v1/chat/completions", None),
    ("PUT", "/v1/chat/completions", b'{"model": "m"}'),
    ("POST", "/v1/chat/completions/", b'{"model": "m"}'),
    ("POST", "//v1/chat/completions", b'{"model": "m"}'),
    ("POST", "/V1/chat/completions", b'{"model": "m"}'),
    ("POST", "/v1/%63hat/completions", b'{"model": "m"}'),
    ("POST", "/v1/chat/completions/../../admin/health", b'{"status": 503}'),
    ("POST", "/v1/chat/completions/%2e%2e/%2e%2e/admin/health", b'{"status": 503}'),
    ("POST", f"{ECHO}/../../admin/health", b'{"status": 503}'),
    ("POST", "/debug/./echo", b"{}"),
    ("POST", "/debug/%65cho", b"{}"),
    ("GET", "/v1/files/x/../../../admin/config", None),
    ("GET", "/v1/files/..", None),
    ("GET", "/v1/files/%2e%2e", None),
    ("GET", "/v1/files//x", None),
    ("GET", "/v1/files/x/content", None),  # * stays inside one segment
    ("HEAD", "/v1/chat/completions", None),
    ("GET", "/mcp/../metrics", None),
]


@pytest.mark.parametrize(("method", "path", "body"), REFUSED_ROUTES, ids=[f"{m} {p}" for m, p, _ in REFUSED_ROUTES])
def test_routes_outside_the_allowed_set_never_reach_a_provider(front, method, path, body):
    gateway, handles = front
    before = {name: provider_saw(handle) for name, handle in handles.items()}
    headers = [*AUTH, ("X-Model", "m"), ("Content-Type", "application/json")]
    client = Client(gateway.port)
    try:
        response = client.request(method, path, body, headers)
    finally:
        client.close()
    assert response.status == 404
    assert response.headers["connection"] == "close"
    if method != "HEAD":
        assert _error(response.body)["code"] == "route_not_allowed"
    for name, handle in handles.items():
        assert_saw_nothing_since(handle, before[name])
    assert request("127.0.0.1", handles["a"].port, "GET", "/health")[0] == 200  # still healthy


def test_a_query_string_does_not_change_the_route(front):
    gateway, handles = front
    client = Client(gateway.port)
    try:
        chat = client.request("POST", "/v1/chat/completions?api-version=1&x=/../admin", {"model": "m"}, AUTH)
        files = client.request("GET", "/v1/files/abc?purpose=../../admin", None, [*AUTH, ("X-Model", "m")])
        models = client.request("GET", "/v1/models?limit=5", None, AUTH)
    finally:
        client.close()
    assert chat.status == 200 and chat.json()["object"] == "chat.completion"
    assert files.headers["x-gridgate-provider"] == "a"  # the mock has no such page: its own 404, relayed
    assert models.status == 200 and [m["id"] for m in models.json()["data"]] == ["m", "only-b"]


def test_a_route_allowed_on_one_cluster_goes_only_to_that_cluster(front):
    gateway, handles = front
    before_b = provider_saw(handles["b"])
    client = Client(gateway.port)
    try:
        # m is served by a and b in round robin: the echo route must still go to a, every time.
        served = [client.request("POST", ECHO, {"n": n}, [*AUTH, ("X-Model", "m")]) for n in range(12)]
        ordinary = [client.request("POST", "/v1/chat/completions", {"model": "m"}, AUTH) for _ in range(4)]
    finally:
        client.close()
    assert [r.status for r in served] == [200] * 12
    assert {r.headers["x-gridgate-provider"] for r in served} == {"a"}
    assert all(r.json()["path"] == ECHO for r in served)
    assert sorted(r.headers["x-gridgate-provider"] for r in ordinary) == ["a", "a", "b", "b"]
    after_b = provider_saw(handles["b"])
    assert after_b.get("debug", 0) == before_b.get("debug", 0)


def test_a_route_allowed_only_where_the_model_is_not_served_is_refused(front):
    gateway, handles = front
    before = provider_saw(handles["b"])
    response = Client(gateway.port).request("POST", ECHO, {}, [*AUTH, ("X-Model", "only-b")])
    assert response.status == 404
    error = _error(response.body)
    assert error["code"] == "route_not_allowed" and "allowed only on a" in error["message"]
    assert_saw_nothing_since(handles["b"], before)


def test_a_pin_cannot_take_a_route_to_a_cluster_that_does_not_allow_it(front):
    gateway, handles = front
    before = provider_saw(handles["b"])
    pin = [("Authorization", f"Bearer {KEY_PIN}"), ("X-Model", "m")]
    refused = Client(gateway.port).request("POST", ECHO, {}, [*pin, ("X-Gridgate-Pin", "b")])
    allowed = Client(gateway.port).request("POST", ECHO, {}, [*pin, ("X-Gridgate-Pin", "a")])
    assert refused.status == 404 and _error(refused.body)["code"] == "route_not_allowed"
    assert allowed.status == 200 and allowed.headers["x-gridgate-provider"] == "a"
    assert_saw_nothing_since(handles["b"], before)


def test_the_mcp_endpoint_is_forwarded_and_its_session_requests_route_like_its_messages(front):
    gateway, handles = front
    before = provider_saw(handles["b"])
    call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "search", "arguments": {}}}
    headers = [*AUTH, ("Content-Type", "application/json")]
    client = Client(gateway.port)
    try:
        answers = [client.request("POST", "/mcp", call, headers), client.request("GET", "/mcp", None, AUTH),
                   client.request("DELETE", "/mcp", None, AUTH)]
    finally:
        client.close()
    # The mock speaks no MCP (it answers 404 itself): what matters is who received the requests.
    assert [r.headers.get("x-gridgate-provider") for r in answers] == ["b", "b", "b"]
    assert provider_saw(handles["b"])["other"] == before.get("other", 0) + 3
    refused = Client(gateway.port).request("PUT", "/mcp", call, headers)
    assert refused.status == 404 and _error(refused.body)["code"] == "route_not_allowed"


def _read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    received = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            return received
        if not chunk:
            return received
        received += chunk


@pytest.mark.parametrize("expect_continue", [False, True], ids=["plain", "expect-100"])
@pytest.mark.parametrize(("key", "path", "status"), [
    (None, "/v1/chat/completions", 401), ("sk-wrong", "/v1/chat/completions", 401), (KEY_A, "/v1/files", 404),
])
def test_a_refused_request_is_answered_before_its_body_is_sent(front, key, path, status, expect_continue):
    gateway, handles = front
    before = provider_saw(handles["a"])
    head = (f"POST {path} HTTP/1.1\r\nHost: g\r\nContent-Type: application/json\r\nX-Model: m\r\n"
            f"Content-Length: {10 * MIB}\r\n").encode()
    if key:
        head += f"Authorization: Bearer {key}\r\n".encode()
    if expect_continue:
        head += b"Expect: 100-continue\r\n"
    sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=5)
    try:
        sock.sendall(head + b"\r\n" + (b"" if expect_continue else b"x" * 65536))
        # 64 KiB of 10 MiB sent: an answer now can only come from the head.
        assert select.select([sock], [], [], 3)[0], "no answer before the body was sent"
        received = _read_until_closed(sock, 5)
    finally:
        sock.close()
    assert received.startswith(b"HTTP/1.1 %d " % status), received[:200]  # no 100 Continue first
    assert b"connection: close" in received.lower()
    assert_saw_nothing_since(handles["a"], before)


def test_head_refusals_are_logged_and_counted_like_other_refusals(front):
    gateway, _ = front
    errors_401 = metric_value(gateway.admin_port, 'gridgate_gateway_errors_total{status="401"}')
    errors_404 = metric_value(gateway.admin_port, 'gridgate_gateway_errors_total{status="404"}')
    no_key = Client(gateway.port).request("POST", "/v1/chat/completions?k=secret", {"model": "m"},
                                          [("X-Request-Id", "front-no-key")])
    no_route = Client(gateway.port).request("GET", "/admin/health", None, [*AUTH, ("X-Request-Id", "front-no-route")])
    assert (no_key.status, no_route.status) == (401, 404)
    assert no_key.headers["www-authenticate"].startswith("Bearer")
    assert no_key.headers["x-request-id"] == "front-no-key" and no_route.headers["x-request-id"] == "front-no-route"
    path = os.path.join(gateway.directory, "access.log")

    def lines() -> dict[str, dict[str, Any]]:
        with open(path, "rb") as handle:
            found = [json.loads(line) for line in handle if line.strip()]
        return {line["request_id"]: line for line in found if line["request_id"] in ("front-no-key", "front-no-route")}

    logged = wait_until(lambda: (found := lines()) and len(found) == 2 and found, "both access lines")
    refused = logged["front-no-key"]
    assert (refused["status"], refused["error"], refused["method"], refused["path"], refused["tenant"]) == (
        401, "invalid_api_key", "POST", "/v1/chat/completions", None)
    assert refused["bytes_in"] == 0
    unknown = logged["front-no-route"]
    assert (unknown["status"], unknown["error"], unknown["method"], unknown["path"], unknown["tenant"]) == (
        404, "route_not_allowed", "GET", "/admin/health", "team-a")
    wait_until(lambda: metric_value(gateway.admin_port, 'gridgate_gateway_errors_total{status="401"}') == errors_401 + 1
               and metric_value(gateway.admin_port, 'gridgate_gateway_errors_total{status="404"}') == errors_404 + 1,
               "the refusals in the metrics")


def _rss_kib(pid: int, field: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


# What 100 unauthenticated 10 MiB uploads may add to a worker's resident memory: nothing of their bodies
# is kept (before the fix they took a worker from 35 MiB to over 1 GiB).
RSS_GROWTH_BOUND_KIB = 32 * 1024


def test_unauthenticated_uploads_do_not_grow_the_worker(mock_provider, gateway_factory):
    handle = mock_provider("p")
    gateway = gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]),
                              extra={"auth": _auth({"team-a": KEY_A}), "access_log": {"enabled": False}})
    [pid] = gateway.worker_pids()
    assert Client(gateway.port).request("POST", "/v1/chat/completions", {"model": "m"}, AUTH).status == 200
    rss_before, hwm_before = _rss_kib(pid), _rss_kib(pid, "VmHWM")
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (10 * MIB))
    chunk = b"x" * (256 * 1024)
    socks = []
    for _ in range(100):
        sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=5)
        sock.sendall(head)
        sock.setblocking(False)
        socks.append(sock)
    sent = dict.fromkeys(socks, 0)
    peak = rss_before
    deadline = time.monotonic() + 60
    # Every client pushes its whole body whatever the answer (as a hostile one would), until the gateway
    # stops taking it: the worker reads and drops it, it keeps none of it.
    while sent and time.monotonic() < deadline:
        _, writable, _ = select.select([], list(sent), [], 1.0)
        for sock in writable:
            try:
                sent[sock] += sock.send(chunk[: 10 * MIB - sent[sock]])
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:  # the gateway closed it (after the linger)
                del sent[sock]
                continue
            if sent[sock] >= 10 * MIB:
                del sent[sock]
        peak = max(peak, _rss_kib(pid))
    answers = []
    for sock in socks:
        sock.setblocking(True)
        answers.append(_read_until_closed(sock, 5)[:12])
        sock.close()
    hwm_after = _rss_kib(pid, "VmHWM")
    if hwm_after > hwm_before:  # the high-water mark rose during the uploads: that is their peak
        peak = max(peak, hwm_after)
    assert answers == [b"HTTP/1.1 401"] * 100
    assert peak - rss_before < RSS_GROWTH_BOUND_KIB, (rss_before, peak)


def test_a_restricted_route_never_fails_over_to_a_cluster_that_does_not_allow_it(mock_provider, gateway_factory):
    live = mock_provider("live")
    dead = f"127.0.0.1:{refused_port()}"  # nothing listens: every attempt on cluster a fails to connect
    gateway = gateway_factory({"a": [dead], "b": [live.address]},
                              envelope([candidate("m", "a", group=0), candidate("m", "b", group=1)], "deterministic"),
                              start=False)
    gateway.config["clusters"][0]["allowed_routes"] = [f"POST {ECHO}"]
    gateway.write_config()
    gateway.start()
    before = provider_saw(live)
    echo = Client(gateway.port).request("POST", ECHO, {}, [("X-Model", "m")])
    assert echo.status == 502 and echo.headers["x-gridgate-provider"] == "a"
    assert_saw_nothing_since(live, before)
    # The same model on a default route does fail over to b: only the route's bar kept the echo away.
    assert Client(gateway.port).request("POST", "/v1/chat/completions", {"model": "m"}).headers[
        "x-gridgate-provider"] == "b"


def test_stable_hash_spreads_sessions_when_affinity_is_off(providers, loopback_gateway_factory):
    names = ("provider-a", "provider-b", "provider-c")
    gateway = loopback_gateway_factory({name: [providers[name].address] for name in names},
                              envelope([candidate("m", name) for name in names], "roundRobin"),
                              extra={"routing": {"picker": "stable_hash", "stable_hash_key": ["session"]}})
    served: dict[str, set[str]] = {}
    client = Client(gateway.port)
    try:
        for repeat in range(3):
            for index in range(30):
                session = f"session-{index}"
                response = client.request("POST", "/v1/chat/completions", {"model": "m"},
                                          [("X-Session-Id", session), ("X-Request-Id", f"{session}-{repeat}")])
                assert response.status == 200
                served.setdefault(session, set()).add(response.headers["x-mock-provider"])
    finally:
        client.close()
    assert all(len(seen) == 1 for seen in served.values()), served  # each session keeps its provider
    spread = {next(iter(seen)) for seen in served.values()}
    assert len(spread) > 1, spread  # before the fix every session hashed alike: one provider of three
