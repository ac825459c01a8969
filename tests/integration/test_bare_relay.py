"""The bench baseline relays requests with keep-alive on both sides (loadtest/bare_relay.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from loadtest.bare_relay import start_bare_relay_process
from loadtest.mock_provider import MockProviderHandle, start_mock_provider_process, terminate
from tests.harness import Client, free_port, refused_port


def established_to(port: int) -> int:
    """Established IPv4 connections whose far end is `port`: a relay's connections to that upstream."""
    with open("/proc/net/tcp") as table:
        rows = [line.split() for line in table.readlines()[1:]]
    return sum(1 for row in rows if int(row[2].rsplit(":", 1)[1], 16) == port and row[3] == "01")


@pytest.fixture
def upstream() -> Iterator[MockProviderHandle]:
    with start_mock_provider_process(0, "relay-upstream") as handle:
        yield handle


def test_two_requests_on_one_connection_reuse_one_upstream_connection(upstream: MockProviderHandle) -> None:
    port = free_port()
    relay = start_bare_relay_process(port, upstream.port)
    client = Client(port)
    try:
        for body in (b'{"n":1}', b'{"n":2,"pad":"' + b"x" * 5000 + b'"}'):
            response = client.request("POST", "/debug/echo", body, [("content-type", "application/json"),
                                                                      ("connection", "keep-alive")])
            assert response.status == 200
            echo = json.loads(response.body)
            assert echo["body"].encode() == body
            headers = dict(echo["headers"])
            assert headers["host"] == upstream.address
            assert "connection" not in headers
            assert headers["content-type"] == "application/json"
            assert response.headers["x-mock-provider"] == "relay-upstream"
        assert established_to(upstream.port) == 1
    finally:
        client.close()
        terminate(relay, 5.0)


def test_an_unreachable_upstream_is_a_502_with_an_error_body() -> None:
    port = free_port()
    relay = start_bare_relay_process(port, refused_port())  # nothing listens there, nor ever will
    try:
        response = Client(port).request("POST", "/v1/chat/completions", b"{}")
        assert response.status == 502
        assert response.json()["error"]["code"] == "upstream_unreachable"
    finally:
        terminate(relay, 5.0)
