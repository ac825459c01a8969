"""Commands nobody reads the reply of (gateway/valkey/tick_batch.py ``send_quiet``: the response cache's
claims, announcements and SETs) on the quiet writer's connection in CLIENT REPLY OFF
(gateway/valkey/quiet_writer.py): against the bundled Valkey they are served and answered with nothing;
a repeated failure is still heard; a server without ``CLIENT REPLY`` (a fake one on a raw socket) gets
them on the ordinary connection, each with its reply; a reply on the quiet connection ends it."""

from __future__ import annotations

import asyncio
import uuid

import uvloop

from gateway.valkey.client import create_client
from gateway.valkey.quiet_writer import QuietWriter
from gateway.valkey.resp import encode_command, read_reply
from gateway.valkey.tick_batch import _HEAR_EVERY, TickBatch


def _set(key: bytes, value: bytes) -> bytes:
    return encode_command((b"SET", key, value))


def _batch(url: str) -> tuple[TickBatch, list[BaseException | None]]:
    heard: list[BaseException | None] = []
    quiet = QuietWriter.from_url(url, 1.0, heard.append)
    batch = TickBatch(create_client(url), quiet)
    batch.on_detached = heard.append
    return batch, heard


async def _close(batch: TickBatch) -> None:
    await batch.client.aclose()
    await batch.quiet_writer.aclose()


def test_quiet_commands_are_served_and_answered_with_nothing(valkey_url):
    async def scenario() -> None:
        batch, heard = _batch(valkey_url)
        base = f"test:quiet:{uuid.uuid4().hex}:".encode()
        try:
            for i in range(_HEAR_EVERY - 1):  # before the connection is made, and after
                batch.send_quiet(_set(base + b"%d" % i, b"v%d" % i))
                await asyncio.sleep(0.01 if i == 0 else 0)
            await batch.quiet_writer.synced()
            assert batch.quiet_writer.supported is True
            conn = batch.quiet_writer.client._conn
            got = await asyncio.gather(*(batch.call(b"GET", base + b"%d" % i) for i in range(_HEAR_EVERY - 1)))
            assert got == [b"v%d" % i for i in range(_HEAR_EVERY - 1)]
            assert conn.error is None and conn.quiet  # nothing came back on it: it would have ended it
            assert (batch.detached, heard) == (0, [])
        finally:
            await _close(batch)
    uvloop.run(scenario())


def test_a_repeated_failure_of_quiet_commands_is_heard(valkey_url):
    """No reply means no error reply either: one quiet command in ``_HEAR_EVERY`` goes with its reply on
    the ordinary connection, so a failure that repeats (here an INCR of a string; in production a full or
    read-only Valkey) is heard."""
    async def scenario() -> None:
        batch, heard = _batch(valkey_url)
        key = f"test:quiet:{uuid.uuid4().hex}".encode()
        try:
            await batch.call(b"SET", key, b"not a number")
            for _ in range(_HEAR_EVERY):
                batch.send_quiet(encode_command((b"INCR", key)))
                await asyncio.sleep(0)  # a tick each
            await batch.quiet_writer.synced()
            assert heard == []  # on the quiet connection: their error replies were never sent
            batch.send_quiet(encode_command((b"INCR", key)))
            assert await batch.call(b"PING") == b"PONG"
            assert len(heard) == 1 and isinstance(heard[0], Exception), heard
            assert await batch.call(b"GET", key) == b"not a number"
        finally:
            await _close(batch)
    uvloop.run(scenario())


def test_a_reply_on_the_quiet_connection_ends_it_and_the_next_write_makes_a_new_one(valkey_url):
    """Its CLIENT REPLY OFF refused (a BUSY script, say): replies arrive where nobody waits for one. The
    connection is dropped (no reply can be taken for another command's), and a new one is made."""
    async def scenario() -> None:
        batch, heard = _batch(valkey_url)
        key = f"test:quiet:{uuid.uuid4().hex}".encode()
        try:
            batch.send_quiet(_set(key, b"1"))
            await asyncio.sleep(0)
            await batch.quiet_writer.synced()
            first = batch.quiet_writer.client._conn
            batch.quiet_writer.write(b"*3\r\n$6\r\nCLIENT\r\n$5\r\nREPLY\r\n$2\r\nON\r\n" + encode_command((b"PING",)))
            await asyncio.wait_for(first.closed, 2)
            assert first.error is not None
            batch.send_quiet(_set(key, b"2"))
            await asyncio.sleep(0)
            await batch.quiet_writer.synced()
            assert batch.quiet_writer.client._conn is not first
            assert await batch.call(b"GET", key) == b"2"
        finally:
            await _close(batch)
    uvloop.run(scenario())


def test_a_server_without_client_reply_gets_every_command_with_its_reply():
    """A server (a proxy, an old Redis) that refuses ``CLIENT``: the probe's error reply says so, and the
    quiet commands go on the ordinary connection with their replies, each heard in its place."""
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
        batch, heard = _batch(f"valkey://127.0.0.1:{port}/0")
        try:
            batch.send_quiet(_set(b"first", b"v"))  # the probe: lost (as a failed write), not an error
            for _ in range(100):
                if batch.quiet_writer.supported is not None:
                    break
                await asyncio.sleep(0.01)
            assert batch.quiet_writer.supported is False
            gets = []
            for i in range(_HEAR_EVERY * 2):
                batch.send_quiet(_set(b"k%d" % i, b"v"))
                gets.append(batch.call(b"GET", b"k%d" % i))
            assert await asyncio.gather(*gets) == [b"k%d" % i for i in range(_HEAR_EVERY * 2)]
            assert (batch.detached, heard) == (0, [])
            sets = [command[1] for command in seen if command[0] == b"SET"]
            assert sets == [b"k%d" % i for i in range(_HEAR_EVERY * 2)]
        finally:
            await _close(batch)
            server.close()
    uvloop.run(scenario())
