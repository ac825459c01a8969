"""Graceful shutdown: SIGTERM lets in-flight streams finish, then the gateway exits 0."""

from __future__ import annotations

import signal
import time

from tests.harness import Client, candidate, envelope


def test_sigterm_lets_an_in_flight_stream_finish(mock_provider, gateway_factory):
    handle = mock_provider("slow", tokens_per_s=10, tokens=15)
    gateway = gateway_factory({"slow": [handle.address]}, envelope([candidate("m", "slow")]), workers=2)
    client = Client(gateway.port)
    client.send("POST", "/v1/chat/completions", {"model": "m", "stream": True})
    client.sock.settimeout(10)
    received = client.sock.recv(65536)
    assert b" 200 " in received.split(b"\r\n", 1)[0]
    gateway.signal(signal.SIGTERM)
    started = time.monotonic()
    while b"[DONE]" not in received:
        chunk = client.sock.recv(65536)
        if not chunk:
            break
        received += chunk
    assert b"data: [DONE]" in received
    assert received.endswith(b"0\r\n\r\n")  # the chunked body was terminated properly
    assert gateway.process.wait(15) == 0
    assert time.monotonic() - started > 0.5  # it really waited for the stream
    client.close()


def test_sigterm_with_nothing_in_flight_exits_promptly(mock_provider, gateway_factory):
    handle = mock_provider("idle")
    gateway = gateway_factory({"idle": [handle.address]}, envelope([candidate("m", "idle")]))
    idle = Client(gateway.port)  # an idle keep-alive connection must not hold the drain
    assert idle.request("POST", "/v1/chat/completions", {"model": "m"}).status == 200
    started = time.monotonic()
    gateway.signal(signal.SIGTERM)
    assert gateway.process.wait(10) == 0
    assert time.monotonic() - started < 3
    idle.close()
