"""Commands nobody reads the reply of, on a connection of their own in ``CLIENT REPLY OFF``: the response
cache's claims, announcements and stored entries (gateway/valkey/tick_batch.py ``send_quiet``). Valkey sends
those commands no reply, so the worker reads, parses and resolves none.

Why a connection of its own, and not ``CLIENT REPLY SKIP`` before each command on the shared one: a SKIP
that the server refused (a ``BUSY`` script, ``LOADING``, an ACL) is answered with an error, and the command
after it with its own reply: two replies where none was counted would shift every later reply of that
connection onto the wrong command (another request's entry). Here no command ever waits on this
connection, so no reply can reach the wrong one: a reply that arrives at all (its OFF did not take) aborts
the connection, and the next write makes a new one.

The connection is probed as it is made: ``CLIENT REPLY ON`` answers ``OK`` where ``CLIENT REPLY`` exists
(Redis >= 3.2, Valkey), an error where it does not (some proxies). A server without it is marked
``supported = False`` and the batch sends these commands on its ordinary connection, with their replies.
Nothing here tells a command's failure (no reply, no error reply): the batch sends one in every few of them
on the ordinary connection, with its reply, so a failure that repeats is heard (tick_batch.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from gateway.valkey.client import BACKEND_ERRORS
from gateway.valkey.resp import RespClient

log = logging.getLogger("gridgate.valkey")
_REPLY_ON = b"*3\r\n$6\r\nCLIENT\r\n$5\r\nREPLY\r\n$2\r\nON\r\n"
_REPLY_OFF = b"*3\r\n$6\r\nCLIENT\r\n$5\r\nREPLY\r\n$3\r\nOFF\r\n"
_PING = b"*1\r\n$4\r\nPING\r\n"
MAX_BUFFER = 8 * 1024 * 1024  # unsent bytes at most (a server that stopped reading): then the connection goes
_MAX_WAITING = 1024  # writes kept while the connection is being made; beyond, they are lost (and told)


class QuietWriter:
    """One connection in CLIENT REPLY OFF, made lazily (and again after it was lost); ``write`` never waits."""

    def __init__(self, client: RespClient, on_error: Callable[[BaseException], None] | None = None) -> None:
        self.client = client  # a client of its own: its one connection is this writer's
        self.on_error = on_error  # told when writes were lost (the connection failed, or could not be made)
        self.supported: bool | None = None  # whether the server takes CLIENT REPLY (None: not known yet)
        self._conn: Any = None  # the client's connection once it is in CLIENT REPLY OFF
        self._waiting: list[bytes] = []
        self._connecting: asyncio.Task[None] | None = None
        self._paused = False  # replies are on for ``synced``'s PING: writes wait meanwhile

    def write(self, payload: bytes) -> None:
        """``payload`` (whole commands) on the connection, now, or once it is made."""
        conn = self._conn
        if conn is not None and conn.error is None:
            try:
                conn.write_quiet(payload, MAX_BUFFER)
            except BACKEND_ERRORS as error:
                self._lost(error)
            return
        waiting = self._waiting
        if len(waiting) < _MAX_WAITING:
            waiting.append(payload)
        if self._connecting is None and not self._paused:
            self._connecting = asyncio.ensure_future(self._connect())

    async def _connect(self) -> None:
        try:
            conn = await self.client.connection()
            replies = await conn.request(_REPLY_ON, 1)  # a batch of one: an error reply in place, not raised
            self.supported = replies[0] == b"OK"
            if not self.supported:  # the batch sends these commands with their replies from now on
                log.info("the Valkey server does not take CLIENT REPLY: every command gets its reply")
                self._waiting = []  # (lost, as in a failed write: a later miss, or one more upstream call)
                await self.client.aclose()
                return
            conn.quiet = True  # from here on a reply is a fault (its OFF refused): it aborts the connection
            conn.write_quiet(_REPLY_OFF, MAX_BUFFER)
            self._conn = conn
            waiting, self._waiting = self._waiting, []
            conn.write_quiet(b"".join(waiting), MAX_BUFFER)
        except BACKEND_ERRORS as error:
            self._lost(error)
        finally:
            self._connecting = None

    async def synced(self) -> None:
        """Every write so far was served: replies on for one PING, then off again (meanwhile writes wait,
        as while connecting: a write between ON and OFF would be answered). For tests and a clean close."""
        while self._connecting is not None:
            await asyncio.shield(self._connecting)
        conn = self._conn
        if conn is None or conn.error is not None:
            return
        self._conn = None
        self._paused = True
        try:
            conn.quiet = False
            await conn.request(_REPLY_ON + _PING, 2)
            conn.quiet = True
            conn.write_quiet(_REPLY_OFF, MAX_BUFFER)
            waiting, self._waiting = self._waiting, []
            conn.write_quiet(b"".join(waiting), MAX_BUFFER)
            self._conn = conn
        except BACKEND_ERRORS as error:
            self._lost(error)
        finally:
            self._paused = False

    def _lost(self, error: BaseException) -> None:
        self._conn = None
        self._waiting = []
        if self.on_error is not None:
            self.on_error(error)

    @classmethod
    def from_url(cls, url: str, timeout_s: float, on_error: Callable[[BaseException], None] | None = None,
                 ) -> QuietWriter:
        """A writer on a single node's URL (the same as its ordinary client's)."""
        return cls(RespClient.from_url(url, timeout_s=timeout_s), on_error)

    async def aclose(self) -> None:
        if self._connecting is not None:
            self._connecting.cancel()
        await self.client.aclose()
