"""Admits batched per event-loop tick: one pipelined write for every admit of a tick, resolved request by request.

The first admit of a tick schedules the flush (``call_soon``); every admit of the same tick joins it, and
the flush sends them all in one round trip (``QuotaLedger.send_admits``). Each reply resolves its own
request's future with that request's ``Admission`` (``decide``, in one loop over the batch: no coroutine
and no timer per request; the client's progress watchdog bounds the wait). A detached admit (a worker-held
block asked for by ``lease_book``) has no future: its callback takes the reply, whatever it is.

Failures resolve every waiting request with the breaker's policy (``BackendBreaker.unavailable``) and are
reported to the breaker: a batch whose send failed, a command answered with an error, or a reply the
script cannot have written (a server that is not the Valkey the ledger expects). Commands answered
NOSCRIPT did not run (a restarted server lost the script): they are sent again after a reload. What a
lost reply may have left behind is undone off the request path: an admit whose request stopped waiting is
released when its reply arrives, and the admits of a failed batch are cancelled once the backend answers
(they may still run when it catches up).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine, Sequence
from functools import partial
from typing import Any, Generic, TypeVar

from valkey.exceptions import NoScriptError

from gateway.quota.admission import Admission
from gateway.quota.breaker import BackendBreaker
from gateway.quota.counters import QuotaCounters
from gateway.quota.ledger import AdmitCommand, QuotaLedger
from gateway.quota.reconcile import Reconciler
from gateway.valkey.client import BACKEND_ERRORS, describe_error
from gateway.valkey.transport import Reply

Context = TypeVar("Context")
# An entry: the command, the future its request awaits (None: detached), and what its reply needs (the
# request's context, or a detached admit's callback).
_Entry = tuple[AdmitCommand, "asyncio.Future[Admission] | None", Any]
OnReply = Callable[[AdmitCommand, Reply | BaseException], None]

# An admit whose reply was lost is cancelled after these pauses (the backend was slow or down);
# a bound on such pending cancels (one per failed batch) keeps a dead backend from piling up tasks.
CANCEL_DELAYS_S = (0.5, 2.0, 5.0, 15.0)
MAX_PENDING_CANCELS = 1024


class AdmitBatcher(Generic[Context]):
    """``decide(command, reply, context)``: a request's Admission from its admit's reply (bytes)."""

    __slots__ = ("_ledger", "_breaker", "_reconciler", "_counters", "_decide", "_pending", "_sending", "_loop",
                 "_tasks", "_cancels")

    def __init__(self, ledger: QuotaLedger, breaker: BackendBreaker, reconciler: Reconciler, counters: QuotaCounters,
                 decide: Callable[[AdmitCommand, bytes, Context], Admission]) -> None:
        self._ledger = ledger
        self._breaker = breaker
        self._reconciler = reconciler
        self._counters = counters
        self._decide = decide
        self._pending: list[_Entry] = []  # this tick's admits, in the order they will be sent
        self._sending: set[asyncio.Future[list[Reply]]] = set()  # batches sent, not answered yet
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()  # script reloads and cancels of lost admits
        self._cancels = 0

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()

    async def settled(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) for the batches already sent: at shutdown, what they granted is
        given back through the reconciler before it stops, rather than left to expire at its estimate."""
        if self._sending:
            await asyncio.wait(list(self._sending), timeout=timeout_s)

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    # -- request path

    def submit(self, command: AdmitCommand, context: Context) -> asyncio.Future[Admission]:
        """Add an admit to this tick's batch; the future gets the request's Admission."""
        loop = self._loop or asyncio.get_running_loop()
        future = loop.create_future()
        pending = self._pending
        if not pending:
            loop.call_soon(self._flush)
        pending.append((command, future, context))
        return future

    def submit_detached(self, command: AdmitCommand, on_reply: OnReply) -> None:
        """Add an admit nobody waits for; ``on_reply`` gets its reply, or the error that lost it."""
        pending = self._pending
        if not pending:
            (self._loop or asyncio.get_running_loop()).call_soon(self._flush)
        pending.append((command, None, on_reply))

    # -- the round trip

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        try:
            sent = asyncio.ensure_future(self._ledger.send_admits([entry[0] for entry in batch]))
        except BACKEND_ERRORS as exc:  # e.g. too many commands pending on a stuck connection
            self._failed(batch, exc)
            return
        self._sending.add(sent)
        sent.add_done_callback(partial(self._sent, batch))

    def _sent(self, batch: list[_Entry], sent: asyncio.Future[list[Reply]]) -> None:
        self._sending.discard(sent)
        if sent.cancelled():  # the gate is closing
            self._failed(batch, ConnectionError("quota gate closed"))
            return
        error = sent.exception()
        if error is not None:
            self._failed(batch, error)
            return
        replies = sent.result()
        lost = [i for i, reply in enumerate(replies) if reply.__class__ is NoScriptError]
        if lost:  # the server restarted with an empty script cache: those admits did not run
            self._spawn(self._readmit(batch, replies, lost))
            return
        self._resolve(batch, replies)

    async def _readmit(self, batch: list[_Entry], replies: list[Reply], lost: list[int]) -> None:
        again: Sequence[Reply | BaseException]
        try:
            await self._ledger.load_script()
            again = await self._ledger.send_admits([batch[i][0] for i in lost])
        except BACKEND_ERRORS as exc:
            again = [exc] * len(lost)
        for i, reply in zip(lost, again, strict=True):
            replies[i] = reply  # type: ignore[assignment]
        self._resolve(batch, replies)

    def _resolve(self, batch: list[_Entry], replies: list[Reply]) -> None:
        decide = self._decide
        errors = 0
        for (command, future, context), reply in zip(batch, replies, strict=True):
            if future is None:  # detached: its callback takes any reply
                context(command, reply)
                if reply.__class__ is not bytes:
                    errors += 1
            elif reply.__class__ is not bytes:  # this command failed (counted once, for the batch)
                errors += 1
                if not future.cancelled():
                    future.set_result(self._breaker.unavailable())
            elif future.cancelled():  # the request gave up waiting: undo what the admit took
                if reply.startswith(b"1 "):  # type: ignore[union-attr]
                    with contextlib.suppress(ValueError):
                        reservation = QuotaLedger.read(command, reply).reservation  # type: ignore[arg-type]
                        self._reconciler.enqueue(reservation, 0, command.slots)  # type: ignore[arg-type]
            else:
                try:
                    admission = decide(command, reply, context)  # type: ignore[arg-type]
                except (ValueError, IndexError):  # a reply the script cannot have written: a backend error
                    errors += 1
                    admission = self._breaker.unavailable()
                future.set_result(admission)
        if errors:
            self._breaker.failed(f"{errors} admit(s) answered with errors")
        else:
            self._breaker.answered()

    def _failed(self, batch: list[_Entry], error: BaseException) -> None:
        for command, future, context in batch:
            if future is None:
                context(command, error)
            elif not future.done():  # a result, not an exception: one object, many requests
                future.set_result(self._breaker.unavailable())
        self._breaker.failed(describe_error(error))
        # The admits may still run once the backend catches up: undo them then (off the request path).
        commands = [entry[0] for entry in batch]
        if self._cancels >= MAX_PENDING_CANCELS:
            self._counters.reconcile_drops += len(commands)  # charged at their estimate on expiry
            return
        self._cancels += 1
        self._spawn(self._cancel_lost(commands))

    async def _cancel_lost(self, commands: list[AdmitCommand]) -> None:
        """Retry until each lost admit is found and released, or long enough that it never ran."""
        try:
            pending = commands
            for delay in CANCEL_DELAYS_S:
                await asyncio.sleep(delay)
                if self._breaker.is_open:
                    continue  # no round trips against a backend known to be down
                try:
                    results = await self._ledger.cancel_many(pending)
                except BACKEND_ERRORS:
                    continue
                pending = [c for c, found in zip(pending, results, strict=True) if found is not True]
                if not pending:
                    return
        finally:
            self._cancels -= 1

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = (self._loop or asyncio.get_running_loop()).create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
