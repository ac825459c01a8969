"""Settling reservations off the request path: a bounded buffer drained in pipelined batches.

The gate appends (reservation, tokens to charge) and never waits; one task per worker sends what has
accumulated as one pipelined batch, retries what failed, and counts the outcomes. A plain list and
one wake-up future, not an ``asyncio.Queue``: its per-item bookkeeping (put, get, task_done) cost
more than the rest of a settlement. A settlement dropped (buffer full) or given up on costs the
tenant at most its estimate: the reservation expires and is charged at its estimate, or the
supervisor's sweep settles it when the worker dies.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from gateway.quota.counters import QuotaCounters
from gateway.quota.lease import LeaseReservation
from gateway.quota.ledger import SETTLE_APPLIED, SETTLE_EXPIRED, SETTLE_NOOP, QuotaLedger, Reservation
from gateway.valkey.client import BACKEND_ERRORS, describe_error

log = logging.getLogger("gridgate.quota")

# The reservation, tokens to charge, request slots to give back, nano-USD to charge (None: its worst case).
Settlement = tuple[Reservation, int, int, int | None]
# Called with a settled reservation and the alert thresholds its settle crossed (``b"<n>:<t>:<spent>"``).
OnCrossings = Callable[[Reservation, list[bytes]], None]
# A settlement waits this long for others to share its round trip (the batch is sent at once when full):
# under load one write and one reply then settle dozens; the ledger just sees them a few ms later.
LINGER_S = 0.005


class Reconciler:
    def __init__(
        self,
        ledger: QuotaLedger,
        counters: QuotaCounters,
        *,
        timeout_s: float,
        queue_size: int = 10000,
        batch: int = 128,
        retry_delays_s: Sequence[float] = (0.05, 0.25, 1.0),
        on_crossings: OnCrossings | None = None,
    ) -> None:
        self._ledger = ledger
        self._on_crossings = on_crossings
        self._counters = counters
        self._timeout_s = max(timeout_s * 4, 1.0)
        self._pending: list[Settlement] = []
        self._capacity = queue_size
        self._batch = batch
        self._retry_delays = tuple(retry_delays_s)
        self._drainer: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Future[None] | None = None  # the drainer waits on it when idle
        self._busy = 0  # settlements taken from the buffer and not finished yet
        self._idle_waiters: list[asyncio.Future[None]] = []

    @property
    def backlog(self) -> int:
        return len(self._pending) + self._busy

    def start(self) -> None:
        self._drainer = asyncio.get_running_loop().create_task(self._reconcile_forever())

    def enqueue(self, reservation: Reservation, actual: int, slots_back: int = 0, cost_nusd: int | None = None) -> None:
        """Charge ``actual`` tokens for ``reservation`` (0: release it unused) and ``cost_nusd`` to its USD
        budgets (None: its worst case), and give back ``slots_back`` of its request slots (work that
        never reached a provider). Never blocks."""
        if len(self._pending) >= self._capacity:
            self._counters.reconcile_drops += 1
            return
        self._pending.append((reservation, actual, slots_back, cost_nusd))
        wakeup = self._wakeup
        if wakeup is not None:
            self._wakeup = None
            if not wakeup.done():  # done: cancelled with the drainer (stopped); the item waits for nothing
                wakeup.set_result(None)

    async def drain(self) -> None:
        """Wait until every settlement queued so far has been reconciled (or given up on)."""
        if self.backlog:
            waiter = asyncio.get_running_loop().create_future()
            self._idle_waiters.append(waiter)
            await waiter

    async def stop(self, drain_timeout_s: float) -> None:
        """Settle what is queued (bounded by ``drain_timeout_s``), then stop."""
        if self._drainer is None:
            return
        try:
            async with asyncio.timeout(drain_timeout_s):
                await self.drain()
        except TimeoutError:
            log.warning("quota: %d settlements not reconciled at shutdown", self.backlog)
        self._drainer.cancel()
        try:
            await self._drainer
        except asyncio.CancelledError:
            pass
        self._drainer = None

    async def _reconcile_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._pending:
                for waiter in self._idle_waiters:
                    if not waiter.done():
                        waiter.set_result(None)
                self._idle_waiters.clear()
                self._wakeup = loop.create_future()
                await self._wakeup
            if len(self._pending) < self._batch:
                await asyncio.sleep(LINGER_S)
            batch = self._pending[: self._batch]
            del self._pending[: self._batch]
            self._busy = len(batch)
            try:
                await self._reconcile(batch)
            except Exception:  # never let one bad batch kill the reconciler
                log.exception("quota: reconciliation batch failed")
                self._counters.reconcile_failures += len(batch)
            finally:
                self._busy = 0

    async def _reconcile(self, batch: list[Settlement]) -> None:
        pending = batch
        for delay in (0.0, *self._retry_delays):
            if delay:
                await asyncio.sleep(delay)
            try:
                async with asyncio.timeout(self._timeout_s):
                    outcomes = await self._ledger.settle_many(pending)
            except BACKEND_ERRORS as exc:
                self._counters.backend_errors += 1
                log.debug("quota: settle batch failed: %s", describe_error(exc))
                continue
            retry = []
            for item, outcome in zip(pending, outcomes, strict=True):
                if outcome.__class__ is int:
                    self._count_settled(item, outcome)
                elif outcome.__class__ is list and outcome and outcome[0].__class__ is int:  # type: ignore[index]
                    self._count_settled(item, outcome[0])  # type: ignore[index]
                    self._crossed(item[0], outcome[1:])  # type: ignore[index]
                else:
                    retry.append(item)
            if not retry:
                return
            self._counters.backend_errors += 1
            pending = retry
        self._counters.reconcile_failures += len(pending)
        log.warning(
            "quota: %d settlements failed after retries (charged at estimate on expiry)", len(pending)
        )

    def _crossed(self, reservation: Reservation, crossings: list[bytes]) -> None:
        if self._on_crossings is None:
            return
        try:
            self._on_crossings(reservation, crossings)
        except Exception:  # an alert that cannot be made never undoes the settlement
            log.exception("quota: spend alert failed")

    def _count_settled(self, item: Settlement, outcome: int) -> None:
        counters = self._counters
        if outcome == SETTLE_APPLIED:
            reservation, actual = item[0], item[1]
            if reservation.__class__ is not LeaseReservation:  # a block's requests counted as they ended
                counters.count_settled(reservation.estimate, actual)
        elif outcome == SETTLE_EXPIRED:
            counters.reservations_expired += 1
        elif outcome == SETTLE_NOOP:
            counters.reconcile_duplicates += 1
