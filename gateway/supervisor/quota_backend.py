"""The quota backend as the supervisor sees it: the bundled Valkey it runs, or the URL the config names,
and the sweep that settles the reservations of workers that died."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
from typing import TYPE_CHECKING, Any

from gateway.config import Config

# Imported before any fork on purpose: the workers inherit its GATEWAY_INSTANCE, so the owner tags
# computed here match the ones in their reservation ids.
from gateway.quota.owner import owner_tag
from gateway.supervisor.startup import StartupError

if TYPE_CHECKING:  # the ledger (and valkey with it) loads only when a worker exits: see _ledger
    from gateway.quota.ledger import QuotaLedger

log = logging.getLogger("gridgate.supervisor")


class EmbeddedQuotaBackend:
    """Starts the bundled Valkey for ``quota.backend.kind: embedded``; stops it at exit."""

    def __init__(self) -> None:
        self._server: Any = None
        self._data_dir: str | None = None
        self._owns_data_dir = False
        self.url: str | None = None
        self._next_restart = 0.0
        self._restart_delay = 1.0

    def ensure_started(self, data_dir: str | None) -> str:
        if self.url is not None:
            return self.url
        from gateway.valkey.embedded import EmbeddedValkey

        # quota.backend.data_dir, else systemd's StateDirectory=, else a private temp dir (not persistent).
        state = os.environ.get("STATE_DIRECTORY", "").split(":")[0]
        if data_dir is None and state:
            data_dir = os.path.join(state, "valkey")
        if data_dir is None:
            self._data_dir, self._owns_data_dir = tempfile.mkdtemp(prefix="gridgate-valkey-"), True
        else:
            self._data_dir = data_dir
        try:
            self._server = EmbeddedValkey(self._data_dir)
            self.url = self._server.start()
        except Exception as exc:
            self.stop()
            raise StartupError(f"quota.backend: cannot start the embedded Valkey in {self._data_dir}: {exc}") from None
        log.info("embedded Valkey started at %s", self.url)
        return self.url

    def watch(self, now: float) -> None:
        """Restart the bundled Valkey if it died: the workers keep their URL and reconnect by themselves."""
        server = self._server
        if server is None or not server.exited() or now < self._next_restart:
            return
        log.error("embedded Valkey exited unexpectedly; restarting it")
        try:
            server.restart()
            log.info("embedded Valkey restarted at %s", self.url)
            self._restart_delay = 1.0
        except Exception as exc:
            log.error("embedded Valkey restart failed (%s); retrying in %.0fs", exc, self._restart_delay)
            self._next_restart = now + self._restart_delay
            self._restart_delay = min(self._restart_delay * 2, 30.0)

    def stop(self) -> None:
        if self._server is not None:
            try:
                self._server.stop()
            except Exception:
                log.exception("stopping the embedded Valkey failed")
            self._server = None
        if self._owns_data_dir and self._data_dir:
            shutil.rmtree(self._data_dir, ignore_errors=True)
        self.url = None


def quota_url_for(config: Config, embedded: EmbeddedQuotaBackend) -> str | None:
    if config.quota is None:
        return None
    backend = config.quota.backend
    if backend.kind == "embedded":
        data_dir = None if backend.data_dir is None else os.path.join(config.base_dir, backend.data_dir)
        return embedded.ensure_started(data_dir)
    return config.quota.backend.url


class ReservationSweeper:
    """Settles a dead worker's open reservations (docs/limits.md#worker-held-blocks) from the
    supervisor's loop: frees their concurrency slots now and charges their estimates (they may have
    reached a provider), through the ledger script, so a worker's late settle of the same reservation
    is a no-op.

    Call ``worker_exited`` when a worker is reaped (every exit: one that drained has nothing left, and
    the sweep finds nothing). Exits that arrive while a sweep runs are coalesced into the next one (a
    reload retires every worker at once). A backend that is down is retried with backoff for up to
    the reservation timeout, after which the ledger has expired those reservations by itself.
    """

    _CLIENT_TIMEOUT_S = 2.0  # a sweep scans the keyspace: more than an admit's 250 ms per reply

    def __init__(self, embedded: EmbeddedQuotaBackend) -> None:
        self._embedded = embedded
        self._pending: dict[str, set[bytes]] = {}  # backend URL -> owner tags to sweep
        self._give_up_after_s: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None
        self._ledgers: dict[str, QuotaLedger] = {}  # backend URL -> a ledger with its own client
        self.reservations_swept = 0
        self.tokens_charged = 0

    def worker_exited(self, config: Config, generation: int, slot: int, pid: int) -> None:
        """Schedule the sweep of the worker (``generation``, ``slot``, ``pid``); never blocks."""
        if config.quota is None or slot < 0:
            return
        try:
            url = quota_url_for(config, self._embedded)
        except StartupError:
            return  # no backend to sweep (the embedded one cannot start): nothing was reserved there
        if url is None:
            return
        self._pending.setdefault(url, set()).add(owner_tag(generation, slot, pid))
        self._give_up_after_s[url] = float(config.quota.reservation_timeout)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self, timeout_s: float = 3.0) -> None:
        """Let a running sweep finish (workers killed at shutdown leave reservations), then stop."""
        if self._task is not None:
            try:
                async with asyncio.timeout(timeout_s):
                    await self._task
            except TimeoutError:
                log.warning("quota: reservation sweep unfinished at shutdown; those expire by themselves")
            self._task = None
        for ledger in self._ledgers.values():
            await ledger.close()
        self._ledgers.clear()

    async def _run(self) -> None:
        while self._pending:
            url, tags = self._pending.popitem()
            await self._sweep(url, sorted(tags), time.monotonic() + self._give_up_after_s.get(url, 120.0))

    async def _sweep(self, url: str, tags: list[bytes], give_up_at: float) -> None:
        from gateway.valkey.client import BACKEND_ERRORS, describe_error

        delay = 0.1
        while True:
            try:
                async with asyncio.timeout(60):
                    released, charged = await self._ledger(url).sweep(tags)
            except BACKEND_ERRORS as exc:
                if time.monotonic() + delay > give_up_at:
                    log.warning("quota: cannot sweep the reservations of %d dead worker(s) (%s); they expire "
                                "by themselves", len(tags), describe_error(exc))
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            self.reservations_swept += released
            self.tokens_charged += charged
            if released:
                log.info("quota: settled %d reservation(s) of %d exited worker(s) at their estimate (%d tokens)",
                         released, len(tags), charged)
            return

    def _ledger(self, url: str) -> QuotaLedger:
        ledger = self._ledgers.get(url)
        if ledger is None:
            from gateway.quota.ledger import QuotaLedger
            from gateway.valkey.client import create_client

            client = create_client(url, timeout_s=self._CLIENT_TIMEOUT_S)
            ledger = self._ledgers[url] = QuotaLedger(client, reservation_timeout_s=1)
        return ledger
