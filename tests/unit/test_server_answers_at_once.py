"""A handler that answers in the server's read of the request (workers/server.py ``_dispatch``): no task, the
same bytes and order as a handler that waits, driven without sockets (tests/sansio_server.py).

The gateway's own handler (workers/proxy.py ``Proxy.handle``) answers a hit from the worker's copy and a
refusal this way; end to end: tests/integration/test_response_cache.py.
"""

from __future__ import annotations

import asyncio

from tests.sansio_server import StandInTransport, echo_handler, serve, settings, settle, split_answers
from workers.server import ServerConnection
from workers.server_state import ServerState


def get(path: bytes) -> bytes:
    return b"GET " + path + b" HTTP/1.1\r\nHost: g\r\n\r\n"


def at_once(exchange) -> None:
    """Answers at once, the way ``echo_handler`` does after its wait."""
    exchange.respond(200, [(b"content-type", b"text/plain")], exchange.method + b" " + exchange.target + b"\n")


def mixed(exchange):
    """Paths under /wait/ are answered after a wait (a task); the others at once; /boom raises at once."""
    if exchange.target == b"/boom":
        raise RuntimeError("the handler failed")
    if exchange.target.startswith(b"/wait/"):
        return wait_then_answer(exchange)
    at_once(exchange)
    return None


async def wait_then_answer(exchange) -> None:
    for _ in range(3):
        await asyncio.sleep(0)
    at_once(exchange)


def test_pipelined_requests_answered_at_once_leave_in_order_before_the_loop_runs_again():
    count = 3000  # far beyond the recursion limit, were each answer to parse the next one inside it

    async def scenario():
        connection = ServerConnection(ServerState(settings(max_requests_per_connection=10**6), at_once))
        transport = StandInTransport(connection)
        connection.connection_made(transport)
        connection.data_received(b"".join(get(b"/r%d" % i) for i in range(count)))
        written = split_answers(bytes(transport.out))  # before any task or callback could run
        tasks = len(asyncio.all_tasks())
        connection.eof_received()
        await settle()
        return written, tasks, transport

    written, tasks, transport = asyncio.run(scenario())
    assert [body for _, _, body in written] == [b"GET /r%d\n" % i for i in range(count)]
    assert tasks == 1  # the scenario's own: no request took one
    assert not transport.aborted


def test_answers_at_once_and_after_a_wait_keep_the_requests_order():
    paths = [b"/a", b"/wait/b", b"/c", b"/d", b"/wait/e", b"/wait/f", b"/g"]

    async def scenario():
        return await serve([b"".join(map(get, paths))], settings(), handler=mixed)

    run = asyncio.run(scenario())
    assert [body for _, _, body in run.answers()] == [b"GET " + path + b"\n" for path in paths]
    assert not run.loop_errors


def test_a_handler_that_fails_at_once_answers_500_and_the_connection_goes_on():
    async def scenario():
        return await serve([get(b"/a") + get(b"/boom") + get(b"/wait/c") + get(b"/d")], settings(), handler=mixed)

    run = asyncio.run(scenario())
    answers = run.answers()
    assert [status for status, _, _ in answers] == [200, 500, 200, 200]
    assert b"internal_error" in answers[1][2]
    assert answers[2][2] == b"GET /wait/c\n" and answers[3][2] == b"GET /d\n"


def test_a_handler_that_returns_without_answering_cuts_the_connection():
    def silent(exchange) -> None:
        if exchange.target == b"/silent":
            return None
        return at_once(exchange)

    async def scenario():
        return await serve([get(b"/a") + get(b"/silent") + get(b"/b")], settings(), handler=silent)

    run = asyncio.run(scenario())
    assert [body for _, _, body in run.answers()] == [b"GET /a\n"]
    assert run.transport.aborted  # the client sees a cut, never a false end; /b is not answered


def test_answers_at_once_stop_while_the_client_leaves_them_unread():
    async def scenario():
        connection = ServerConnection(ServerState(settings(), at_once))
        transport = StandInTransport(connection, window=10)  # the first answer fills the client's window
        connection.connection_made(transport)
        connection.data_received(get(b"/r") * 50)
        unread = len(split_answers(bytes(transport.out)))
        waiting = connection.codec.buffered
        for _ in range(60):
            transport.client_reads()
            await settle()
        return unread, waiting, len(split_answers(bytes(transport.out)))

    unread, waiting, answered = asyncio.run(scenario())
    assert unread == 1 and waiting == len(get(b"/r")) * 49
    assert answered == 50


def test_an_async_handler_still_serves_every_request():
    async def scenario():
        return await serve([get(b"/a") + get(b"/b")], settings(), handler=echo_handler)

    run = asyncio.run(scenario())
    assert [body for _, _, body in run.answers()] == [b"GET /a\n", b"GET /b\n"]
