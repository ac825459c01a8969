"""The proxy end to end: real gateway process, real mock providers, raw sockets."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import h11
import pytest

from tests.harness import (
    Client,
    admin_get,
    candidate,
    chat,
    envelope,
    mock_in_flight,
    mock_served,
    raw_exchange,
    refused_port,
    request,
    status_of,
)


@pytest.fixture
def one_provider(mock_provider, loopback_gateway_factory):
    handle = mock_provider("solo")
    # The mock's echo page is a route beyond the defaults (docs/security.md): listed for the cluster.
    gateway = loopback_gateway_factory({"solo": [handle.address]}, envelope([candidate("m", "solo")]),
                              cluster_options={"allowed_routes": ["POST /debug/echo"]})
    return handle, gateway


def test_forwards_and_rewrites_headers(one_provider):
    _, gateway = one_provider
    status, headers, body = request(
        "127.0.0.1", gateway.port, "POST", "/debug/echo", b"{}",
        headers=[
            ("X-Model", "m"), ("Authorization", "Bearer client-secret"), ("X-Api-Key", "client-secret"),
            ("Connection", "keep-alive, X-Hop"), ("X-Hop", "1"), ("Keep-Alive", "timeout=5"),
            ("X-Forwarded-For", "10.9.8.7"), ("X-Request-Id", "req-abc"), ("X-Gridgate-Provider", "spoofed"),
            ("X-Ai-Routing-Candidate", "spoofed"), ("X-Custom", "kept"),
        ],
    )
    assert status == 200
    echoed = {name.lower(): value for name, value in json.loads(body)["headers"]}
    assert "authorization" not in echoed and "x-api-key" not in echoed
    assert "x-hop" not in echoed and "keep-alive" not in echoed and "connection" not in echoed
    assert "x-gridgate-provider" not in echoed and "x-ai-routing-candidate" not in echoed
    assert echoed["x-forwarded-for"] == "10.9.8.7, 127.0.0.1"
    assert echoed["x-request-id"] == "req-abc"
    assert echoed["x-custom"] == "kept"
    assert echoed["host"] == one_provider[0].address
    assert headers["x-request-id"] == "req-abc"
    assert headers["x-gridgate-provider"] == "solo"
    overhead = float(headers["x-gridgate-overhead-ms"])
    assert 0 < overhead < 1000  # measured in milliseconds, before the upstream request was written


def test_generates_request_id_when_missing(one_provider):
    _, gateway = one_provider
    first = chat(gateway.port, "m")
    second = chat(gateway.port, "m")
    assert first.status == 200 and first.json()["object"] == "chat.completion"
    assert first.headers["x-request-id"] and first.headers["x-request-id"] != second.headers["x-request-id"]


def test_models_list_comes_from_the_overlay(mock_provider, loopback_gateway_factory):
    handle = mock_provider("p")
    overlay = envelope([candidate("alpha", "p"), candidate("beta", "p")])
    gateway = loopback_gateway_factory({"p": [handle.address]}, overlay)
    before = mock_served(handle)
    status, _, body = request("127.0.0.1", gateway.port, "GET", "/v1/models")
    assert status == 200
    data = json.loads(body)
    assert data["object"] == "list"
    assert [m["id"] for m in data["data"]] == ["alpha", "beta"]
    assert mock_served(handle) == before  # answered by the gateway itself


@pytest.mark.parametrize(
    ("body", "headers", "status", "code"),
    [
        (b'{"model": "nope"}', [], 404, "model_not_found"),
        (b'{"messages": []}', [], 400, None),
        (b"{not json", [], 400, "invalid_json"),
        (b"{}", [("X-Model", "nope")], 404, "model_not_found"),
    ],
)
def test_gateway_errors_are_openai_json(one_provider, body, headers, status, code):
    handle, gateway = one_provider
    before = mock_served(handle)
    got, response_headers, payload = request(
        "127.0.0.1", gateway.port, "POST", "/v1/chat/completions", body,
        headers=[("Content-Type", "application/json"), *headers],
    )
    assert got == status
    assert response_headers["content-type"] == "application/json"
    error = json.loads(payload)["error"]
    assert set(error) == {"message", "type", "code"}
    if code:
        assert error["code"] == code
    assert mock_served(handle) == before


def test_stream_arrives_incrementally(mock_provider, loopback_gateway_factory):
    handle = mock_provider("slow", tokens_per_s=10, tokens=10)
    gateway = loopback_gateway_factory({"slow": [handle.address]}, envelope([candidate("m", "slow")]))
    client = Client(gateway.port)
    started = time.monotonic()
    client.send("POST", "/v1/chat/completions", {"model": "m", "stream": True, "messages": []})
    client.sock.settimeout(5)
    first = client.sock.recv(65536)
    first_at = time.monotonic() - started
    rest = b""
    while b"[DONE]" not in rest:
        rest += client.sock.recv(65536)
    total = time.monotonic() - started
    client.close()
    assert b"200" in first.split(b"\r\n", 1)[0]
    assert b"text/event-stream" in first.lower()
    assert total >= 0.8  # ten tokens at ten per second
    assert first_at < total / 2, (first_at, total)
    assert b"data: " in first + rest


def test_keepalive_and_pipelining_answer_in_order(one_provider):
    _, gateway = one_provider
    payload = b""
    for index in range(3):
        body = b'{"model": "m"}'
        payload += (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nX-Request-Id: pipe-%d\r\n"
            b"Content-Length: %d\r\n%s\r\n%s" % (index, len(body), b"Connection: close\r\n" if index == 2 else b"", body)
        )
    received = raw_exchange(gateway.port, payload)
    ids = re.findall(rb"x-request-id: (pipe-\d)", received)
    assert ids == [b"pipe-0", b"pipe-1", b"pipe-2"]
    assert received.count(b"HTTP/1.1 200") == 3


def test_keepalive_reuses_one_connection(loopback_gateway_factory):
    server = _KeepAliveServer()
    gateway = loopback_gateway_factory({"ka": [f"127.0.0.1:{server.port}"]}, envelope([candidate("m", "ka")]))
    client = Client(gateway.port)
    for _ in range(20):
        response = client.request("POST", "/v1/chat/completions", {"model": "m"})
        assert response.status == 200 and response.body == b"{}"
    client.close()
    assert (server.connections, server.requests) == (1, 20)  # one pooled upstream connection served all


def test_upstream_connect_failure_is_502(loopback_gateway_factory):
    dead = f"127.0.0.1:{refused_port()}"
    gateway = loopback_gateway_factory({"dead": [dead]}, envelope([candidate("m", "dead")]))
    response = chat(gateway.port, "m")
    assert response.status == 502
    assert response.json()["error"]["type"] == "upstream_error"


def test_upstream_read_timeout_before_response_is_504(mock_provider, loopback_gateway_factory):
    handle = mock_provider("stall")
    gateway = loopback_gateway_factory({"stall": [handle.address]}, envelope([candidate("m", "stall")]),
                              cluster_options={"read_timeout": "500ms"})
    response = chat(gateway.port, "m", headers=[("X-Mock-Stall-Ms", "3000")])
    assert response.status == 504
    assert response.json()["error"]["code"] == "upstream_timeout"


def test_upstream_reset_before_response_is_502(mock_provider, loopback_gateway_factory):
    handle = mock_provider("reset")
    gateway = loopback_gateway_factory({"reset": [handle.address]}, envelope([candidate("m", "reset")]))
    response = chat(gateway.port, "m", headers=[("X-Mock-Reset", "before")])
    assert response.status == 502
    ok = chat(gateway.port, "m")
    assert ok.status == 200


def test_upstream_failure_mid_stream_ends_with_error_event(mock_provider, loopback_gateway_factory):
    handle = mock_provider("midreset", tokens_per_s=200, tokens=20)
    gateway = loopback_gateway_factory({"midreset": [handle.address]}, envelope([candidate("m", "midreset")]))
    body = b'{"model": "m", "stream": true}'
    raw = raw_exchange(
        gateway.port,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nX-Mock-Reset: mid\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body),
    )
    assert status_of(raw) == 200
    assert b"upstream_reset" in raw or b"upstream stream failed" in raw


class _RawProvider:
    """A TCP server whose ``handle(conn)`` plays a misbehaving provider, one thread per connection."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._run, args=(conn,), daemon=True).start()

    def _run(self, conn: socket.socket) -> None:
        conn.settimeout(5)
        try:
            self.handle(conn)
        except OSError:
            pass
        conn.close()

    def handle(self, conn: socket.socket) -> None:
        raise NotImplementedError


