"""What the console (gateway.admin.console) reads from the supervisor: the serving overlay's groups and
age, the admin pages' overlay and endpoints documents, and the last requests the workers reported."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import msgspec

from gateway.config import Config
from gateway.overlay.contract import OverlayRejected
from gateway.overlay.snapshot import Snapshot
from gateway.overlay.watch import load_inline_overlay
from gateway.process_protocol import RecentRequests
from gateway.supervisor.observability import SupervisorAdminSources
from gateway.supervisor.overlay_feed import OverlayFeed

RECENT_KEPT = 200


class SupervisorConsoleSources:
    def __init__(self, admin: SupervisorAdminSources, feed: OverlayFeed, running_config: Callable[[], Config]) -> None:
        self._admin = admin
        self._feed = feed
        self._running_config = running_config
        self._inline: tuple[Config, Snapshot | None] | None = None
        # The workers' last requests as they report them (each worker's own ring holds RING_SIZE).
        self._recent: deque[tuple[int, Any]] = deque(maxlen=RECENT_KEPT)

    def on_recent(self, pid: int, message: RecentRequests) -> None:
        self._recent.extend((pid, request) for request in message.requests)

    def recent_requests(self) -> list[dict[str, Any]]:
        """The last requests of every worker, newest first."""
        rows = sorted(self._recent, key=lambda entry: entry[1].ended_at, reverse=True)
        return [{"worker": pid, **msgspec.structs.asdict(request)} for pid, request in rows]

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
