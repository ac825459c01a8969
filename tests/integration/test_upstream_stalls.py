"""What holds an upstream connection is bounded: a client that stops reading a stream is cut after
`timeouts.client_stall` and its connection freed; a provider flooding 1xx heads gets 502 at once; a
provider that never sends a final head, or never accepts the connection, is a 504 timeout."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from loadtest.broken_upstream import BrokenUpstream
from loadtest.fault_proxy import FaultProxyThread
from tests.harness import Client, candidate, envelope, status_of

FAST_RETRY = {"backoff": {"base": "1ms", "max": "1ms"}}


@pytest.fixture
def upstream():
    server = BrokenUpstream("clean").start()
    yield server
    server.stop()


def ask(port: int, behaviour: str, tag: str = "t", timeout: float = 30.0):
    client = Client(port, timeout=timeout)
    try:
        return client.request("POST", "/v1/chat/completions", b"{}",
                              [("X-Model", "m"), ("X-Behaviour", behaviour), ("X-Tag", tag)])
    finally:
        client.close()


def access_lines(gateway, count: int) -> list[dict]:
    """The access log's lines once there are ``count`` (it is written off the request path)."""
    path = os.path.join(gateway.directory, "access.log")
    deadline = time.monotonic() + 5
    while True:
        with open(path, "rb") as handle:
            lines = [json.loads(line) for line in handle if line.startswith(b"{")]
        if len(lines) >= count or time.monotonic() > deadline:
            return lines
        time.sleep(0.02)


def test_a_client_that_stops_reading_is_cut_and_its_connection_serves_the_next(upstream, gateway_factory):
    gateway = gateway_factory(
        {"broken": [upstream.address]}, envelope([candidate("m", "broken")]), workers=1,
        cluster_options={"max_connections": 1, "connect_timeout": "10s"},  # a waiter may wait for the slot
        extra={"timeouts": {"client_stall": "1s"}, "access_log": {"path": "access.log"}},
    )
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    stalled.connect(("127.0.0.1", gateway.port))
    stalled.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nX-Model: m\r\nX-Behaviour: big_stream\r\n"
                    b"X-Tag: stalled\r\nContent-Length: 2\r\n\r\n{}")
    stalled.settimeout(10)
    assert status_of(stalled.recv(4096)) == 200  # the stream started; this client reads no more of it
    started = time.monotonic()
    answer = ask(gateway.port, "clean", "next")  # waits for the only connection, held by the stalled stream
    waited = time.monotonic() - started
    assert (answer.status, answer.body) == (200, b"answer:next")
    assert 0.5 < waited < 6, waited  # freed about client_stall after the stream paused, not never
    assert upstream.stats.connections == 2  # the stalled stream's connection was closed, not reused
    # The stalled client's connection was cut: it reads what was buffered, then the end.
    received = 0
    while True:
        try:
            data = stalled.recv(1 << 20)
        except ConnectionResetError:
            break
        if not data:
            break
        received += len(data)
    stalled.close()
    assert received < 64 * 1024 * 1024  # far from the whole 64 MiB stream
    lines = access_lines(gateway, 2)
    assert [(line["status"], line["error"]) for line in lines] == [(200, "client_stalled"), (200, None)]


def test_a_flood_of_informational_heads_is_a_prompt_502(upstream, gateway_factory):
    gateway = gateway_factory({"broken": [upstream.address]}, envelope([candidate("m", "broken")]), workers=1,
                              extra={"routing": {"retry": {"deadline": "10s", **FAST_RETRY}}})
    started = time.monotonic()
    answer = ask(gateway.port, "informational_flood")
    assert time.monotonic() - started < 3
    assert answer.status == 502
    error = answer.json()["error"]
    assert error["code"] == "bad_upstream_response"
    assert error["message"] == "broken: more than 16 informational (1xx) heads"
    assert ask(gateway.port, "clean", "after").body == b"answer:after"  # the worker serves on


@pytest.mark.parametrize("retry", [
    {"deadline": "1s"},  # the request's whole deadline passes while 1xx heads trickle in
    {"deadline": "10s", "first_byte_timeout": "1s"},  # the attempt's first-byte deadline passes
])
def test_informational_heads_do_not_renew_the_head_deadline_and_it_is_a_504(retry, upstream, gateway_factory):
    gateway = gateway_factory({"broken": [upstream.address]}, envelope([candidate("m", "broken")]), workers=1,
                              extra={"routing": {"retry": {**retry, **FAST_RETRY}}})
    started = time.monotonic()
    answer = ask(gateway.port, "slow_informational")  # a 100 head every 100 ms, never a final head
    elapsed = time.monotonic() - started
    assert (answer.status, answer.json()["error"]["code"]) == (504, "upstream_timeout")
    assert 0.9 < elapsed < 4, elapsed


def test_a_connect_timeout_is_a_502_naming_the_timeout(mock_provider, gateway_factory):
    hole = FaultProxyThread(mock_provider("p").address).start()
    try:
        hole.set_fault(on_connect="blackhole")
        gateway = gateway_factory({"hole": [hole.address]}, envelope([candidate("m", "hole")]), workers=1,
                                  cluster_options={"connect_timeout": "300ms"})
        answer = ask(gateway.port, "clean")
        assert answer.status == 502  # a connect failure (docs/configuration.md); the message says why
        error = answer.json()["error"]
        assert error["code"] == "upstream_unavailable"
        assert error["message"] == "hole: connect timed out after 0.3s"
    finally:
        hole.stop()

