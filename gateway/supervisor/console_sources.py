"""What the console (gateway.admin.console) reads from the supervisor: the serving overlay's groups and
age, and the admin pages' overlay and endpoints documents."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from gateway.config import Config
from gateway.overlay.contract import OverlayRejected
from gateway.overlay.snapshot import Snapshot
from gateway.overlay.watch import load_inline_overlay
from gateway.supervisor.observability import SupervisorAdminSources
from gateway.supervisor.overlay_feed import OverlayFeed


class SupervisorConsoleSources:
    def __init__(self, admin: SupervisorAdminSources, feed: OverlayFeed, running_config: Callable[[], Config]) -> None:
        self._admin = admin
        self._feed = feed
        self._running_config = running_config
        self._inline: tuple[Config, Snapshot | None] | None = None

    def overlay_snapshot(self) -> Snapshot | None:
        config = self._running_config()
        if config.routing.candidates is None:
            return self._feed.freshness.snapshot  # the file (or the source's cache file) the workers follow
        if self._inline is None or self._inline[0] is not config:
            try:
                snapshot = load_inline_overlay(config.routing.candidates, config.routing.expected_overlay_scope)
            except OverlayRejected:  # `gridgate check` refuses such a config; nothing to show then
                snapshot = None
            self._inline = (config, snapshot)
        return self._inline[1]

    def overlay_age_s(self) -> float | None:
        return self._feed.freshness.age(datetime.now(UTC))

    def overlay_report(self) -> dict[str, Any]:
        return self._admin.overlay_report()

    def endpoints_report(self) -> dict[str, Any]:
        return self._admin.endpoints_report()
