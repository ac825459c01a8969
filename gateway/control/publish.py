"""Render the envelope v1 around an overlay document and publish it to a file atomically.

Rules (docs/overlay.md#formats, docs/overlay.md#semantic-revision-digest, docs/control-plane.md),
shared with the Valkey publisher (:mod:`gateway.control.valkey_publish`):

- ``revision.value`` = ``content_digest.value`` = the semantic revision of the
  document; ``provenance.source_generation`` counts publishes and survives
  restarts (it is read back from the destination at start); ``rendered_at`` and the
  document's ``generated_at`` are the publish time.
- Publish only when something a gateway acts on changed: the semantic revision, or
  the envelope identity (scope, producer, source) a gateway may check. A new
  timestamp alone is not a publish, so an idle control plane never touches the file
  (unless the spec asks for a ``refresh``: then an unchanged revision is republished
  once the published one is that old, so gateways can tell the control plane is alive).
- Every envelope is validated by the data plane's own validator
  (:func:`gateway.overlay.snapshot.snapshot_from_bytes`) before it is written: a
  rendering bug is logged by the caller and the last good file stays in place.
- Write a temp file in the target's directory, fsync it, rename it over the target,
  fsync the directory (:func:`gateway.overlay.watch.write_atomically`): a reader sees
  the old file or the new one, never a mix.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from gateway.control.spec import ControlSpec
from gateway.overlay.contract import MAX_OVERLAY_BYTES, TOO_LARGE, OverlayRejected, parse_json
from gateway.overlay.digest import semantic_revision
from gateway.overlay.freshness import parse_rfc3339
from gateway.overlay.snapshot import snapshot_from_bytes, snapshot_from_object
from gateway.overlay.watch import write_atomically

SCHEMA_VERSION = "1.0.0"

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


@dataclass(frozen=True)
class Published:
    """What a destination (file or Valkey key) holds, as far as publishing cares."""

    revision: str | None  # semantic revision of the valid overlay there, else None
    generation: int  # its provenance.source_generation (0: none), kept even if the rest is invalid
    identity: dict[str, Any] | None  # None: not one of ours (legacy, invalid, absent)
    rendered_at: datetime | None = None


NOTHING_PUBLISHED = Published(None, 0, None)


def judge_published(data: bytes, where: str) -> Published:
    """What ``data`` found at ``where`` means for the next publish; an invalid overlay is logged."""
    try:
        root = parse_json(data)
    except OverlayRejected as exc:
        log.warning("existing %s is not readable as an overlay, it will be replaced: %s", where, exc)
        return NOTHING_PUBLISHED
    provenance = root.get("provenance") if isinstance(root, dict) else None
    generation = provenance.get("source_generation") if isinstance(provenance, dict) else None
    generation = generation if type(generation) is int and generation > 0 else 0
    try:
        # No expected scope here: another scope is a different identity (republished), not an error.
        snapshot = snapshot_from_object(root)
    except OverlayRejected as exc:
        log.warning("existing %s is not a valid overlay, it will be replaced: %s", where, exc)
        return Published(None, generation, None)
    if not isinstance(provenance, dict):  # a legacy document: valid, but never ours
        return Published(snapshot.revision, generation, None)
    identity = {
        "scope": snapshot.scope,
        **{key: provenance.get(key) for key in ("producer", "producer_version", "source_name", "source_uid")},
    }
    return Published(snapshot.revision, generation, identity, parse_rfc3339(provenance.get("rendered_at")))


def is_current(spec: ControlSpec, held: Published, document: dict[str, Any], now: datetime) -> bool:
    """True when ``held`` already says what ``document`` would: same revision, our identity, and
    (with ``refresh``) rendered recently enough."""
    if semantic_revision(document) != held.revision or held.identity != envelope_identity(spec):
        return False
    if spec.refresh is None:
        return True
    return held.rendered_at is not None and (now - held.rendered_at).total_seconds() < spec.refresh


def render_checked(spec: ControlSpec, document: dict[str, Any], generation: int, now: datetime) -> tuple[bytes, str]:
    """The envelope's bytes and revision, validated as a gateway would validate them.

    Raises :class:`OverlayRejected` when the render is not acceptable (a bug: nothing is published).
    """
    data = encode_envelope(render_envelope(spec, document, generation, now))
    if len(data) > MAX_OVERLAY_BYTES:
        raise OverlayRejected(TOO_LARGE, f"rendered overlay is {len(data)} bytes (limit {MAX_OVERLAY_BYTES})")
    return data, snapshot_from_bytes(data, spec.scope.as_dict()).revision


@dataclass(frozen=True)
class PublishResult:
    revision: str
    generation: int
    previous_revision: str | None


# --------------------------------------------------------------------------- the file


def _signature(path: str) -> _Signature | None:
    try:
        return _signature_of(os.stat(path))
    except OSError:
        return None


def _signature_of(st: os.stat_result) -> _Signature:
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


def read_on_disk(path: str) -> Published:
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_OVERLAY_BYTES + 1)
    except FileNotFoundError:
        return NOTHING_PUBLISHED
    except OSError as exc:
        log.warning("existing %s is not readable, it will be replaced: %s", path, exc)
        return NOTHING_PUBLISHED
    return judge_published(data, path)


class Publisher:
    """Owns the output file: publishes a document when its revision (or our identity) differs."""

    def __init__(self, spec: ControlSpec) -> None:
        assert spec.output is not None
        self.spec = spec
        self.path = spec.output
        self.signature = _signature(self.path)  # stat identity when read, to notice outside edits
        self.on_disk = read_on_disk(self.path)

    @property
    def revision(self) -> str | None:
        return self.on_disk.revision

    @property
    def generation(self) -> int:
        return self.on_disk.generation

    def _notice_outside_edits(self) -> None:
        # Someone replaced or removed the file: judge what is there now, not what we wrote. The
        # generation never goes back, even if the file went away.
        signature = _signature(self.path)
        if signature != self.signature:
            fresh = read_on_disk(self.path)
            self.signature = signature
            self.on_disk = replace(fresh, generation=max(fresh.generation, self.on_disk.generation))

    def publish(self, document: dict[str, Any], now: datetime) -> PublishResult | None:
        """Write ``document`` if it is not what the file already holds; None when nothing was written.

        Raises :class:`OverlayRejected` (the render does not validate) or :class:`OSError`.
        """
        self._notice_outside_edits()
        if is_current(self.spec, self.on_disk, document, now):
            return None
        generation = self.on_disk.generation + 1
        data, revision = render_checked(self.spec, document, generation, now)
        written = write_atomically(self.path, data)
        previous = self.on_disk.revision
        self.on_disk = Published(revision, generation, envelope_identity(self.spec), now)
        # The file we wrote, even if someone removed or replaced it right after the rename.
        self.signature = _signature_of(written)
        return PublishResult(revision, generation, previous)