class _GarbageServer(_RawProvider):
    """Answers every connection with fixed bytes, then closes."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply
        super().__init__()

    def handle(self, conn: socket.socket) -> None:
        conn.recv(65536)
        conn.sendall(self.reply)
        time.sleep(0.05)


@pytest.mark.parametrize(
    "reply",
    [
        b"NOT HTTP AT ALL\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: abc\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nBad Header Line\r\n\r\n",
    ],
)
def test_malformed_upstream_response_is_502(loopback_gateway_factory, reply):
    server = _GarbageServer(reply)
    gateway = loopback_gateway_factory({"bad": [f"127.0.0.1:{server.port}"]}, envelope([candidate("m", "bad")]))
    response = chat(gateway.port, "m")
    assert response.status == 502
    assert response.json()["error"]["code"] == "bad_upstream_response"


def test_ambiguous_upstream_framing_is_not_reused(loopback_gateway_factory):
    reply = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"
    server = _GarbageServer(reply)
    gateway = loopback_gateway_factory({"amb": [f"127.0.0.1:{server.port}"]}, envelope([candidate("m", "amb")]))
    for _ in range(3):
        response = chat(gateway.port, "m")
        assert response.status == 200 and response.body == b"ok"
    assert server.connections == 3  # each one closed after its response, never reused


def test_client_disconnect_closes_upstream(mock_provider, loopback_gateway_factory):
    handle = mock_provider("long", tokens_per_s=5, tokens=100)
    gateway = loopback_gateway_factory({"long": [handle.address]}, envelope([candidate("m", "long")]))
    client = Client(gateway.port)
    client.send("POST", "/v1/chat/completions", {"model": "m", "stream": True})
    client.sock.recv(65536)
    assert mock_in_flight(handle) == 1
    client.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and mock_in_flight(handle) != 0:
        time.sleep(0.05)
    assert mock_in_flight(handle) == 0


def test_worker_connection_limit_answers_503(mock_provider, loopback_gateway_factory):
    handle = mock_provider("p")
    gateway = loopback_gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]),
                              extra={"limits": {"max_connections_per_worker": 2}})
    held = [Client(gateway.port), Client(gateway.port)]
    for client in held:
        assert client.request("POST", "/v1/chat/completions", {"model": "m"}).status == 200
    raw = raw_exchange(gateway.port, b"GET /v1/models HTTP/1.1\r\nHost: g\r\n\r\n")
    assert status_of(raw) == 503
    assert b"retry-after: 1" in raw.lower()
    for client in held:
        client.close()


class _KeepAliveServer(_RawProvider):
    """Answers every request of a connection (keep-alive), counting connections and requests."""

    requests = 0

    def handle(self, conn: socket.socket) -> None:
        parser = h11.Connection(h11.SERVER)
        while True:
            event = parser.next_event()
            if event is h11.NEED_DATA:
                parser.receive_data(conn.recv(65536))
            elif type(event) is h11.EndOfMessage:
                self.requests += 1
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
                parser.send(h11.Response(status_code=200, headers=[("content-length", "2")]))
                parser.send(h11.Data(data=b"{}"))
                parser.send(h11.EndOfMessage())
                parser.start_next_cycle()
            elif type(event) is h11.ConnectionClosed:
                return


class _OneShotKeepAliveServer(_RawProvider):
    """Answers the first request of each connection with keep-alive, then drops the connection when the
    second request arrives on it: exactly what a provider closing an idle pooled connection looks like."""

    def handle(self, conn: socket.socket) -> None:
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
        conn.recv(65536)  # the next request on the pooled connection: hang up without answering


def test_stale_pooled_connection_is_retried_on_a_fresh_one(gateway_factory):
    server = _OneShotKeepAliveServer()
    gateway = gateway_factory({"flaky": [f"127.0.0.1:{server.port}"]}, envelope([candidate("m", "flaky")]))
    client = Client(gateway.port)
    for _ in range(5):
        response = client.request("POST", "/v1/chat/completions", {"model": "m"})
        assert response.status == 200, response.body
    client.close()
    assert server.connections >= 5
    _, _, metrics = admin_get(gateway.admin_port, "/metrics")
    retries = re.search(rb"^gridgate_upstream_retries_total (\S+)", metrics, re.M)
    assert retries and float(retries.group(1)) >= 1  # the stale connection was really hit, then retried
