"""Commands nobody reads the reply of (gateway/valkey/tick_batch.py ``send_quiet``, the response cache's
claims, announcements and SETs) written after ``CLIENT REPLY SKIP``: against the bundled Valkey the
replies around them stay in place and only the sampled ones come back; a repeated failure is still heard;
a server without ``CLIENT REPLY`` (a fake one on a raw socket) is never sent a SKIP and answers them all."""

from __future__ import annotations

import asyncio
import uuid

import uvloop

from gateway.valkey.client import create_client
from gateway.valkey.resp import encode_command, read_reply
from gateway.valkey.tick_batch import _HEAR_EVERY, TickBatch


def _set(key: bytes, value: bytes) -> bytes:
    return encode_command((b"SET", key, value))


def test_skipped_replies_never_arrive_and_the_replies_around_them_stay_in_place(valkey_url):
    async def scenario() -> None:
        batch = TickBatch(create_client(valkey_url, skip_replies=True))
        heard: list[BaseException | None] = []
        batch.on_detached = heard.append
        base = f"test:skip:{uuid.uuid4().hex}:".encode()
        try:
            assert await batch.call(b"PING") == b"PONG"  # connected, probed: its server skips replies
            assert batch.client.skips_replies
            assert await batch.call(b"PING") == b"PONG"  # a write on that connection: the batch knows it too
            conn = batch.client._conn
            read_before = conn._replies
            # One tick: quiet SETs between awaited GETs of the keys they set (order kept on the wire).
            gets = []
            for i in range(5):
                batch.send_quiet(_set(base + b"%d" % i, b"v%d" % i))
                gets.append(batch.call(b"GET", base + b"%d" % i))
            assert await asyncio.gather(*gets) == [b"v%d" % i for i in range(5)]
            assert conn._replies - read_before == 5  # the GETs' replies only: none for the five SETs
            assert (batch.detached, heard) == (0, [])
        finally:
            await batch.client.aclose()
    uvloop.run(scenario())


def test_a_repeated_failure_of_quiet_commands_is_heard(valkey_url):
    """No reply means no error reply either: one quiet command in ``_HEAR_EVERY`` keeps its reply, so a
    failure that repeats (here an INCR of a string; in production a full or read-only Valkey) is heard."""
    async def scenario() -> None:
        batch = TickBatch(create_client(valkey_url, skip_replies=True))
        heard: list[BaseException | None] = []
        batch.on_detached = heard.append
        key = f"test:skip:{uuid.uuid4().hex}".encode()
        try:
            await batch.call(b"SET", key, b"not a number")
            await batch.call(b"PING")  # a write on the probed connection: the batch knows it skips replies
            for _ in range(_HEAR_EVERY):
                batch.send_quiet(encode_command((b"INCR", key)))
                await asyncio.sleep(0)  # a tick each
            assert await batch.call(b"PING") == b"PONG"
            assert heard == []  # skipped: their error replies were never sent
            batch.send_quiet(encode_command((b"INCR", key)))
            assert await batch.call(b"PING") == b"PONG"
            assert len(heard) == 1 and isinstance(heard[0], Exception), heard
            assert await batch.call(b"GET", key) == b"not a number"
        finally:
            await batch.client.aclose()
    uvloop.run(scenario())


def test_a_server_without_client_reply_is_never_sent_a_skip_and_answers_every_command():
    """A server (a proxy, an old Redis) that refuses ``CLIENT``: the probe's error reply says so, the
    quiet commands go with their replies, each heard in its place (a SKIP it ignored would have shifted
    every later reply onto the wrong command)."""
    seen: list[list[bytes]] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        buffer = b""
        while data := await reader.read(65536):
            buffer += data
            pos = 0
            while pos < len(buffer):
                command, after = read_reply(buffer, pos)  # a command is an array of bulk strings
                if not isinstance(command, list):
                    break
                pos = after
                seen.append(command)
                name = command[0].upper()
                if name == b"CLIENT":
                    writer.write(b"-ERR unknown command 'CLIENT'\r\n")
                elif name == b"GET":
                    writer.write(b"$%d\r\n%b\r\n" % (len(command[1]), command[1]))  # its own key back
                else:
                    writer.write(b"+OK\r\n")
            buffer = buffer[pos:]
        writer.close()

    async def scenario() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        batch = TickBatch(create_client(f"valkey://127.0.0.1:{port}/0", skip_replies=True))
        heard: list[BaseException | None] = []
        batch.on_detached = heard.append
        try:
            assert await batch.call(b"GET", b"first") == b"first"
            assert not batch.client.skips_replies
            gets = []
            for i in range(_HEAR_EVERY * 2):
                batch.send_quiet(_set(b"k%d" % i, b"v"))
                gets.append(batch.call(b"GET", b"k%d" % i))
            assert await asyncio.gather(*gets) == [b"k%d" % i for i in range(_HEAR_EVERY * 2)]
            assert (batch.detached, heard) == (0, [])
            assert not any(b"SKIP" in command for command in seen)
        finally:
            await batch.client.aclose()
            server.close()
    uvloop.run(scenario())
