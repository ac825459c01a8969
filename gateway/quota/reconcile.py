"""Settling reservations off the request path: a bounded queue drained in pipelined batches.

The gate enqueues (reservation, tokens to charge) and never waits; one task per worker sends what
has queued up as one pipelined batch, retries what failed, and counts the outcomes. A settlement
dropped (queue full) or given up on costs the tenant at most its estimate: the reservation expires
and is charged at its estimate, or the supervisor's sweep settles it when the worker dies.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from gateway.quota.backend import BACKEND_ERRORS, describe_error
from gateway.quota.counters import QuotaCounters
from gateway.quota.ledger import SETTLE_APPLIED, SETTLE_EXPIRED, SETTLE_NOOP, QuotaLedger, Reservation

log = logging.getLogger("gridgate.quota")


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
    ) -> None:
        self._ledger = ledger
        self._counters = counters
        self._timeout_s = max(timeout_s * 4, 1.0)
        self._queue: asyncio.Queue[tuple[Reservation, int]] = asyncio.Queue(queue_size)
        self._batch = batch
        self._retry_delays = tuple(retry_delays_s)
        self._drainer: asyncio.Task[None] | None = None

    @property
    def backlog(self) -> int:
        return self._queue.qsize()

    def start(self) -> None:
        self._drainer = asyncio.get_running_loop().create_task(self._reconcile_forever())

    def enqueue(self, reservation: Reservation, actual: int) -> None:
        """Charge ``actual`` tokens for ``reservation`` (0: release it unused). Never blocks."""
        try:
            self._queue.put_nowait((reservation, actual))
        except asyncio.QueueFull:
            self._counters.reconcile_drops += 1

    async def drain(self) -> None:
        """Wait until every settlement queued so far has been reconciled (or given up on)."""
        await self._queue.join()

    async def stop(self, drain_timeout_s: float) -> None:
        """Settle what is queued (bounded by ``drain_timeout_s``), then stop."""
        if self._drainer is None:
            return
        try:
            async with asyncio.timeout(drain_timeout_s):
                await self._queue.join()
        except TimeoutError:
            log.warning("quota: %d settlements not reconciled at shutdown", self._queue.qsize())
        self._drainer.cancel()
        try:
            await self._drainer
        except asyncio.CancelledError:
            pass
        self._drainer = None

    async def _reconcile_forever(self) -> None:
        queue = self._queue
        while True:
            batch = [await queue.get()]
            while len(batch) < self._batch and not queue.empty():
                batch.append(queue.get_nowait())
            try:
                await self._reconcile(batch)
            except Exception:  # never let one bad batch kill the reconciler
                log.exception("quota: reconciliation batch failed")
                self._counters.reconcile_failures += len(batch)
            finally:
                for _ in batch:
                    queue.task_done()

    async def _reconcile(self, batch: list[tuple[Reservation, int]]) -> None:
        pending = batch
        for delay in (0.0, *self._retry_delays):
            if delay:
                await asyncio.sleep(delay)
            try:
                async with asyncio.timeout(self._timeout_s):
                    results = await self._ledger.settle_many(pending)
            except BACKEND_ERRORS as exc:
                self._counters.backend_errors += 1
                log.debug("quota: settle batch failed: %s", describe_error(exc))
                continue
            retry = []
            for item, result in zip(pending, results, strict=True):
                if isinstance(result, Exception):
                    retry.append(item)
                else:
                    self._count_settled(item, result)
            if not retry:
                return
            self._counters.backend_errors += 1
            pending = retry
        self._counters.reconcile_failures += len(pending)
        log.warning(
            "quota: %d settlements failed after retries (charged at estimate on expiry)", len(pending)
        )

    def _count_settled(self, item: tuple[Reservation, int], result: tuple[int, int]) -> None:
        outcome, _ = result
        reservation, actual = item
        counters = self._counters
        if outcome == SETTLE_APPLIED:
            counters.tokens_actual += actual
            if actual < reservation.estimate:
                counters.tokens_refunded += reservation.estimate - actual
            else:
                counters.tokens_overage += actual - reservation.estimate
        elif outcome == SETTLE_EXPIRED:
            counters.reservations_expired += 1
        elif outcome == SETTLE_NOOP:
            counters.reconcile_duplicates += 1

