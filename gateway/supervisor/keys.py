"""Managed keys as the supervisor runs them (docs/keys.md): the host table, its follower, the admin store.

``prepare`` (before the first fork) creates the shared-memory key table when the config turns managed
keys on, so every worker inherits it; ``start`` (on the supervisor's loop) runs the follower, which is
the table's only writer, and waits a little for the first load so the first workers already know the
keys. ``reconfigure`` follows a reload: a new store URL reloads the table from the new store. The
admin pages reach the store through ``store()`` (a client of its own with a short timeout, so a store
that does not answer is a quick 503).

The table cannot be created after the workers forked: managed keys turned on by a reload work in the
admin API but reach the workers only after a restart (logged).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gateway.admin.tokens import AdminTokens
from gateway.config import Config, managed_keys_enabled
from gateway.identity.auth import KeyIdentity
from gateway.supervisor.quota_backend import EmbeddedQuotaBackend, quota_url_for
from gateway.supervisor.startup import StartupError
from gateway.valkey.urls import is_cluster_url
from shm.keys import KeyTable, KeyTableWriter

log = logging.getLogger("gridgate.keys")

ADMIN_TIMEOUT_S = 1.0
FIRST_LOAD_WAIT_S = 5.0
STREAM_TIMEOUT_S = 5.0  # above the follower's 1 s blocking read
SCAN_BATCH = 2000  # table slots read between yields to the loop when the budget gauge reads every key


def key_store_url_for(config: Config, embedded: EmbeddedQuotaBackend) -> str | None:
    """The store of managed keys: the quota backend's Valkey, else ``auth.store``; None when off."""
    if not managed_keys_enabled(config):
        return None
    if config.quota is not None:
        return quota_url_for(config, embedded)
    assert config.auth is not None and config.auth.store is not None
    store = config.auth.store
    if store.kind == "valkey":
        return store.url
    data_dir = None if store.data_dir is None else os.path.join(config.base_dir, store.data_dir)
    return embedded.ensure_started(data_dir)


def _is_cluster(url: str) -> bool:
    return is_cluster_url(url)


