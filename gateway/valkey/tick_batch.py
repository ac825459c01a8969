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
from gateway.valkey.resp import CommandArg, encode_command

# Of the quiet commands (``send_quiet``), every ``_HEAR_EVERY``-th goes on the ordinary connection with its
# reply; the others on the quiet writer's, with none: a failure that repeats (a full Valkey, a read-only
# replica, a refused ACL) is still heard, by ``on_detached``, within that many commands.
_HEAR_EVERY = 16


class TickBatch:
    """One client's commands of this tick, sent together."""

    __slots__ = ("client", "_pending", "_loop", "_batched", "on_detached", "detached", "_wires", "_receivers",
                 "_detached", "_quiet", "before_flush", "quiet_writer", "_unheard", "_unreplied")

    def __init__(self, client: Any, quiet_writer: Any = None) -> None:
        """``quiet_writer``: a ``QuietWriter`` on the same server (gateway/valkey/quiet_writer.py), for the
        commands of ``send_quiet`` (None: they go with their replies)."""
        self.client = client
        self.quiet_writer = quiet_writer
        self._unheard = 0  # quiet commands written without a reply since the last one with its reply
        self._unreplied: list[bytes] = []  # this tick's, for the quiet writer
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
        a client with ``send_each`` only (one node). With a quiet writer whose server takes CLIENT REPLY, it
        goes there: no reply, nothing read, parsed or resolved (one in ``_HEAR_EVERY`` stays here, with its
        reply, so its failures are heard), unless the tick writes other commands here anyway: then they
        ride in that write with their replies (read with the others': one write and no read saved). Order among the quiet commands is kept; against the others it
        is not (nothing needs it: a claim is ``NX``, and a later read finds the entry or waits for it)."""
        writer = self.quiet_writer
        if writer is not None and writer.supported is not False and self._unheard < _HEAR_EVERY:
            self._unheard += 1
            unreplied = self._unreplied
            if not unreplied and not self._wires:
                self._flush_soon()
            unreplied.append(encoded)
            return
        self._unheard = 0
        self.detached += 1
        wires = self._wires
        if not wires and not self._unreplied:
            self._flush_soon()
        wires.append(encoded)
        self._receivers.append(self._quiet)

    def flush_soon(self) -> None:
        """Make sure this tick's write happens (``before_flush`` has something to add to it)."""
        if not (self._wires or self._unreplied if self._batched else self._pending):
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
        unreplied = self._unreplied
        if unreplied:
            self._unreplied = []
            if self._wires:  # a write here anyway (and a read of its replies): they ride in it, one syscall less
                self._wires += unreplied
                self._receivers += [self._quiet] * len(unreplied)
                self.detached += len(unreplied)
            else:
                self.quiet_writer.write(b"".join(unreplied))
        wires, receivers = self._wires, self._receivers
        if not wires:
            return
        self._wires, self._receivers = [], []
        try:
            self.client.send_each(b"".join(wires), receivers)
        except BACKEND_ERRORS as error:  # e.g. too many commands pending on a stuck connection
            for receiver, _ in receivers:
                if not receiver.done():
                    receiver.set_exception(error)

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
