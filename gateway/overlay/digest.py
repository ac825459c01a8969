"""Semantic revision of an overlay document (docs/overlay.md#semantic-revision-digest).

SHA-256 (lowercase hex) of the RFC 8785 (JCS) canonical JSON of
``{candidates, local_site, network, selection_policy?}`` taken from the overlay
document. ``candidates`` is the raw array, unknown fields and float scores included;
``network`` is always present (``null`` when the document has none);
``selection_policy`` only when the document has that key. Timestamps and the
envelope are outside the digest, so re-rendering the same routing keeps the revision.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import rfc8785

# JCS numbers are IEEE-754 doubles. rfc8785 refuses Python ints beyond 2**53; a JSON
# parser of the JCS world (JavaScript, Go float64) reads them as doubles, so we do too.
_SAFE_INT = 2**53 - 1


def digest_input(document: Mapping[str, Any]) -> dict[str, Any]:
    """The object whose canonical form is hashed."""
    selected: dict[str, Any] = {
        "candidates": document.get("candidates"),
        "local_site": document.get("local_site"),
        "network": document.get("network"),
    }
    if "selection_policy" in document:
        selected["selection_policy"] = document["selection_policy"]
    return selected


def _as_doubles(value: Any) -> Any:
    if type(value) is int and abs(value) > _SAFE_INT:
        try:
            return float(value)
        except OverflowError:
            raise rfc8785.IntegerDomainError(value) from None
    if isinstance(value, list):
        return [_as_doubles(item) for item in value]
    if isinstance(value, dict):
        return {key: _as_doubles(item) for key, item in value.items()}
    return value


def canonical_bytes(document: Mapping[str, Any]) -> bytes:
    """RFC 8785 bytes of :func:`digest_input`; raises ``rfc8785.CanonicalizationError`` (a ValueError)."""
    selected = digest_input(document)
    try:
        return rfc8785.dumps(selected)
    except rfc8785.IntegerDomainError:
        return rfc8785.dumps(_as_doubles(selected))


def semantic_revision(document: Mapping[str, Any]) -> str:
    """64-hex semantic revision of an overlay document (the ``overlay`` object of an envelope)."""
    return hashlib.sha256(canonical_bytes(document)).hexdigest()
