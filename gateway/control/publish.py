"""Render the envelope v1 around an overlay document and publish it atomically.

Rules (CONTRACT §4.1, §4.3, §8):

- ``revision.value`` = ``content_digest.value`` = the semantic revision of the
  document; ``provenance.source_generation`` counts publishes and survives
  restarts (it is read back from the file at start); ``rendered_at`` and the
  document's ``generated_at`` are the publish time.
- Publish only when something a gateway acts on changed: the semantic revision, or
  the envelope identity (scope, producer, source) a gateway may check. A new
  timestamp alone is not a publish, so an idle control plane never touches the file.
- Every envelope is validated by the data plane's own validator
  (:func:`gateway.overlay.snapshot.snapshot_from_bytes`) before it is written: a
  rendering bug is logged by the caller and the last good file stays in place.
- Write a temp file in the target's directory, fsync it, rename it over the target,
  fsync the directory: a reader sees the old file or the new one, never a mix, and
  a crash cannot leave a renamed but empty file behind.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from gateway.control.spec import ControlSpec
from gateway.overlay.contract import MAX_OVERLAY_BYTES, TOO_LARGE, OverlayRejected, parse_json
from gateway.overlay.digest import semantic_revision
from gateway.overlay.snapshot import snapshot_from_bytes, snapshot_from_object

SCHEMA_VERSION = "1.0.0"
FILE_MODE = 0o644  # the gateway may run as another (dynamic) user: the overlay must be world-readable

log = logging.getLogger("gridgate.control")

_Signature = tuple[int, int, int, int]


def rfc3339(moment: datetime) -> str:
    """UTC, millisecond precision, ``Z`` suffix: ``2026-01-01T00:00:00.000Z``."""
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def envelope_identity(spec: ControlSpec) -> dict[str, Any]:
    """Envelope fields outside the digest that a gateway may check; a change must be published."""
    return {
        "scope": spec.scope.as_dict(),
        "producer": spec.producer.name,
        "producer_version": spec.producer.version,
        "source_name": spec.scope.network,
        "source_uid": spec.source_uid,
    }


def render_envelope(spec: ControlSpec, document: dict[str, Any], generation: int, now: datetime) -> dict[str, Any]:
    revision = semantic_revision(document)
    stamp = rfc3339(now)
    identity = envelope_identity(spec)
    return {
        "schema_version": SCHEMA_VERSION,
        "revision": {"kind": "content_addressed", "algorithm": "sha256", "value": revision},
        "content_digest": {"algorithm": "sha256", "value": revision},
        "scope": identity["scope"],
        "provenance": {
            "producer": identity["producer"],
            "producer_version": identity["producer_version"],
            "source_name": identity["source_name"],
            "source_uid": identity["source_uid"],
            "source_generation": generation,
            "rendered_at": stamp,
        },
        "overlay": {**document, "generated_at": stamp},
    }


def encode_envelope(envelope: dict[str, Any]) -> bytes:
    # Indented for operators reading the file; the digest is over the JCS form, not these bytes.
    return json.dumps(envelope, indent=2, ensure_ascii=False, allow_nan=False).encode("utf-8") + b"\n"


def write_atomically(path: str, data: bytes, mode: int = FILE_MODE) -> None:
    """Temp file in the same directory, fsync, rename over ``path``, fsync the directory."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, temp_path = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fchmod(handle.fileno(), mode)
            os.fsync(handle.fileno())
        os.replace(temp_path, path)
    except BaseException:
        try:
            os.unlink(temp_path)
        except OSError:
            pass
        raise
    dir_fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(dir_fd)  # makes the rename itself durable
    finally:
        os.close(dir_fd)


def _signature(path: str) -> _Signature | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


@dataclass(frozen=True)
class OnDisk:
    """What the output file holds, as far as publishing cares."""

    revision: str | None  # semantic revision of the valid overlay there, else None
    generation: int  # its provenance.source_generation (0: none), kept even if the rest is invalid
    identity: dict[str, Any] | None
    signature: _Signature | None  # stat identity when read, to notice outside edits


def read_on_disk(spec: ControlSpec) -> OnDisk:
    path = spec.output
    signature = _signature(path)
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_OVERLAY_BYTES + 1)
        root = parse_json(data)
    except FileNotFoundError:
        return OnDisk(None, 0, None, None)
    except (OSError, OverlayRejected) as exc:
        log.warning("existing %s is not readable as an overlay, it will be replaced: %s", path, exc)
        return OnDisk(None, 0, None, signature)
    provenance = root.get("provenance") if isinstance(root, dict) else None
    generation = provenance.get("source_generation") if isinstance(provenance, dict) else None
    generation = generation if type(generation) is int and generation > 0 else 0
    try:
        # No expected scope here: another scope is a different identity (republished), not an error.
        snapshot = snapshot_from_object(root)
    except OverlayRejected as exc:
        log.warning("existing %s is not a valid overlay, it will be replaced: %s", path, exc)
        return OnDisk(None, generation, None, signature)
    if not isinstance(provenance, dict):  # a legacy document: valid, but never ours
        return OnDisk(snapshot.revision, generation, None, signature)
    identity = {
        "scope": snapshot.scope,
        **{key: provenance.get(key) for key in ("producer", "producer_version", "source_name", "source_uid")},
    }
    return OnDisk(snapshot.revision, generation, identity, signature)


@dataclass(frozen=True)
class PublishResult:
    revision: str
    generation: int
    previous_revision: str | None


class Publisher:
    """Owns the output file: publishes a document when its revision (or our identity) differs."""

    def __init__(self, spec: ControlSpec) -> None:
        self.spec = spec
        self.identity = envelope_identity(spec)
        self.on_disk = read_on_disk(spec)

    @property
    def revision(self) -> str | None:
        return self.on_disk.revision

    @property
    def generation(self) -> int:
        return self.on_disk.generation

    def _notice_outside_edits(self) -> None:
        # Someone replaced or removed the file: judge what is there now, not what we wrote. The
        # generation never goes back, even if the file went away.
        if _signature(self.spec.output) != self.on_disk.signature:
            fresh = read_on_disk(self.spec)
            self.on_disk = replace(fresh, generation=max(fresh.generation, self.on_disk.generation))

    def is_current(self, document: dict[str, Any]) -> bool:
        self._notice_outside_edits()
        return semantic_revision(document) == self.on_disk.revision and self.on_disk.identity == self.identity

    def publish(self, document: dict[str, Any], now: datetime) -> PublishResult | None:
        """Write ``document`` if it is not what the file already holds; None when nothing was written.

        Raises :class:`OverlayRejected` (the render does not validate) or :class:`OSError`.
        """
        if self.is_current(document):
            return None
        generation = self.on_disk.generation + 1
        data = encode_envelope(render_envelope(self.spec, document, generation, now))
        if len(data) > MAX_OVERLAY_BYTES:
            raise OverlayRejected(TOO_LARGE, f"rendered overlay is {len(data)} bytes (limit {MAX_OVERLAY_BYTES})")
        snapshot = snapshot_from_bytes(data, self.spec.scope.as_dict())
        write_atomically(self.spec.output, data)
        previous = self.on_disk.revision
        self.on_disk = OnDisk(snapshot.revision, generation, dict(self.identity), _signature(self.spec.output))
        return PublishResult(snapshot.revision, generation, previous)