class KeyService:
    """The supervisor's managed keys: one table, one follower, one admin store client."""

    def __init__(self, embedded: EmbeddedQuotaBackend, tenant_index: Callable[[str], int] = lambda _tenant: -1) -> None:
        """``tenant_index``: the metrics index of a managed key's tenant, which its table entry carries."""
        self._embedded = embedded
        self._tenant_index = tenant_index
        self.table: KeyTable | None = None
        self._writer: KeyTableWriter | None = None
        self._url: str | None = None
        self._follower: Any = None  # gateway.keys.follower.KeyFollower (loaded with the valkey client)
        self._tasks: list[asyncio.Task[None]] = []
        self._admin_store: Any = None  # gateway.keys.store.KeyStore
        self._admin_url: str | None = None
        self._warned_restart = False
        self._keys_read: tuple[int, list[KeyIdentity]] | None = None  # (the writer's changes, its keys) when read

    # ------------------------------------------------------------------ lifecycle

    def prepare(self, config: Config) -> None:
        """Before the first fork: the table (sized by ``auth.key_table_capacity``) and the store URL."""
        url = key_store_url_for(config, self._embedded)
        if url is None or config.auth is None:
            return
        try:
            self.table = KeyTable.create(config.auth.key_table_capacity)
        except (OSError, ValueError) as exc:
            raise StartupError(f"auth.key_table_capacity: cannot map the key table: {exc}") from None
        self._writer = KeyTableWriter(self.table)
        self._url = url

    async def start(self) -> None:
        """Run the follower; wait for its first load, up to FIRST_LOAD_WAIT_S. A store that fails
        delays nothing: the workers start, and the follower keeps trying in the background."""
        if self._url is None:
            return
        self._start_follower(self._url)
        try:
            async with asyncio.timeout(FIRST_LOAD_WAIT_S):
                await self._follower.settled.wait()
        except TimeoutError:
            pass
        if not self._follower.loaded.is_set():
            log.warning("keys: the key store has not answered yet; managed keys are refused until it does "
                        "(keys in auth.keys work)")

    def reconfigure(self, config: Config) -> None:
        """After a reload: follow the new config's store."""
        try:
            url = key_store_url_for(config, self._embedded)
        except StartupError as exc:
            log.error("keys: %s", exc)
            return
        if url is not None and self.table is None:
            if not self._warned_restart:
                log.warning("keys: managed keys were turned on by a reload; the admin API serves them, but "
                            "the workers see them only after a restart")
                self._warned_restart = True
            return
        if (self.table is not None and config.auth is not None
                and config.auth.key_table_capacity != self.table.layout.capacity):
            log.warning("keys: auth.key_table_capacity changed to %d; the table keeps %d until a restart",
                        config.auth.key_table_capacity, self.table.layout.capacity)
        if url != self._url and self.table is not None:
            self._stop_follower()
            self._url = url
            if url is not None:
                log.info("keys: the key store changed; reloading the host table from it")
                self._start_follower(url)

    async def close(self) -> None:
        follower = self._follower
        self._stop_follower(close=False)
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        self._tasks = []
        if follower is not None:
            await follower.close()
        if self._admin_store is not None:
            await _close_quietly(self._admin_store)
            self._admin_store = None

    # ------------------------------------------------------------------ for the admin pages

    def store_for(self, config: Config) -> Any:
        """The admin pages' store of ``config``; None when managed keys are off."""
        try:
            url = key_store_url_for(config, self._embedded)
        except StartupError:
            return None
        if url is None:
            return None
        if url != self._admin_url or self._admin_store is None:
            from gateway.keys.store import KeyStore
            from gateway.valkey.client import create_client

            if self._admin_store is not None:
                asyncio.get_running_loop().create_task(_close_quietly(self._admin_store))
            self._admin_store = KeyStore(create_client(url, timeout_s=ADMIN_TIMEOUT_S), cluster=_is_cluster(url))
            self._admin_url = url
        return self._admin_store

    def on_this_host(self, record: Any) -> dict[str, Any] | None:
        """What this host's table holds for ``record`` (a ``KeyRecord``): its status and how many of
        its secrets, or None when it holds none."""
        if self.table is None:
            return None
        from gateway.keys.view import decode_entry

        status, held = None, 0
        for digest, _ in record.secrets(time.time()):
            found = self.table.find(bytes.fromhex(digest))
            blob = None if found is None else self.table.blob(*found)
            if found is not None and blob is not None:
                status, held = decode_entry(blob, found[0]).status, held + 1
        return None if status is None else {"status": status, "secrets": held}

    async def managed_keys(self) -> list[KeyIdentity]:
        """Every managed key of this host's table (``keys_in_table``); empty when managed keys are off.
        For ``gridgate_budget_remaining_nanousd``: read again only after the table changed."""
        writer = self._writer
        if writer is None:
            return []
        if self._keys_read is None or self._keys_read[0] != writer.changes:
            changes = writer.changes  # as the scan starts: a change during it is read by the next one
            self._keys_read = (changes, await keys_in_table(writer))
        return self._keys_read[1]

    # ------------------------------------------------------------------ metrics

    def collect(self) -> Iterator[Any]:
        if self.table is None:
            return
        yield GaugeMetricFamily("gridgate_keys_table_entries", "Managed-key secrets in this host's table",
                                len(self.table))
        yield GaugeMetricFamily("gridgate_keys_table_capacity", "Secrets this host's key table can hold",
                                self.table.layout.capacity)
        stats = None if self._follower is None else self._follower.stats
        if stats is None:
            return
        yield GaugeMetricFamily("gridgate_keys_store_connected", "1 while the key follower reaches the store",
                                int(stats.connected))
        yield CounterMetricFamily("gridgate_keys_loads", "Full loads of the key table from the store", stats.loads)
        yield CounterMetricFamily("gridgate_keys_changes_applied", "Key changes applied from the change log",
                                  stats.entries_applied)
        yield CounterMetricFamily("gridgate_keys_table_full", "Key secrets the table could not take",
                                  stats.table_full)
        yield CounterMetricFamily("gridgate_keys_store_errors", "Failed round trips to the key store",
                                  stats.store_errors)
        yield GaugeMetricFamily("gridgate_keys_last_propagation_seconds",
                                "From the store's write to this host's table, for the last change applied",
                                stats.last_propagation_s)

    # ------------------------------------------------------------------ internals

    def _start_follower(self, url: str) -> None:
        self._tasks = [task for task in self._tasks if not task.done()]
        from gateway.keys.follower import KeyFollower
        from gateway.keys.store import KeyStore
        from gateway.valkey.client import BACKEND_ERRORS, create_client

        assert self._writer is not None
        cluster = _is_cluster(url)
        self._follower = KeyFollower(
            KeyStore(create_client(url, timeout_s=2.0), cluster=cluster),
            KeyStore(create_client(url, timeout_s=STREAM_TIMEOUT_S), cluster=cluster),
            self._writer, backend_errors=BACKEND_ERRORS, tenant_index=self._tenant_index,
        )
        loop = asyncio.get_running_loop()
        self._tasks += [loop.create_task(self._follower.run()), loop.create_task(self._follower.housekeeping())]

    def _stop_follower(self, close: bool = True) -> None:
        """Cancel the follower's tasks; ``close``: also close its connections, in the background."""
        for task in self._tasks:
            task.cancel()
        if self._follower is not None:
            follower, self._follower = self._follower, None
            if close:
                asyncio.get_running_loop().create_task(follower.close())


