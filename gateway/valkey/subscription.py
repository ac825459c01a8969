"""One channel's subscription on one Valkey node, lean: a RESP connection that, once subscribed, hands every
message's payload to a callback as it is read (the response cache's host index follows its announcements
with it: gateway/cache/index_follower.py).

Why not valkey-py's pubsub: its ``get_message`` costs a task wake-up, a lock and a generic parse per message;
announcements come at the rate of cache misses. Here ``data_received`` parses replies in place.

The connection uses a single-node URL's settings as ``RespClient`` reads them (host or unix path, TLS, AUTH;
SELECT does not matter to Pub/Sub). ``ping`` asks for a ``pong``, which ``on_alive`` hears: the follower's
proof that the connection still carries messages.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from valkey.exceptions import ConnectionError as ValkeyConnectionError
from valkey.exceptions import TimeoutError as ValkeyTimeoutError

from gateway.valkey.resp import RespClient
from gateway.valkey.resp_wire import INCOMPLETE, encode_command, read_reply

_PING = b"*1\r\n$4\r\nPING\r\n"


class Subscription(asyncio.Protocol):
    """A subscribed connection: ``on_message(payload)`` per message, ``on_alive()`` per pong or message;
    ``lost`` resolves when the connection ends (with the reason as its exception)."""

    def __init__(self, channel: bytes, on_message: Callable[[bytes], None], on_alive: Callable[[], None]) -> None:
        self.channel = channel
        self.on_message = on_message
        self.on_alive = on_alive
        self.transport: asyncio.Transport | None = None
        self.subscribed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._buffer = b""
        self._setup_replies = 0

    @classmethod
    async def open(cls, url: str, channel: bytes, on_message: Callable[[bytes], None], on_alive: Callable[[], None],
                   timeout_s: float) -> Subscription:
        """Connect, authenticate and subscribe within ``timeout_s`` (valkey-py's errors otherwise)."""
        settings: Any = RespClient.from_url(url, timeout_s=timeout_s)
        loop = asyncio.get_running_loop()
        protocol = cls(channel, on_message, on_alive)
        try:
            async with asyncio.timeout(timeout_s):
                if settings._path is not None:
                    await loop.create_unix_connection(lambda: protocol, settings._path, ssl=settings._ssl)
                else:
                    await loop.create_connection(lambda: protocol, settings._host, settings._port, ssl=settings._ssl)
                auth = settings._setup if settings._auth else b""
                protocol._setup_replies = 1 if auth else 0
                protocol.transport.write(auth + encode_command((b"SUBSCRIBE", channel)))  # type: ignore[union-attr]
                await protocol.subscribed
        except TimeoutError:  # asyncio.timeout's (an OSError too: first)
            protocol.close()
            raise ValkeyTimeoutError(f"Timeout subscribing at {settings._address}") from None
        except OSError as error:
            protocol.close()
            raise ValkeyConnectionError(f"Error connecting to {settings._address}: {error}") from error
        except BaseException:
            protocol.close()
            raise
        return protocol

    def ping(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(_PING)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer + data if self._buffer else data
        pos, end = 0, len(buffer)
        while pos < end:
            value, after = read_reply(buffer, pos)
            if value is INCOMPLETE:
                break
            pos = after
            self._take(value)
        self._buffer = buffer[pos:]

    def _take(self, value: Any) -> None:
        if isinstance(value, Exception):
            self._end(ValkeyConnectionError(f"the subscription was refused: {value}"))
            return
        if self._setup_replies:  # AUTH's +OK
            self._setup_replies -= 1
            return
        if value.__class__ is list and value:
            kind = value[0]
            if kind == b"message" and len(value) == 3:
                self.on_message(value[2])
                self.on_alive()
            elif kind == b"pong":
                self.on_alive()
            elif kind == b"subscribe" and not self.subscribed.done():
                self.subscribed.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(ValkeyConnectionError(f"the subscription's connection was lost: {exc}" if exc else
                                  "the subscription's connection was closed"))

    def _end(self, error: Exception) -> None:
        for future in (self.subscribed, self.lost):
            if not future.done():
                future.set_exception(error)
                future.exception()  # retrieved: whoever waits hears it; nobody else must
        if self.transport is not None:
            self.transport.abort()
