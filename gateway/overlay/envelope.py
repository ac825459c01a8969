"""The envelope v1 around an overlay document (docs/overlay.md): its digest objects, scope and
provenance, checked field by field. Pure."""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from gateway.overlay.reasons import MALFORMED_STRUCTURE, OverlayRejected, is_text

SUPPORTED_SCHEMA_VERSION = "1.0.0"
ENVELOPE_MARKERS = ("schema_version", "revision", "content_digest", "scope", "provenance")
SCOPE_FIELDS = ("network", "gateway", "namespace", "local_site")

_HEX64 = re.compile(r"[0-9a-f]{64}")
_RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})")


def digest_object(value: Any, field: str) -> str:
    """`{algorithm: sha256, value: <64 hex>}` (revision adds kind: content_addressed)."""
    if (
        not isinstance(value, dict)
        or value.get("algorithm") != "sha256"
        or type(value.get("value")) is not str
        or not _HEX64.fullmatch(value["value"])
    ):
        raise OverlayRejected(
            MALFORMED_STRUCTURE, f"{field}: must be {{algorithm: sha256, value: <64 lowercase hex>}}"
        )
    return value["value"]


def envelope_scope(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        raise OverlayRejected(
            MALFORMED_STRUCTURE, "scope: must be an object {network, gateway, namespace, local_site}"
        )
    for field in SCOPE_FIELDS:
        if not is_text(value.get(field)):
            raise OverlayRejected(MALFORMED_STRUCTURE, f"scope.{field}: must be 1..256 bytes, not blank")
    return {field: value[field] for field in SCOPE_FIELDS}


def _rfc3339(value: Any) -> bool:
    if type(value) is not str or not _RFC3339.fullmatch(value):
        return False
    try:
        datetime.fromisoformat(value.upper().replace("Z", "+00:00"))
    except ValueError:
        return False
    return True


def provenance(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise OverlayRejected(MALFORMED_STRUCTURE, "provenance: must be an object")
    for field in ("producer", "producer_version", "source_name", "source_uid"):
        if not is_text(value.get(field)):
            raise OverlayRejected(MALFORMED_STRUCTURE, f"provenance.{field}: must be 1..256 bytes, not blank")
    generation = value.get("source_generation")
    if type(generation) is not int or generation <= 0:
        raise OverlayRejected(MALFORMED_STRUCTURE, "provenance.source_generation: must be an integer > 0")
    if not _rfc3339(value.get("rendered_at")):
        raise OverlayRejected(MALFORMED_STRUCTURE, "provenance.rendered_at: must be an RFC 3339 timestamp")
    return dict(value)


def configured_scope(expected: Any) -> dict[str, str]:
    """The non-null fields of an expected scope (a mapping, or an object such as config.OverlayScope)."""
    if expected is None:
        return {}
    if isinstance(expected, Mapping):
        values = {field: expected.get(field) for field in SCOPE_FIELDS}
    else:
        values = {field: getattr(expected, field, None) for field in SCOPE_FIELDS}
    return {field: value for field, value in values.items() if value is not None}
