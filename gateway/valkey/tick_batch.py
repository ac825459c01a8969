"""Plain commands batched per event-loop tick: every command of a tick leaves in one write (the response
cache's GETs and SETs: workers/response_cache.py), so a busy worker pays one send per tick, not one per
request.

The first command of a tick schedules the flush (``call_soon``); the flush sends them all with
``send_encoded`` (the single-node client: one write, the replies in one list, error replies in place), or
one by one on a client without it (Valkey Cluster: valkey-py routes each key to its node). Each command's
future gets its reply, or the error; a failed batch fails every one of its futures.
"""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.valkey.client import BACKEND_ERRORS
from gateway.valkey.resp import CommandArg, encode_command


class TickBatch:
    """One client's commands of this tick, sent together."""

    __slots__ = ("client", "_pending", "_loop", "_batched")

    def __init__(self, client: Any) -> None:
        self.client = client
        self._pending: list[tuple[bytes, tuple[CommandArg, ...], asyncio.Future[Any]]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._batched = hasattr(client, "send_encoded")

    def call(self, *args: CommandArg) -> asyncio.Future[Any]:
        """Queue one command for this tick's write; its future gets the reply (or raises the error)."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        future = loop.create_future()
        pending = self._pending
        if not pending:
            loop.call_soon(self._flush)
        pending.append((encode_command(args) if self._batched else b"", args, future))
        return future

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        if not self._batched:
            for _, args, future in batch:
                self._resolve_later(future, self.client.execute_command(*args))
            return
        try:
            sent = asyncio.ensure_future(self.client.send_encoded(b"".join(entry[0] for entry in batch), len(batch)))
        except BACKEND_ERRORS as error:  # e.g. too many commands pending on a stuck connection
            _fail(batch, error)
            return
        sent.add_done_callback(lambda done: _replied(batch, done))

    def _resolve_later(self, future: asyncio.Future[Any], reply: Any) -> None:
        try:
            sent = asyncio.ensure_future(reply)
        except BACKEND_ERRORS as error:
            if not future.done():
                future.set_exception(error)
            return
        sent.add_done_callback(lambda done: _settle(future, done))


def _replied(batch: list[tuple[bytes, tuple[CommandArg, ...], asyncio.Future[Any]]], done: asyncio.Future[Any]) -> None:
    if done.cancelled():
        _fail(batch, ConnectionError("the batch was cancelled"))
        return
    error = done.exception()
    if error is not None:
        _fail(batch, error)
        return
    for (_, _, future), reply in zip(batch, done.result(), strict=True):
        if future.done():
            continue
        if isinstance(reply, Exception):
            future.set_exception(reply)
        else:
            future.set_result(reply)


def _settle(future: asyncio.Future[Any], done: asyncio.Future[Any]) -> None:
    if future.done():
        return
    if done.cancelled():
        future.set_exception(ConnectionError("the command was cancelled"))
    elif (error := done.exception()) is not None:
        future.set_exception(error)
    else:
        future.set_result(done.result())


def _fail(batch: list[tuple[bytes, tuple[CommandArg, ...], asyncio.Future[Any]]], error: BaseException) -> None:
    for _, _, future in batch:
        if not future.done():
            future.set_exception(error)
