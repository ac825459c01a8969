"""The overlay as the supervisor keeps it for the whole host: the Valkey source and the overlay's age.

``routing.overlay_source`` (docs/fleet.md): the supervisor, not each worker, follows the key, so a host
holds one subscription however many workers it runs (:mod:`gateway.overlay.valkey_source`). Every
accepted document is written atomically to a cache file, and the workers get a config whose
``routing.overlay_file`` is that file: they follow it exactly as they follow an overlay file
(debounced watch, validation, last-known-good, SIGHUP, the supervisor's copy for late workers).
A file rather than a message per worker because that path exists and is tested, a worker that
starts later reads the same file, and a restart while Valkey is down serves the cached document.

Freshness, for every kind of overlay: the age of the overlay at the path the workers follow (its
``rendered_at``, else ``generated_at``) as ``gridgate_overlay_age_seconds``, and a warning when it
passes ``routing.overlay_max_age``, so a control plane that stopped publishing is noticed.

The arbiter calls ``for_workers`` at start and hands it to the ``GenerationSwap`` for every reload,
``open`` before forking, ``start`` / ``stop`` on its loop, ``tick`` and ``cleanup``; the feed is also
a metrics collector on ``/metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gateway.config import Config, ConfigError, OverlaySource
from gateway.overlay.contract import OverlayRejected
from gateway.overlay.freshness import rendered_at
from gateway.overlay.snapshot import Snapshot
from gateway.overlay.valkey_source import OverlayCache, OverlaySourceError, ValkeyOverlaySource
from gateway.overlay.watch import OverlayWatcher, load_overlay_file
from gateway.supervisor.startup import StartupError

log = logging.getLogger("gridgate.supervisor")

CACHE_FILE_NAME = "overlay-cache.json"


class OverlayFreshness:
    """The age of the overlay at the path the workers follow; one warning once it passes the bound."""

    def __init__(self) -> None:
        self.revision: str | None = None
        self.rendered_at: datetime | None = None
        self.snapshot: Snapshot | None = None  # the last accepted document (the console shows its groups)
        self._path: str | None = None
        self._watcher: OverlayWatcher | None = None
        self._stale = False

    def check(self, config: Config, now: datetime) -> None:
        path = config.overlay_path()
        if path != self._path:
            self._path, self.revision, self.rendered_at, self.snapshot = path, None, None, None
            self._watcher = None if path is None else OverlayWatcher(path, 0.0)
            self._read(config)
        elif self._watcher is not None and self._watcher.poll(time.monotonic()):
            self._read(config)
        self._warn(config.routing.overlay_max_age, now)

    def _read(self, config: Config) -> None:
        if self._path is None:
            return
        try:
            snapshot = load_overlay_file(self._path, config.routing.expected_overlay_scope)
        except OverlayRejected:
            return  # the workers keep their last-known-good, so its age is the one that counts
        self.snapshot = snapshot
        self.revision, self.rendered_at = snapshot.revision, rendered_at(snapshot.provenance, snapshot.generated_at)

    def age(self, now: datetime) -> float | None:
        """Seconds since the serving overlay was rendered (0 if its clock is ahead); None if unknown."""
        return None if self.rendered_at is None else max(0.0, (now - self.rendered_at).total_seconds())

    def _warn(self, max_age: float | None, now: datetime) -> None:
        age = self.age(now)
        stale = max_age is not None and age is not None and age > max_age
        if stale and not self._stale:
            log.warning("the serving overlay (revision %s) was rendered %.0fs ago, more than routing.overlay_max_age "
                        "(%gs): is the control plane still publishing?", self.revision, age, max_age)
        elif self._stale and not stale and age is not None:
            log.info("the serving overlay (revision %s) is fresh again: rendered %.0fs ago", self.revision, age)
        self._stale = stale


class OverlayFeed:
    """``routing.overlay_source`` and overlay freshness for one supervisor; see the module docstring."""

    def __init__(self, config: Config) -> None:
        self.settings: OverlaySource | None = config.routing.overlay_source
        self.fallback_file = config.overlay_path()  # with a source: served only when nothing else is there
        self.freshness = OverlayFreshness()
        self.source: ValkeyOverlaySource | None = None
        self._private_dir: str | None = None
        self._task: asyncio.Task[None] | None = None
        if self.settings is not None:
            cache = OverlayCache(self._cache_path(config, self.settings), config.routing.expected_overlay_scope)
            self.source = ValkeyOverlaySource(self.settings.url, self.settings.key, cache,
                                              poll_interval=float(self.settings.poll_interval))

    def _cache_path(self, config: Config, settings: OverlaySource) -> str:
        if settings.cache_file is not None:
            return config.file_path(settings.cache_file)
        state = os.environ.get("STATE_DIRECTORY", "").split(":")[0]  # systemd's StateDirectory=
        if state:
            return os.path.join(state, CACHE_FILE_NAME)
        self._private_dir = tempfile.mkdtemp(prefix="gridgate-overlay-")  # not kept across restarts
        return os.path.join(self._private_dir, CACHE_FILE_NAME)

    # ------------------------------------------------------------------ configs

    def for_workers(self, config: Config) -> Config:
        """``config`` as the workers see it: with a source, ``overlay_file`` is the cache it writes.

        Raises ConfigError for a reload that changes ``routing.overlay_source`` (read at start only).
        """
        if config.routing.overlay_source != self.settings:
            raise ConfigError(["routing.overlay_source: changed; restart the service to apply it"])
        if self.source is None:
            return config
        routing = msgspec.structs.replace(config.routing, overlay_file=self.source.cache.path)
        return msgspec.structs.replace(config, routing=routing)

    # ------------------------------------------------------------------ lifecycle

    def open(self) -> None:
        """Before forking: put the overlay to start with into the cache (raises StartupError)."""
        if self.source is None:
            return
        if self.fallback_file is not None:
            try:
                load_overlay_file(self.fallback_file, self.source.cache.expected_scope)
            except OverlayRejected as exc:
                raise StartupError(f"routing.overlay_file: {self.fallback_file}: {exc}") from None
        try:
            origin = asyncio.run(self._open(self.source, self.fallback_file))
        except OverlaySourceError as exc:
            raise StartupError(str(exc)) from None
        except (ValueError, OSError) as exc:  # a URL the client refuses; the cache directory
            raise StartupError(f"routing.overlay_source: {exc}") from None
        snapshot = self.source.cache.snapshot
        assert snapshot is not None
        log.info("overlay source %s: serving revision %s (from %s), workers follow %s", self.source.where,
                 snapshot.revision, origin, self.source.cache.path)

    @staticmethod
    async def _open(source: ValkeyOverlaySource, fallback_file: str | None) -> str:
        try:
            return await source.open(fallback_file)
        finally:
            await source.close()  # this loop ends here; the serving loop makes its own connections

    def start(self) -> None:
        """On the supervisor's loop: follow the key until ``stop``."""
        if self.source is not None:
            self._task = asyncio.get_running_loop().create_task(self.source.run())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.source is not None:
            await self.source.close()

    def tick(self, config: Config) -> None:
        if self.source is not None:  # a reload may have changed the expected scope
            self.source.cache.expected_scope = config.routing.expected_overlay_scope
        self.freshness.check(config, datetime.now(UTC))

    def cleanup(self) -> None:
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)
            self._private_dir = None

    # ------------------------------------------------------------------ metrics

    def collect(self) -> Iterator[Any]:
        age = self.freshness.age(datetime.now(UTC))
        if age is not None:
            yield GaugeMetricFamily("gridgate_overlay_age_seconds",
                                    "Seconds since the serving overlay was rendered (rendered_at, else generated_at)",
                                    age)
        source = self.source
        if source is None:
            return
        yield GaugeMetricFamily("gridgate_overlay_source_up", "1 while the overlay source (Valkey) answers",
                                1.0 if source.up else 0.0)
        yield CounterMetricFamily("gridgate_overlay_source_outages", "Times the overlay source became unreachable",
                                  source.outages)
        updates = CounterMetricFamily("gridgate_overlay_source_updates",
                                      "Documents read from the overlay source, by outcome", labels=["outcome"])
        for outcome in ("applied", "refreshed", "rejected"):
            updates.add_metric([outcome], source.outcomes[outcome])
        yield updates
