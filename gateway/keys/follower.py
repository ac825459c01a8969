"""Keeps a host's key table current from the store (docs/keys.md): the supervisor runs one.

- **Load**: note the change log's newest entry, read every record, write the table, drop what is no
  longer in the store. Changes made meanwhile are in the log after the noted entry, and re-applying a
  record is idempotent, so nothing falls between the load and the follow.
- **Follow**: ``XREAD BLOCK`` on the log from the last entry applied (a stream, not pub/sub: nothing
  is lost across a reconnect); for each kid an entry names, read its record and write its secrets.
  A change reaches the table one round trip after the admin call wrote it.
- **Reload** everything when the log no longer reaches back to the last entry applied: every entry
  carries the store's sequence number ``n``, so a gap (entries trimmed before this host read them) or
  a number that went back (the store was reset) is seen on the next read; after a reconnect the log's
  newest entry is checked too (a reset store may have no entry yet).
- **Valkey unreachable**: the table keeps what it holds (known keys keep their last state); the
  follower retries with backoff and resumes from the last entry applied.
- **Housekeeping**, once a second: publish the current minute for the workers' use marks, end the
  rotation graces that are over; once a minute, write the last uses of the minute that ended.

Every error is logged without a key or digest; a kid is a public id and may be logged.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.keys.record import KeyRecord
from gateway.keys.store import KeyStore, LogEntry
from gateway.keys.view import decode_entry, views_of
from shm.keys import KeyTableFull, KeyTableWriter

log = logging.getLogger("gridgate.keys")

BLOCK_MS = 1000
READ_COUNT = 512
LOAD_BATCH = 1000
RECONNECT_BASE_S = 0.1
RECONNECT_MAX_S = 2.0


@dataclass(slots=True)
class FollowerStats:
    """What /metrics shows about the follower (counts only, never a key)."""

    loads: int = 0
    entries_applied: int = 0
    table_full: int = 0
    store_errors: int = 0
    last_propagation_s: float = 0.0  # store write -> table write, for the last entry applied
    connected: bool = False
    loaded: bool = False


def _id_tuple(entry_id: str) -> tuple[int, int]:
    millis, _, seq = entry_id.partition("-")
    return int(millis), int(seq or 0)


class KeyFollower:
    """Loads and follows the store into the table; the table's one writer."""

    def __init__(self, store: KeyStore, stream_store: KeyStore, writer: KeyTableWriter, *,
                 clock: Callable[[], float] = time.time, backend_errors: tuple[type[BaseException], ...] = (),
                 tenant_index: Callable[[str], int] = lambda _tenant: -1) -> None:
        """``store`` answers commands; ``stream_store`` is a second client for the blocking reads
        (a blocked read would hold up every command behind it on one connection). ``tenant_index``: the
        supervisor's metrics index of a tenant (registered on first sight), written into each entry."""
        self._store = store
        self._stream = stream_store
        self._writer = writer
        self._clock = clock
        self._errors = backend_errors or (OSError, TimeoutError)
        self._tenant_index = tenant_index
        self._last_id: str | None = None  # None: a full load is due
        self._last_n = 0  # the sequence number of the last entry applied
        self._grace_ends: list[tuple[int, bytes]] = []  # (until, digest): a heap of secrets to drop
        self._used_from_minute = int(clock() // 60)  # marks at or after it are collected next
        self._collected_minute = self._used_from_minute  # the minute of the last collection
        self.stats = FollowerStats()
        self.loaded = asyncio.Event()
        self.settled = asyncio.Event()  # the first load either succeeded or failed

    async def close(self) -> None:
        for store in (self._store, self._stream):
            try:
                await store.close()
            except Exception:  # closing a broken connection: nothing left to do
                pass

    # ------------------------------------------------------------------ running

    async def run(self) -> None:
        """Load, then follow until cancelled; reconnects by itself."""
        delay = RECONNECT_BASE_S
        while True:
            try:
                if self._last_id is None:
                    await self.load()
                elif not self.stats.connected:
                    await self._check_log_reach()
                self.stats.connected = True
                delay = RECONNECT_BASE_S
                await self.follow_once()
            except asyncio.CancelledError:
                raise
            except self._errors as exc:
                self._lost(exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RECONNECT_MAX_S)
            except Exception:  # a bug or a reply it cannot read: never stop following
                log.exception("keys: following the key store failed; retrying")
                self.stats.connected = False
                await asyncio.sleep(RECONNECT_MAX_S)

    async def housekeeping(self) -> None:
        """Once a second until cancelled: the minute for use marks, graces, last uses."""
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except self._errors as exc:
                self._lost(exc)
            except Exception:
                log.exception("keys: key table housekeeping failed")
            await asyncio.sleep(1.0)

    async def tick(self) -> None:
        now = self._clock()
        minute = int(now // 60)
        self._writer.set_minute(minute)
        self.end_graces(now)
        if minute > self._collected_minute:  # once a minute: the scan reads every slot of the table
            await self.flush_used(minute)

    # ------------------------------------------------------------------ loading and following

    async def load(self) -> None:
        """Everything in the store into the table; what the store no longer has leaves it."""
        started = time.monotonic()
        newest, last_n = await self._store.log_head()
        kids = await self._store.all_kids()
        now = self._clock()
        kept: set[bytes] = set()
        for start in range(0, len(kids), LOAD_BATCH):  # a batch at a time: records are not all held at once
            batch = kids[start : start + LOAD_BATCH]
            for kid, record in zip(batch, await self._store.records(batch), strict=True):
                if record is not None:
                    kept.update(self.apply(kid, record, now))
        for _, digest in self._writer.occupied():  # what no record names any more
            if digest not in kept:
                self._writer.remove(digest)
        self._last_id, self._last_n = newest, last_n
        self.stats.loads += 1
        self.stats.loaded = True
        self.loaded.set()
        self.settled.set()
        log.info("keys: loaded %d managed keys (%d secrets) into the host table in %.2fs",
                 len(kids), len(self._writer), time.monotonic() - started)

    async def follow_once(self) -> None:
        """One blocking read of the log; applies what it returned."""
        assert self._last_id is not None
        entries = await self._stream.read_log(self._last_id, count=READ_COUNT, block_ms=BLOCK_MS)
        if entries:
            await self.apply_entries(entries)

    async def apply_entries(self, entries: list[LogEntry]) -> None:
        if entries[0].n != self._last_n + 1:
            log.warning("keys: change %d follows %d: %s; reloading every key", entries[0].n, self._last_n,
                        "the store was reset" if entries[0].n <= self._last_n else "changes were trimmed from "
                        "the log before this host read them")
            await self.load()
            return
        kids = list(dict.fromkeys(entry.kid for entry in entries if entry.kid))  # "": a sign-in, no key
        records = await self._store.records(kids)
        now = self._clock()
        for kid, record in zip(kids, records, strict=True):
            self.apply(kid, record, now)
        self._last_id, self._last_n = entries[-1].id, entries[-1].n
        self.stats.entries_applied += len(entries)
        self.stats.last_propagation_s = max(0.0, now - _id_tuple(entries[-1].id)[0] / 1000)

    async def _check_log_reach(self) -> None:
        """After a reconnect: reload when the store went back (it was reset, or replaced by another)."""
        newest, last_n = await self._store.log_head()
        if last_n < self._last_n or _id_tuple(newest) < _id_tuple(self._last_id or "0-0"):
            log.warning("keys: the key store is behind this host's table (reset or replaced); reloading every key")
            await self.load()

    # ------------------------------------------------------------------ the table

    def apply(self, kid: str, record: KeyRecord | None, now: float) -> list[bytes]:
        """Make the table hold the live secrets of ``record`` and drop the ones it names as ended; the
        digests written. None (a kid whose record is gone) changes nothing: records are never deleted,
        and a reset store is caught by the sequence numbers, which reload everything."""
        if record is None:
            return []
        for ended in record.ended(now):
            self._writer.remove(bytes.fromhex(ended))
        written = []
        for digest, blob in views_of(record, now, self._tenant_index(record.tenant)).items():
            try:
                self._writer.put(digest, blob)
            except KeyTableFull as exc:
                self.stats.table_full += 1
                log.error("keys: key %s is not in this host's table: %s", kid, exc)
                continue
            written.append(digest)
        for previous in record.previous:
            if previous.until > now:
                heapq.heappush(self._grace_ends, (previous.until, bytes.fromhex(previous.digest)))
        return written

    def end_graces(self, now: float) -> None:
        """Take out the previous secrets whose rotation grace is over (a digest names one secret of
        one key for ever, so it can go without looking at its record)."""
        ends = self._grace_ends
        while ends and ends[0][0] <= now:
            self._writer.remove(heapq.heappop(ends)[1])

    async def flush_used(self, minute: int) -> None:
        """Write the last use of every key marked since the last flush, at minute resolution."""
        since = self._used_from_minute
        seconds_by_kid: dict[str, int] = {}
        for slot, used in self._writer.table.used_since(since):
            if self._writer.digest_at(slot) is not None:
                kid = decode_entry(self._writer.blob_at(slot), slot).kid
                seconds_by_kid[kid] = max(seconds_by_kid.get(kid, 0), used * 60)
        await self._store.mark_used(seconds_by_kid)
        self._collected_minute = minute
        self._used_from_minute = minute - 1  # a mark racing the minute's end is caught next time

    def _lost(self, exc: BaseException) -> None:
        self.settled.set()
        self.stats.store_errors += 1
        if self.stats.connected or self.stats.store_errors == 1:
            log.warning("keys: the key store is unreachable (%s); known keys keep their last state",
                        type(exc).__name__)
        self.stats.connected = False
