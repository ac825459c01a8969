"""Edge cases found in review: HEAD errors, half-closed clients, repeated headers, cut SSE bodies."""

from __future__ import annotations

import json
import socket
import threading
import time

from tests.harness import admin_get, candidate, chat, envelope, raw_exchange, request, status_of, wait_until


def test_gateway_error_on_head_keeps_the_connection_usable(mock_provider, gateway_factory):
    handle = mock_provider("p")
    gateway = gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]),
                              cluster_options={"allowed_routes": ["HEAD /v1/chat/completions"]})
    payload = (b"HEAD /v1/chat/completions HTTP/1.1\r\nHost: g\r\nX-Model: nope\r\n\r\n"
               b"GET /v1/models HTTP/1.1\r\nHost: g\r\nConnection: close\r\n\r\n")
    raw = raw_exchange(gateway.port, payload)
    assert raw.startswith(b"HTTP/1.1 404 ")
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert b"content-length:" in head.lower()
    assert rest.startswith(b"HTTP/1.1 200 ")  # no body after the HEAD answer; the next answer follows
    assert "Traceback" not in gateway.log()


def test_half_closed_client_still_gets_its_answer(mock_provider, loopback_gateway_factory):
    handle = mock_provider("p", latency_ms=200)
    gateway = loopback_gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]))
    body = b'{"model": "m"}'
    sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=5)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    sock.shutdown(socket.SHUT_WR)
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    sock.close()
    assert status_of(received) == 200
    assert b"chat.completion" in received


def test_every_x_forwarded_for_line_is_kept(mock_provider, loopback_gateway_factory):
    handle = mock_provider("p")
    gateway = loopback_gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]),
                              cluster_options={"allowed_routes": ["POST /debug/echo"]})
    status, _, body = request("127.0.0.1", gateway.port, "POST", "/debug/echo", b"{}",
                              headers=[("X-Model", "m"), ("X-Forwarded-For", "1.1.1.1"),
                                       ("X-Forwarded-For", "2.2.2.2")])
    assert status == 200
    echoed = {k.lower(): v for k, v in json.loads(body)["headers"]}
    assert echoed["x-forwarded-for"] == "1.1.1.1, 2.2.2.2, 127.0.0.1"


def test_no_evidence_headers_when_route_headers_are_off(mock_provider, loopback_gateway_factory):
    handle = mock_provider("p")
    gateway = loopback_gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]),
                              extra={"routing": {"route_headers": False}})
    response = chat(gateway.port, "m")
    assert response.status == 200
    assert not any(name.startswith("x-gridgate-") for name in response.headers)
    assert response.headers["x-request-id"]


def test_sse_with_content_length_cut_by_the_provider_ends_and_frees_the_slot(gateway_factory):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]

    def serve_once() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: 1000\r\n\r\n"
                     b"data: {\"partial\": true}\n\n")
        time.sleep(0.2)
        conn.close()

    threading.Thread(target=serve_once, daemon=True).start()
    gateway = gateway_factory({"cut": [f"127.0.0.1:{port}"]}, envelope([candidate("m", "cut")]))
    started = time.monotonic()
    raw = raw_exchange(gateway.port, b'POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nX-Model: m\r\n'
                       b"Content-Length: 2\r\n\r\n{}", timeout=5)
    assert time.monotonic() - started < 3  # the client sees the cut promptly, no hang
    assert status_of(raw) == 200 and b'"partial"' in raw

    def in_flight() -> list[int]:
        _, _, body = admin_get(gateway.admin_port, "/admin/endpoints")
        return [ep["in_flight"] for cluster in json.loads(body)["clusters"] for ep in cluster["endpoints"]]

    # The slot is freed as the relay ends, which may be just after the client read the last byte.
    wait_until(lambda: in_flight() == [0], "the cut stream's slot to be freed", 2.0)
    listener.close()
