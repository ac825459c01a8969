"""The lean RESP2 client against the bundled Valkey (and raw sockets for what a healthy server never
does): every reply type, ordering under load, errors as valkey-py's classes, AUTH/SELECT, restarts,
timeouts and the pending bound. Each test runs on asyncio's loop and on uvloop (the workers' loop)."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvloop
from valkey.exceptions import (
    AuthenticationError,
    ConnectionError,
    DataError,
    NoScriptError,
    ResponseError,
    TimeoutError,
)

from gateway.valkey.client import create_client
from gateway.valkey.embedded import EmbeddedValkey
from gateway.valkey.resp import INCOMPLETE, RespClient, encode_command, read_reply
from gateway.valkey.resp_transport import RespTransport
from tests.harness import free_port, refused_port

Run = Callable[[Coroutine[Any, Any, Any]], Any]


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Run:
    return asyncio.run if request.param == "asyncio" else uvloop.run


@pytest.fixture(scope="module")
def tcp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedValkey]:
    """A Valkey on loopback TCP, which EmbeddedValkey protects with a random password."""
    server = EmbeddedValkey(tmp_path_factory.mktemp("valkey-tcp"), port=free_port())
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _key() -> str:
    return f"resp-test:{uuid.uuid4().hex[:12]}"


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A listener that accepts (in the kernel backlog) and never answers: a hung server."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()


# --- encoding and parsing (pure) ------------------------------------------------------------------


def test_commands_are_encoded_as_bulk_string_arrays() -> None:
    assert encode_command(("SET", b"k\r\n", 42)) == b"*3\r\n$3\r\nSET\r\n$3\r\nk\r\n\r\n$2\r\n42\r\n"
    with pytest.raises(DataError):
        encode_command(("SET", "k", True))


STREAM = (
    b"+OK\r\n:-42\r\n$5\r\nhe\r\nl\r\n$-1\r\n$0\r\n\r\n*-1\r\n*0\r\n"
    b"*3\r\n:1\r\n*2\r\n$1\r\nx\r\n-ERR inner\r\n$-1\r\n-NOSCRIPT No matching script.\r\n"
)


def _parse_all(buf: bytes) -> list[Any]:
    replies, pos = [], 0
    while pos < len(buf):
        value, pos = read_reply(buf, pos)
        assert value is not INCOMPLETE
        replies.append(value)
    return replies


def test_reply_parser_reads_every_type_and_waits_at_every_split_point() -> None:
    replies = _parse_all(STREAM)
    assert replies[:7] == [b"OK", -42, b"he\r\nl", None, b"", None, []]
    nested = replies[7]
    assert nested[0] == 1 and nested[1][0] == b"x" and nested[2] is None
    assert type(nested[1][1]) is ResponseError and str(nested[1][1]) == "inner"
    assert type(replies[8]) is NoScriptError
    # Cut anywhere: the parser reports "incomplete" with a need beyond the cut, or a whole reply.
    starts = [0]
    for _ in replies:
        starts.append(read_reply(STREAM, starts[-1])[1])
    for cut in range(1, len(STREAM)):
        start = max(s for s in starts if s < cut)
        value, need = read_reply(STREAM[:cut], start)
        if cut in starts:
            assert value is not INCOMPLETE
        else:
            assert value is INCOMPLETE and need > cut


# --- against the bundled Valkey -------------------------------------------------------------------


def test_round_trips_of_every_reply_type(valkey_url: str, run: Run) -> None:
    key, big = _key(), b"\r\n".join(b"%07d" % i for i in range(120_000))  # ~1 MB: many reads

    async def scenario() -> None:
        client = RespClient.from_url(valkey_url, timeout_s=2)
        try:
            assert await client.execute_command("SET", key, big) == b"OK"
            assert await client.execute_command("GET", key) == big
            assert await client.execute_command("GET", key + ":missing") is None
            assert await client.execute_command("INCRBY", key + ":n", -5) == -5
            assert await client.execute_command("RPUSH", key + ":l", b"a", b"") == 2
            assert await client.execute_command("LRANGE", key + ":l", 0, -1) == [b"a", b""]
            assert await client.execute_command("LRANGE", key + ":missing", 0, -1) == []
            assert await client.execute_command("BLPOP", key + ":missing", "0.01") is None  # nil array
            nested = "return {1, {'x', {}}, 'y'}"
            assert await client.execute_command("EVAL", nested, 0) == [1, [b"x", []], b"y"]
            assert await client.execute_command("PTTL", key) == -1
            assert [k async for k in client.scan_iter(match=key + ":*", count=1000)] != []
        finally:
            await client.aclose()

    run(scenario())


def test_a_thousand_concurrent_commands_and_pipelines_keep_their_order(valkey_url: str, run: Run) -> None:
    def payload(i: int) -> bytes:
        return b"%d:" % i + b"x" * (i * 37 % 3000)  # uneven sizes: replies split across reads

    async def pipelined(client: RespClient, i: int) -> list[Any]:
        pipe = client.pipeline(transaction=False)
        for j in range(10):
            pipe.execute_command("ECHO", payload(i + j))
        return await pipe.execute()

    async def scenario() -> None:
        client = RespClient.from_url(valkey_url, timeout_s=2)
        try:
            calls = [
                pipelined(client, i) if i % 100 == 0 else client.execute_command("ECHO", payload(i))
                for i in range(1000)
            ]
            replies = await asyncio.gather(*calls)
            for i, reply in enumerate(replies):
                expected = [payload(i + j) for j in range(10)] if i % 100 == 0 else payload(i)
                assert reply == expected, i
        finally:
            await client.aclose()

    run(scenario())


def test_a_caller_that_gives_up_does_not_shift_the_replies(valkey_url: str, run: Run) -> None:
    async def scenario() -> None:
        client = RespClient.from_url(valkey_url, timeout_s=2)
        try:
            with pytest.raises(asyncio.TimeoutError):
                async with asyncio.timeout(0.05):
                    await client.execute_command("BLPOP", _key(), "0.2")
            # Sent behind the abandoned BLPOP: its nil reply must be skipped, not handed to us.
            assert await client.execute_command("ECHO", b"mine") == b"mine"
        finally:
            await client.aclose()

    run(scenario())


def test_error_replies_raise_valkey_py_classes_and_the_connection_survives(valkey_url: str, run: Run) -> None:
    key = _key()

    async def scenario() -> None:
        client = RespClient.from_url(valkey_url, timeout_s=2)
        try:
            await client.execute_command("SET", key, "not a number")
            with pytest.raises(ResponseError, match="not an integer"):
                await client.execute_command("INCR", key)
            with pytest.raises(NoScriptError):
                await client.execute_command("EVALSHA", "0" * 40, 1, key)
            sha = await client.script_load("return KEYS[1]")
            assert sha == await client.script_load("return KEYS[1]") and isinstance(sha, str)
            assert await client.execute_command("EVALSHA", sha, 1, key) == key.encode()
            assert await client.execute_command("SCRIPT", "FLUSH") == b"OK"
            with pytest.raises(NoScriptError):
                await client.execute_command("EVALSHA", sha, 1, key)
        finally:
            await client.aclose()

    run(scenario())


def test_pipeline_returns_errors_in_place_or_raises_the_first(valkey_url: str, run: Run) -> None:
    key = _key()

    async def scenario() -> None:
        client = RespClient.from_url(valkey_url, timeout_s=2)
        try:
            pipe = client.pipeline(transaction=False)
            pipe.execute_command("SET", key, "v").execute_command("EVALSHA", "0" * 40, 1, key).execute_command("INCR", key)
            first, noscript, not_int = await pipe.execute(raise_on_error=False)
            assert first == b"OK" and type(noscript) is NoScriptError and type(not_int) is ResponseError
            assert await pipe.execute() == []  # executing emptied it
            pipe.execute_command("GET", key).execute_command("INCR", key)
            with pytest.raises(ResponseError):
                await pipe.execute()
            with pytest.raises(NotImplementedError):
                client.pipeline()  # MULTI/EXEC is not offered rather than silently not atomic
        finally:
            await client.aclose()

    run(scenario())


def test_db_comes_from_the_url(valkey_url: str, run: Run) -> None:
    key = _key()
    db3 = f"{valkey_url}?db=3" if valkey_url.startswith("unix:") else valkey_url.rsplit("/", 1)[0] + "/3"

    async def scenario() -> None:
        default, selected = (
            RespClient.from_url(valkey_url, timeout_s=2),
            RespClient.from_url(db3, timeout_s=2),
        )
        try:
            await selected.execute_command("SET", key, "in-3")
            assert await selected.execute_command("GET", key) == b"in-3"
            assert await default.execute_command("GET", key) is None
        finally:
            await default.aclose()
            await selected.aclose()

    run(scenario())


def test_create_client_is_the_lean_client_for_a_single_node(valkey_url: str) -> None:
    client = create_client(valkey_url)
    assert type(client) is RespTransport and isinstance(client, RespClient)  # the lean client, as the ledger's transport
    with pytest.raises(ValueError, match="max_connections"):
        create_client(valkey_url + "?max_connections=4")  # a pool option would silently do nothing


def test_auth_uses_the_password_from_the_url(tcp_server: EmbeddedValkey, run: Run) -> None:
    url = tcp_server.url
    assert url is not None and "@" in url
    port = url.rsplit(":", 1)[1].split("/")[0]

    async def attempt(target: str) -> Any:
        client = RespClient.from_url(target, timeout_s=2)
        try:
            return await client.execute_command("PING")
        finally:
            await client.aclose()

    async def scenario() -> None:
        assert await attempt(url) == b"PONG"
        assert await attempt(url.replace("://:", "://default:")) == b"PONG"  # ACL user + password
        with pytest.raises(AuthenticationError):
            await attempt(f"valkey://:wrong@127.0.0.1:{port}/0")
        with pytest.raises(AuthenticationError):  # NOAUTH
            await attempt(f"valkey://127.0.0.1:{port}/0")

    run(scenario())


def test_restart_fails_pending_commands_and_the_next_command_reconnects(tmp_path: Path, run: Run) -> None:
    server = EmbeddedValkey(tmp_path / "valkey", port=free_port())
    url = server.start()

    async def scenario() -> None:
        client = RespClient.from_url(url, timeout_s=5)
        try:
            assert await client.execute_command("PING") == b"PONG"
            # A blocked BLPOP and the commands queued behind it are all pending when the server goes.
            pending = [asyncio.ensure_future(client.execute_command("BLPOP", _key(), 30))]
            pending += [asyncio.ensure_future(client.execute_command("PING")) for _ in range(3)]
            await asyncio.sleep(0.05)
            server.stop()
            for future in pending:
                with pytest.raises(ConnectionError):
                    await future
            with pytest.raises(ConnectionError):  # nobody listens now
                await client.execute_command("PING")
            server.start()
            assert await client.execute_command("PING") == b"PONG"
        finally:
            await client.aclose()

    try:
        run(scenario())
    finally:
        server.stop()


def test_a_silent_server_times_out_replies_and_connection_setup(silent_port: int, run: Run) -> None:
    async def scenario() -> None:
        client = RespClient.from_url(f"valkey://127.0.0.1:{silent_port}/0", timeout_s=0.1)
        try:
            for _ in range(2):  # the stuck connection is dropped; the next command opens a new one
                started = time.perf_counter()
                with pytest.raises(TimeoutError, match="reading"):
                    await client.execute_command("PING")
                assert 0.09 <= time.perf_counter() - started < 1.0  # detected within 1-2 periods
        finally:
            await client.aclose()
        # With a password, the unanswered AUTH is part of connecting: the connect timeout applies.
        client = RespClient.from_url(f"valkey://:pw@127.0.0.1:{silent_port}/0", timeout_s=0.1)
        started = time.perf_counter()
        with pytest.raises(TimeoutError, match="connecting"):
            await client.execute_command("PING")
        assert time.perf_counter() - started < 1.0

    run(scenario())


def test_connection_refused_and_tls_to_a_plain_server_are_connection_errors(run: Run) -> None:
    async def scenario() -> None:
        refused = RespClient.from_url(f"valkey://127.0.0.1:{refused_port()}/0", timeout_s=1)
        with pytest.raises(ConnectionError, match="Error connecting"):
            await refused.execute_command("PING")
        # Proves rediss:// really speaks TLS: a plain-text server cannot complete the handshake.
        server = await asyncio.start_server(_answer_garbage, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            tls = RespClient.from_url(f"rediss://127.0.0.1:{port}/0?ssl_cert_reqs=none", timeout_s=1)
            with pytest.raises(ConnectionError):
                await tls.execute_command("PING")
        finally:
            server.close()

    run(scenario())


async def _answer_garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.read(1)
    writer.write(b"-ERR this is not TLS\r\n")
    writer.close()


def test_pending_commands_are_bounded(silent_port: int, run: Run) -> None:
    async def scenario() -> None:
        client = RespClient.from_url(f"valkey://127.0.0.1:{silent_port}/0", timeout_s=5, max_pending=2)
        waiting = [asyncio.ensure_future(client.execute_command("PING")) for _ in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(ConnectionError, match="Too many pending"):
            await client.execute_command("PING")
        await client.aclose()
        for future in waiting:
            with pytest.raises(ConnectionError, match="closed by client"):
                await future

    run(scenario())


def test_replies_dribbled_byte_by_byte_resolve_in_order(run: Run) -> None:
    async def dribble(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(len(encode_command(("PING",))) * 9)
        for i in range(len(STREAM)):
            writer.write(STREAM[i : i + 1])
            await writer.drain()
            await asyncio.sleep(0)
        await reader.read()  # until the client closes
        writer.close()

    async def scenario() -> None:
        server = await asyncio.start_server(dribble, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = RespClient.from_url(f"valkey://127.0.0.1:{port}/0", timeout_s=2)
        try:
            replies = await asyncio.gather(
                *(client.execute_command("PING") for _ in range(9)), return_exceptions=True
            )
            assert replies[:7] == [b"OK", -42, b"he\r\nl", None, b"", None, []]
            assert replies[7][0] == 1 and type(replies[7][1][1]) is ResponseError
            assert type(replies[8]) is NoScriptError  # a top-level error reply is raised
        finally:
            await client.aclose()
            server.close()

    run(scenario())


def test_send_each_resolves_each_commands_own_future_whole_or_split(run: Run) -> None:
    """``send_each``: one write, each reply straight into its receiver (an error reply as its exception),
    the OK and nil fast paths in place whether a read holds the replies whole or cut anywhere."""
    answers = b"+OK\r\n$-1\r\n$3\r\nabc\r\n-ERR wrong\r\n+OK\r\n:7\r\n$-1\r\n"

    async def scenario(cut: int) -> None:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readexactly(len(encode_command(("PING",))) * 7)
            writer.write(answers[:cut])
            await writer.drain()
            await asyncio.sleep(0.01)
            writer.write(answers[cut:])
            await reader.read()
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = RespClient.from_url(f"valkey://127.0.0.1:{port}/0", timeout_s=2)
        loop = asyncio.get_running_loop()
        try:
            futures = [loop.create_future() for _ in range(7)]
            client.send_each(encode_command(("PING",)) * 7, [(future, 0) for future in futures])
            replies = await asyncio.gather(*futures, return_exceptions=True)
            assert replies[:3] == [b"OK", None, b"abc"] and replies[4:] == [b"OK", 7, None], cut
            assert type(replies[3]) is ResponseError
        finally:
            await client.aclose()
            server.close()

    for cut in range(len(answers) + 1):
        run(scenario(cut))