async def keys_in_table(writer: KeyTableWriter, batch: int = SCAN_BATCH) -> list[KeyIdentity]:
    """Every managed key ``writer``'s table holds, once per kid, as the quota sees it (a ``KeyIdentity``):
    revoked keys left out, blocked ones kept (their budgets still count). Read ``batch`` slots at a time
    with a yield to the loop between, so a large table never holds up the admin listener; a slot the
    follower changed meanwhile is read as it is then, or skipped when it no longer holds a record."""
    from gateway.keys.record import REVOKED
    from gateway.keys.view import decode_identity

    keys: dict[str | None, KeyIdentity] = {}
    for start in range(0, writer.slots, batch):
        for slot, _digest in writer.occupied(start, start + batch):
            try:
                identity, status = decode_identity(writer.blob_at(slot))
            except ValueError:  # not a record (msgspec's errors are ValueErrors): freed while the scan yielded
                continue
            if status != REVOKED and identity.kid not in keys:
                keys[identity.kid] = identity
        await asyncio.sleep(0)
    return list(keys.values())


async def _close_quietly(store: Any) -> None:
    with contextlib.suppress(Exception):
        await store.close()


class SupervisorKeyHost:
    """The admin key pages' view of the supervisor (``gateway.admin.keys_api.KeyHost``)."""

    def __init__(self, service: KeyService, running_config: Callable[[], Config]) -> None:
        self._service = service
        self._running_config = running_config

    def store(self) -> Any:
        return self._service.store_for(self._running_config())

    def on_this_host(self, record: Any) -> dict[str, Any] | None:
        return self._service.on_this_host(record)

    def backend_errors(self) -> tuple[type[BaseException], ...]:
        from gateway.valkey.client import BACKEND_ERRORS

        return BACKEND_ERRORS


def admin_tokens_of(running_config: Callable[[], Config]) -> Callable[[], AdminTokens]:
    """The admin tokens of the running config, built once per config (a reload may change them)."""
    cache: dict[str, Any] = {"tokens": None, "of": None}

    def current() -> AdminTokens:
        tokens = running_config().admin.tokens
        if cache["of"] is not tokens:
            cache["tokens"], cache["of"] = AdminTokens(tokens), tokens
        return cache["tokens"]

    return current
