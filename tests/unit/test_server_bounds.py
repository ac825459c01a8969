"""The client-facing server's bounds, driven without sockets (tests/sansio_server.py): the real parse
loop of workers/server.py, a stand-in transport that records pause/resume and plays a slow client.

End to end, with real processes and the worker's RSS: tests/integration/test_client_bounds.py.
"""

from __future__ import annotations

import asyncio

import pytest

from gateway.config import ConfigError, parse_config
from tests.fuzz_http import request
from tests.sansio_server import StandInTransport, echo_handler, serve, settings, settle, split_answers
from workers.server import _PIPELINE_BUFFER_LIMIT, _PIPELINE_HARD_LIMIT, ServerConnection
from workers.server_state import ServerState

GET = b"GET /r HTTP/1.1\r\nHost: g\r\n\r\n"


def test_nothing_more_is_parsed_while_the_client_leaves_its_answers_unread():
    async def scenario():
        state = ServerState(settings(), echo_handler)
        connection = ServerConnection(state)
        transport = StandInTransport(connection, window=10)  # the first answer fills the client's window
        connection.connection_made(transport)
        connection.data_received(GET * 50)
        await settle()
        unread = len(split_answers(bytes(transport.out)))
        waiting = connection.codec.buffered
        transport.client_reads()  # the client reads: the next request is parsed, and so on
        for _ in range(60):
            transport.client_reads()
            await settle()
        return unread, waiting, len(split_answers(bytes(transport.out)))

    unread, waiting, answered = asyncio.run(scenario())
    assert unread == 1 and waiting == len(GET) * 49
    assert answered == 50


def test_pipelined_bytes_past_the_ceiling_stop_the_reading_until_they_are_parsed():
    release = asyncio.Event

    async def scenario():
        gate = release()

        async def slow(exchange):
            await gate.wait()
            await echo_handler(exchange)

        state = ServerState(settings(max_requests_per_connection=10**6), slow)
        connection = ServerConnection(state)
        transport = StandInTransport(connection)
        connection.connection_made(transport)
        connection.data_received(GET)  # being answered...
        await settle_briefly()
        piece = GET * 1000  # ... while 27 KB arrive, then 27 KB more, then 27 KB more
        readings = []
        for _ in range(3):
            connection.data_received(piece)
            readings.append(transport.reading)
        gate.set()
        await settle()
        return readings, transport.reading, len(split_answers(bytes(transport.out)))

    async def settle_briefly():
        for _ in range(5):
            await asyncio.sleep(0)

    readings, reading_after, answered = asyncio.run(scenario())
    assert readings == [True, True, False]  # paused once more than 64 KiB wait
    assert reading_after and answered == 3001  # resumed once parsed, nothing lost
    assert 2 * len(GET * 1000) <= _PIPELINE_BUFFER_LIMIT < 3 * len(GET * 1000)


def test_a_transport_that_keeps_delivering_after_the_pause_is_dropped():
    async def scenario():
        never = asyncio.Event()

        async def stuck(exchange):
            await never.wait()

        state = ServerState(settings(), stuck)
        connection = ServerConnection(state)
        transport = StandInTransport(connection)
        connection.connection_made(transport)
        connection.data_received(GET)
        for _ in range(_PIPELINE_HARD_LIMIT // 65536 + 2):
            connection.data_received(b"x" * 65536)
        await asyncio.sleep(0)
        never.set()
        await settle()
        return transport, connection.codec.buffered

    transport, _ = asyncio.run(scenario())
    assert transport.aborted


def test_bodies_count_against_the_worker_budget_until_their_answer_ends():
    body = b'{"model": "m", "pad": "' + b"p" * 1000 + b'"}'
    observed: list[int] = []

    async def observing(exchange):
        observed.append(exchange.conn.server.body_bytes)
        await echo_handler(exchange)

    for framing in ("length", "chunked"):
        observed.clear()
        wire = request(framing, body=body, sizes=[100]).wire
        result = asyncio.run(serve([wire, wire], settings(max_buffered_body_bytes_per_worker=1 << 20,
                                                          max_body_bytes=1 << 20), handler=observing))
        assert observed == [len(body), len(body)]  # held while handled, once each
        assert result.state.body_bytes == 0  # released when the answer ended


def test_a_body_beyond_the_worker_budget_gets_503_and_its_connection_dying_gives_the_bytes_back():
    budget = settings(max_buffered_body_bytes_per_worker=2000, max_body_bytes=2000)

    async def scenario():
        state = ServerState(budget, echo_handler)
        holders = []
        for _ in range(2):  # two uploads in progress, 1,000 bytes announced each: the budget is full
            connection = ServerConnection(state)
            transport = StandInTransport(connection)
            connection.connection_made(transport)
            connection.data_received(b"POST /a HTTP/1.1\r\nHost: g\r\nContent-Length: 1000\r\n\r\nxx")
            holders.append((connection, transport))
        full = state.body_bytes
        refused = []
        for wire in (request("length", body=b"y" * 10).wire, request("chunked", body=b"y" * 10).wire):
            connection = ServerConnection(state)
            transport = StandInTransport(connection)
            connection.connection_made(transport)
            connection.data_received(wire)
            refused.append((split_answers(bytes(transport.out)), transport.finished))
        for _connection, transport in holders:
            transport.abort()  # the uploads die mid-body
        await settle()
        return full, refused, state.body_bytes

    full, refused, after = asyncio.run(scenario())
    assert full == 2000
    for answers, finished in refused:
        (status, head, body), = answers
        assert status == 503 and b"retry-after: 1" in head and b"server_busy" in body and finished
    assert after == 0


@pytest.mark.parametrize(("extra", "expected"), [
    ("limits: {max_header_count: 0}", "limits.max_header_count: must be >= 1"),
    ("limits: {max_body_bytes: 1000, max_buffered_body_bytes_per_worker: 999}",
     "limits.max_buffered_body_bytes_per_worker: must be >= max_body_bytes"),
    ("timeouts: {body_read: 0s}", "timeouts.body_read: must be >= 100ms"),
])
def test_the_bound_settings_are_checked_and_errors_name_the_field(extra, expected):
    with pytest.raises(ConfigError) as caught:
        parse_config(_CONFIG + extra)
    assert any(problem.startswith(expected) for problem in caught.value.problems), caught.value.problems


def test_the_bound_settings_have_their_documented_defaults():
    config = parse_config(_CONFIG)
    assert config.limits.max_header_count == 100
    assert config.limits.max_buffered_body_bytes_per_worker == 256 * 1024 * 1024
    assert config.timeouts.body_read == 60


_CONFIG = """
clusters: [{name: a, endpoints: ["127.0.0.1:1"]}]
routing: {candidates: [{kind: inference_model, name: m, site: s, cluster: a}]}
"""
