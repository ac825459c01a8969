"""Routing overlay: contract validation, semantic digest, snapshot index, file reload."""

from gateway.overlay.contract import OverlayRejected, validate_overlay
from gateway.overlay.digest import semantic_revision
from gateway.overlay.snapshot import Snapshot, snapshot_from_bytes, snapshot_from_object

__all__ = [
    "OverlayRejected",
    "Snapshot",
    "semantic_revision",
    "snapshot_from_bytes",
    "snapshot_from_object",
    "validate_overlay",
]
