"""The newest overlay the workers accepted, kept by the supervisor for workers that start later.

A worker that starts while the overlay file is invalid (a crash replacement, SIGTTIN) would otherwise
fail its start-up check and crash-loop; with these bytes it serves the last-known-good revision the
other workers serve (docs/overlay.md#reload) and keeps watching the file like they do.
"""

from __future__ import annotations

import logging

from gateway.config import Config
from gateway.overlay.contract import OverlayRejected
from gateway.overlay.snapshot import snapshot_from_bytes
from gateway.overlay.watch import read_overlay_bytes

log = logging.getLogger("gridgate.supervisor")


class LastGoodOverlay:
    def __init__(self) -> None:
        self.revision: str | None = None
        self.data: bytes | None = None

    def capture(self, config: Config, revision: str | None = None) -> None:
        """Read the file; keep it if valid (and, when given, if it is the ``revision`` a worker serves)."""
        path = config.overlay_path()
        if path is None:
            return
        try:
            data = read_overlay_bytes(path)
            snapshot = snapshot_from_bytes(data, config.routing.expected_overlay_scope)
        except OverlayRejected:
            return
        if revision is None or snapshot.revision == revision:
            self.revision, self.data = snapshot.revision, data

    def observe(self, config: Config, revision: str | None) -> None:
        """A worker reported ``revision``: capture it if it is new to us."""
        if revision and revision != self.revision:
            self.capture(config, revision)
