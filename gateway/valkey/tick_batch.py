"""Plain commands batched per event-loop tick: every command of a tick leaves in one write (the response
cache's GETs and SETs: workers/response_cache.py), so a busy worker pays one send per tick, not one per
request.

The first command of a tick schedules the flush (``call_soon``); the flush sends them all with
``send_each`` (the single-node client: one write, each reply read straight into its command's future, so
a waiter wakes in the turn its reply is read: no batch future and no callback in between), or one by one
on a client without it (Valkey Cluster: valkey-py routes each key to its node). Each command's future gets
its reply, or the error; a failed batch fails every one of its futures.
"""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.valkey.client import BACKEND_ERRORS
from gateway.valkey.resp import SKIP_REPLY, CommandArg, encode_command

# Of the quiet commands written with no reply (``send_quiet`` on a connection that skips replies), every
# ``_HEAR_EVERY``-th keeps its reply: a failure that repeats (a full Valkey, a read-only replica, a refused
# ACL) is still heard, by ``on_detached``, within that many commands.
_HEAR_EVERY = 16


class TickBatch:
    """One client's commands of this tick, sent together."""

    __slots__ = ("client", "_pending", "_loop", "_batched", "on_detached", "detached", "_wires", "_receivers",
                 "_detached", "_quiet", "before_flush", "_skipping", "_unheard", "_skipped")

    def __init__(self, client: Any) -> None:
        self.client = client
        self._pending: list[tuple[bytes, tuple[CommandArg, ...], asyncio.Future[Any] | None]] = []
        # What a detached command's reply tells its sender: None (it succeeded) or the error, once per command.
        self.on_detached: Any = None
        self.detached = 0  # detached commands sent and not yet answered
        self._loop: asyncio.AbstractEventLoop | None = None
        self._batched = hasattr(client, "send_each")
        # The batched path's commands of this tick: their framed bytes, and who hears each reply.
        self._wires: list[bytes] = []
        self._receivers: list[tuple[Any, int]] = []
        self._detached = (_Detached(self), 0)  # the receiver of every detached command's reply
        self._quiet = (_Detached(self, quiet=True), 0)  # the same, telling ``on_detached`` only its errors
        # Called as a tick's write is made, before its commands are taken (it may ``send`` more into it).
        self.before_flush: Any = None
        # Whether the client's connection, as of the last write, takes ``CLIENT REPLY SKIP``: quiet commands
        # are then framed without a reply; ``_unheard`` counts them since the last one that kept its reply;
        # ``_skipped``: this tick's write holds such commands (the client checks the connection it goes on).
        self._skipping = False
        self._unheard = 0
        self._skipped = False
        if not self._batched and hasattr(client, "cluster_error_retry_attempts"):
            # valkey-py's Cluster client retries a whole command on a connection error, a timeout or
            # CLUSTERDOWN (3 times by default, once as create_client makes it), re-reading the topology each
            # time and sleeping 0.25 s before each CLUSTERDOWN retry: with the default one call took about
            # 1 s while a node was down. This batch's caller judges a failure itself (the cache: bypassed
            # for a second), so one attempt; slot moves are still followed (not these retries). Single
            # commands only: its pipelines never run with 0 (ClusterPipeline loops ``range(attempts)``),
            # and this batch sends none.
            client.cluster_error_retry_attempts = 0

    def call(self, *args: CommandArg, encoded: bytes | None = None) -> asyncio.Future[Any]:
        """Queue one command for this tick's write; its future gets the reply (or raises the error).
        ``encoded``: the command already framed (``encode_command(args)``'s bytes), so it is not framed again."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        future = loop.create_future()
        if self._batched:
            wires = self._wires
            if not wires:
                loop.call_soon(self._flush)
            wires.append(encoded or encode_command(args))
            self._receivers.append((future, 0))
            return future
        pending = self._pending
        if not pending:
            loop.call_soon(self._flush)
        pending.append((b"", args, future))
        return future

    def send(self, *args: CommandArg, encoded: bytes | None = None, quiet: bool = False) -> None:
        """Queue one command nobody waits for (a SET): ``on_detached`` hears how it went (``quiet``: only when
        it failed). ``encoded``: as ``call``'s."""
        if self._batched and quiet and encoded is not None:
            self.send_quiet(encoded)
            return
        self.detached += 1
        if self._batched:
            wires = self._wires
            if not wires:
                self._flush_soon()
            wires.append(encoded or encode_command(args))
            self._receivers.append(self._quiet if quiet else self._detached)
            return
        pending = self._pending
        if not pending:
            self._flush_soon()
        pending.append((b"", args, None))

    def send_quiet(self, encoded: bytes) -> None:
        """``send(..., encoded=encoded, quiet=True)`` without its arguments (a command framed already), for
        a client with ``send_each`` only (one node). On a connection that skips replies it goes after
        ``CLIENT REPLY SKIP``: Valkey sends no reply, and nothing here reads, parses or resolves one (one
        in ``_HEAR_EVERY`` keeps its reply, so its failures are heard)."""
        wires = self._wires
        if not wires:
            self._flush_soon()
        if self._skipping and self._unheard < _HEAR_EVERY:
            self._unheard += 1
            self._skipped = True
            wires.append(SKIP_REPLY + encoded)
            return
        self._unheard = 0
        self.detached += 1
        wires.append(encoded)
        self._receivers.append(self._quiet)

    def flush_soon(self) -> None:
        """Make sure this tick's write happens (``before_flush`` has something to add to it)."""
        if not (self._wires if self._batched else self._pending):
            self._flush_soon()

    def _flush_soon(self) -> None:
        """The tick's first command: its write goes out when the loop's current callbacks are done."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        loop.call_soon(self._flush)

    def _flush(self) -> None:
        if self.before_flush is not None:
            self.before_flush()
        if not self._batched:
            batch, self._pending = self._pending, []
            for _, args, future in batch:
                self._resolve_later(future, args)
            return
        wires, receivers = self._wires, self._receivers
        if not wires:
            return
        self._wires, self._receivers = [], []
        client = self.client
        try:
            if self._skipped:
                self._skipped = False
                client.send_each(b"".join(wires), receivers, skipping=True)
            else:
                client.send_each(b"".join(wires), receivers)
        except BACKEND_ERRORS as error:  # e.g. too many commands pending on a stuck connection
            for receiver, _ in receivers:
                if not receiver.done():
                    receiver.set_exception(error)
            if not receivers and self.on_detached is not None:
                self.on_detached(error)  # a write of skipped commands only: still heard
        self._skipping = client.skips_replies

    def _resolve_later(self, future: asyncio.Future[Any] | None, args: tuple[CommandArg, ...]) -> None:
        try:
            sent = asyncio.ensure_future(self.client.execute_command(*_routed(args), **_reply_options(args)))
        except BACKEND_ERRORS as error:
            self._fail([(b"", args, future)], error)
            return
        sent.add_done_callback(lambda done: self._replied([(b"", args, future)], done, single=True))

    def _replied(self, batch: list[_Entry], done: asyncio.Future[Any], single: bool = False) -> None:
        if done.cancelled():
            self._fail(batch, ConnectionError("the batch was cancelled"))
            return
        error = done.exception()
        if error is not None:
            self._fail(batch, error)
            return
        replies = [done.result()] if single else done.result()
        for (_, _, future), reply in zip(batch, replies, strict=True):
            if future is None:
                self.detached -= 1
                if self.on_detached is not None:
                    self.on_detached(reply if isinstance(reply, Exception) else None)
            elif future.done():
                continue
            elif isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    def _fail(self, batch: list[_Entry], error: BaseException) -> None:
        for _, _, future in batch:
            if future is None:
                self.detached -= 1
                if self.on_detached is not None:
                    self.on_detached(error)
            elif not future.done():
                future.set_exception(error)


class _Detached:
    """The receiver of a detached command's reply (a connection takes it as a future): tells the batch."""

    __slots__ = ("batch", "quiet")

    def __init__(self, batch: TickBatch, quiet: bool = False) -> None:
        self.batch = batch
        self.quiet = quiet

    def done(self) -> bool:
        return False

    def set_result(self, _reply: Any) -> None:
        batch = self.batch
        batch.detached -= 1
        if batch.on_detached is not None and not self.quiet:
            batch.on_detached(None)

    def set_exception(self, error: BaseException) -> None:
        batch = self.batch
        batch.detached -= 1
        if batch.on_detached is not None:
            batch.on_detached(error)


def _routed(args: tuple[CommandArg, ...]) -> tuple[CommandArg, ...]:
    """valkey-py's Cluster client routes by the command's name as a str (a bytes name is unknown to it)."""
    name = args[0]
    return (name.decode(), *args[1:]) if name.__class__ is bytes else args  # type: ignore[union-attr]


def _reply_options(args: tuple[CommandArg, ...]) -> dict[str, bool]:
    """A ``SET ... GET`` reply is the old value: valkey-py's SET callback turns it into a bool unless told."""
    name = args[0]
    if name in (b"SET", "SET") and any(arg in (b"GET", "GET") for arg in args[3:]):
        return {"get": True}
    return {}


_Entry = tuple[bytes, tuple[CommandArg, ...], "asyncio.Future[Any] | None"]
