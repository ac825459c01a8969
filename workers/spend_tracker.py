"""A worker's spend bookkeeping (docs/pricing.md): daily rollups, the spend metrics, the alerts' outbox.

Per request (``count``, from ``Outcomes.close``): one dict lookup and at most six integer additions into
the rollup batch, nothing else: no I/O, no clock but ``time.time``. Once a second (``tick``, from the
heartbeat) the batch is swapped for an empty one: its costs go into the metric counters and it is
flushed to the store in the background (``gateway.spend.store``: one script per day, applied once per
flush id). A flush that fails is tried again, the same batch under the same id, at the next tick;
meanwhile requests accumulate in the next batch (bounded: ``rollups.MAX_CELLS`` distinct cells, then
new cells are dropped and counted). ``close`` (at drain) flushes what is left. A crash loses at most
the last second of rollups; the quota ledger's budgets are exact regardless.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import msgspec

from gateway.identity.auth import SUBJECT_SEPARATOR
from gateway.pricing.table import shipped_table
from gateway.process_protocol import SpendAlertReport, SpendCounts, encode_status, try_send_status
from gateway.spend.alerts import AlertOutbox, SpendAlert, alert_text, install_outbox, publish_alert
from gateway.spend.price_book import PriceBook
from gateway.spend.rollups import DAY_S, NO_KEY, RollupBatch
from gateway.spend.series import SpendCounters
from workers.request_record import RequestRecord

log = logging.getLogger("gridgate.worker")

_time = time.time
FLUSH_TIMEOUT_S = 5.0
CLOSE_TIMEOUT_S = 3.0
# Test-only: a JSON list of SpendAlert objects each worker publishes at its first tick, so tests of the
# delivery path (worker -> status pipe -> supervisor -> webhook: retries, backoff, failures) choose their
# alerts; the ledger's own crossings are tested end to end too (tests/integration/test_spend_e2e.py).
TEST_ALERTS_ENV = "GRIDGATE_TEST_SPEND_ALERTS"


class SpendTracker:
    """One per worker."""

    def __init__(self, book: PriceBook, status_fd: int | None, store_url: str | None, per_key: bool = False) -> None:
        self.book = book
        self.batch = RollupBatch()
        self.counters = SpendCounters(per_key)
        self.status_fd = status_fd
        self.outbox = AlertOutbox(self._send_alert, noted=self._log_alert)
        self.access_log: Any = None  # workers.access_log.AccessLog: each alert gets a line of its own
        self.cells_dropped = 0  # requests not rolled up: the batch was full (the store down a while)
        self.flushes_failed = 0
        self._store_url = store_url
        self._client: Any = None
        self._failed: tuple[str, RollupBatch] | None = None  # the flush to try again, with its id
        self._task: asyncio.Task[None] | None = None
        self._flush_prefix = os.urandom(6).hex()
        self._flushes = 0
        self._unpriced_sent: tuple[int, int, int] | None = None
        self._dropped_sent = (0, 0, 0)
        self._closed = False
        install_outbox(self.outbox)
        test_alerts = os.environ.get(TEST_ALERTS_ENV)
        self._test_alerts = msgspec.json.decode(test_alerts, type=list[SpendAlert]) if test_alerts else []

    @classmethod
    def from_config(cls, config: Any, status_fd: int | None, store_url: str | None,
                    prices: PriceBook | None = None) -> SpendTracker:
        """``prices``: the worker's price book (the one its requests are priced with), else one is built."""
        pricing = config.pricing
        book = prices if prices is not None else PriceBook.from_config(pricing, shipped_table())
        return cls(book, status_fd, store_url, pricing.metrics_per_key)

    # -- per request --------------------------------------------------------------------------------
    def count(self, record: RequestRecord) -> None:
        """A closed request that reached a provider goes into the day's rollup (priced or not)."""
        # Once per request: ``record.served``, whether it reached a provider (workers/request_record.py) and,
        # for a cell the batch already holds (nearly every request), ``RollupBatch.add`` are written out.
        model = record.served_model or record.capability
        # (reached a provider: the attempt that served is there in nearly every one, so it is asked first)
        if model is None or not (record.attempt is not None or record.reached):
            if record.cache == "hit" and self._store_url is not None and model is not None:
                self._count_hit(record, model)  # a response cache hit: what it saved (docs/cache.md)
            return
        self.count_reached(record, model, record.cost_nusd)

    def count_reached(self, record: RequestRecord, model: str, cost: int | None) -> None:
        """``count`` of a request that reached a provider, served by ``model`` and priced ``cost`` (what
        ``Outcomes.close`` knows already for the metered request as nearly every one ends: it calls this
        directly, the checks ``count`` makes before it not made again)."""
        if self._store_url is None and not cost:
            return  # without a store only a cost is worth counting (the metric)
        exchange = record.exchange
        admitted = None if exchange is None else exchange.admitted
        identity = None if admitted is None else admitted.key
        key = identity.rollup_name if identity is not None else NO_KEY  # a subject's: "<via>\x1e<subject>"
        cell = (int(_time() // DAY_S), record.tenant or NO_KEY, key, model)
        try:  # a cell the batch holds (nearly every request): no method call; a new one raises, once a batch
            counts = self.batch.cells[cell]
        except KeyError:  # a new cell (or a full batch: not rolled up)
            if not self.batch.add(cell, record.tokens_prompt or 0, record.tokens_cached or 0,
                                  record.tokens_completion or 0, record.tokens_reasoning or 0, cost or 0):
                self.cells_dropped += 1
            return
        counts[0] += 1
        counts[1] += record.tokens_prompt or 0
        counts[3] += record.tokens_completion or 0
        # Cached and reasoning tokens are mostly not reported, or 0: a column they would add 0 to is left
        # as it is (the same, for a third of the work), as an unpriced request leaves the cost column.
        if cached := record.tokens_cached:
            counts[2] += cached
        if reasoning := record.tokens_reasoning:
            counts[4] += reasoning
        if cost:
            counts[5] += cost

    def _count_hit(self, record: RequestRecord, model: str) -> None:
        exchange = record.exchange
        admitted = None if exchange is None else exchange.admitted
        identity = None if admitted is None else admitted.key
        key = identity.rollup_name if identity is not None else NO_KEY  # a subject's: "<via>\x1e<subject>"
        cell = (int(_time() // DAY_S), record.tenant or NO_KEY, key, model)
        if not self.batch.add_hit(cell, record.saved_tokens or 0, record.saved_nusd or 0):
            self.cells_dropped += 1

    def count_hit(self, record: RequestRecord) -> None:
        """``count`` of a response cache hit's record (workers/outcomes.py ``HitEnds``: it reached no provider,
        so only what it saved is counted, with a store), ``RollupBatch.add_hit`` written out for a cell the
        batch holds (nearly every hit). tests/unit/test_hit_ends.py holds it equal to ``count``."""
        model = record.served_model or record.capability
        if self._store_url is None or model is None:
            return
        exchange = record.exchange
        admitted = None if exchange is None else exchange.admitted
        identity = None if admitted is None else admitted.key
        key = identity.rollup_name if identity is not None else NO_KEY  # a subject's: "<via>\x1e<subject>"
        cell = (int(_time() // DAY_S), record.tenant or NO_KEY, key, model)
        counts = self.batch.cells.get(cell)
        if counts is None:  # a new cell (or a full batch: not rolled up)
            self._count_hit(record, model)
            return
        counts[6] += 1
        if saved_tokens := record.saved_tokens:
            counts[7] += saved_tokens
        if saved_nusd := record.saved_nusd:
            counts[8] += saved_nusd

    # -- once a second ------------------------------------------------------------------------------
    def tick(self) -> None:
        """Swap the batch out (its costs into the metrics; to the store in the background), resend the
        alerts the pipe could not take, and send the metric counters that changed."""
        if self._test_alerts:
            for alert in self._test_alerts:
                publish_alert(alert)
            self._test_alerts = []
        flushing = self._task is not None and not self._task.done()
        if self.batch.cells and not flushing and self._failed is None:
            batch, self.batch = self.batch, RollupBatch()
            for (_day, tenant, key, model), counts in batch.cells.items():
                if counts[5]:  # the metric's key label: a subject without its via
                    self.counters.add(tenant, model, key.rpartition(SUBJECT_SEPARATOR)[2], counts[5])
            if self._store_url is not None:
                self._flushes += 1
                self._failed = (f"{self._flush_prefix}-{self._flushes}", batch)
        if self._failed is not None and not flushing and not self._closed:
            self._task = asyncio.get_running_loop().create_task(self._flush())
        self.outbox.retry()
        self._send_counts()

    async def _flush(self) -> None:
        assert self._failed is not None
        flush_id, batch = self._failed
        from gateway.spend.store import write_batch
        from gateway.valkey.client import BACKEND_ERRORS, create_client, describe_error

        try:
            if self._client is None:
                self._client = create_client(self._store_url, timeout_s=FLUSH_TIMEOUT_S)  # type: ignore[arg-type]
            async with asyncio.timeout(FLUSH_TIMEOUT_S):
                await write_batch(self._client, batch, flush_id)
        except (*BACKEND_ERRORS, ValueError) as exc:
            self.flushes_failed += 1
            if self.flushes_failed in (1, 10) or self.flushes_failed % 100 == 0:
                log.warning("spend: rollup flush failed (%s); kept, tried again each second", describe_error(exc))
            return
        self._failed = None

    def _send_counts(self) -> None:
        fd = self.status_fd
        if fd is None:
            return
        counts = self.book.counts
        unpriced = (counts.zero, counts.estimated, counts.rejected)
        dropped = (self.outbox.dropped, self.cells_dropped, self.flushes_failed)
        series = self.counters.changed()
        if not series and unpriced == self._unpriced_sent and dropped == self._dropped_sent:
            return
        # One atomic write per message: as many series as fit, then the next message.
        chunk: list[tuple[str, str, str, int]] = []
        chunks: list[list[tuple[str, str, str, int]]] = []
        size = 0
        for entry in series:
            entry_size = sum(len(part) for part in entry[:3]) * 6 + 32  # worst case: every byte escaped
            if chunk and size + entry_size > 3000:
                chunks.append(chunk)
                chunk, size = [], 0
            chunk.append(entry)
            size += entry_size
        chunks.append(chunk)
        for index, part in enumerate(chunks):
            message = SpendCounts(series=part, unpriced=unpriced, alerts_dropped=dropped[0], rollups_dropped=dropped[1],
                                  rollup_flushes_failed=dropped[2])
            if encode_status(message) is None:  # a series too long to send (names of kilobytes): skip it
                continue
            if not try_send_status(fd, message):
                for rest in chunks[index:]:
                    self.counters.unsent(rest)
                return
        self._unpriced_sent, self._dropped_sent = unpriced, dropped

    def _log_alert(self, alert: SpendAlert) -> None:
        if self.access_log is not None:
            self.access_log.spend_alert(alert.tenant, alert_text(alert))

    def _send_alert(self, alert: SpendAlert) -> bool:
        return True if self.status_fd is None else try_send_status(self.status_fd, SpendAlertReport(alert))

    # -- at drain -----------------------------------------------------------------------------------
    async def close(self) -> None:
        """Flush what is left (bounded by ``CLOSE_TIMEOUT_S``), send the last counters and alerts."""
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                for _ in range(4):  # the flush in flight, one that failed, and the last batch
                    if self._task is not None:
                        await self._task
                        self._task = None
                    if not self.batch.cells and self._failed is None:
                        break
                    self.tick()
                    if self._task is None:  # no store: the tick only counted
                        break
                if self._task is not None:
                    await self._task
        except TimeoutError:
            log.warning("spend: the last rollups were not flushed before the worker stopped")
        self._closed = True
        self.outbox.retry()
        self._send_counts()
        install_outbox(None)
        if self._client is not None:
            try:
                await self._client.aclose()
            except Exception:  # closing a failed client must not fail the drain
                pass
